"""A chat reply as tool calls: what a request's tools and tool_choice make of the
model's output, whole (message.tool_calls) or streamed (delta.tool_calls).

  * no tools, or tool_choice "none": the output is content, as the model wrote it;
  * "auto": the model's own calls, read by the parser of its template's family
    (tool_parsers; balancer.tool_call_parser), the text around them content;
  * "required" and a named function: the output is constrained to the calls
    (tool_schema.py) and read back as calls, never as content.

finish_reason is "tool_calls" when the reply holds a call and ended by itself.
Without parallel_tool_calls an auto reply keeps its first call only.
"""

from dataclasses import dataclass
from typing import Any, Literal

from services.balancer.frontend import protocol as p
from services.balancer.frontend.errors import APIError
from services.balancer.frontend.tool_parsers import (
    PARSERS,
    NamedCallParser,
    StreamingParser,
    ToolCallDelta,
    choose_parser,
    json_array,
    parse_whole,
)
from services.balancer.frontend.tool_schema import checked_constraint, named_schema, required_schema
from shared.recipe import Recipe


@dataclass(slots=True)
class ToolPlan:
    """How one chat request's output becomes tool calls."""

    mode: Literal["auto", "required", "named"]
    parser: str | None = None
    """auto: the parser family (a key of tool_parsers.PARSERS)."""
    function: str | None = None
    """named: the function every reply calls."""
    parallel: bool = True
    schema: dict[str, Any] | None = None
    """required and named: the JSON schema the output is constrained to."""
    schema_param: str = "tools"
    """The field a 400 about the schema names."""
    spec: Any = None
    """The schema as the engine's structured-output spec (checked_constraint)."""

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the output is read with its special tokens (the parser's format is made of them)."""
        return self.new_parser().keeps_special_tokens

    def new_parser(self) -> StreamingParser:
        if self.mode == "named":
            assert self.function is not None
            return NamedCallParser(self.function)
        if self.mode == "required":
            return json_array()
        assert self.parser is not None
        return PARSERS[self.parser]()


class ToolSupport:
    """The model's tool-call format, chosen once (the setting, or its chat template's)."""

    def __init__(self, setting: str, recipe: Recipe) -> None:
        self.parser = choose_parser(setting, recipe.chat_template_source(with_tools=True))

    async def plan(self, body: p.ChatCompletionRequest) -> ToolPlan | None:
        """The request's plan, a forced choice's constraint checked; None when its output
        is plain content. 400s name the field."""
        plan = self._plan(body)
        if plan is not None and plan.schema is not None:
            plan.spec = await checked_constraint(plan.schema, plan.schema_param)
        return plan

    def _plan(self, body: p.ChatCompletionRequest) -> ToolPlan | None:
        if not body.tools or body.tool_choice == "none":
            return None
        choice = body.tool_choice or "auto"
        if choice == "auto":
            for i, tool in enumerate(body.tools):
                if tool.function.strict:
                    raise APIError(
                        400, f"tools.{i}.function.strict: true is honoured only where the output is constrained "
                        "(tool_choice 'required' or this function named); with 'auto' the model's calls are "
                        "read as written, so leave strict unset or false", param=f"tools.{i}.function.strict",
                    )
            if self.parser is None:
                raise APIError(
                    400, "tool_choice: this model's chat template asks for tool calls in a format no parser "
                    f"here reads; set the balancer's tool_call_parser to one of {sorted(PARSERS)}",
                    param="tool_choice",
                )
            return ToolPlan("auto", parser=self.parser, parallel=body.parallel_tool_calls)
        if choice == "required":
            schema = required_schema(body.tools, body.parallel_tool_calls)
            return ToolPlan("required", parallel=body.parallel_tool_calls, schema=schema, schema_param="tools")
        # The body checked that the name is among the tools.
        i = next(i for i, t in enumerate(body.tools) if t.function.name == choice.function.name)
        tool = body.tools[i]
        return ToolPlan("named", function=tool.function.name, schema=named_schema(tool),
                        schema_param=f"tools.{i}.function.parameters")  # fmt: skip


def _delta_calls(deltas: list[ToolCallDelta]) -> list[p.DeltaToolCall] | None:
    calls = [
        p.DeltaToolCall(
            index=d.index, id=d.id, type="function" if d.id is not None else None,
            function=p.DeltaFunctionCall(name=d.name, arguments=d.arguments),
        )
        for d in deltas
    ]  # fmt: skip
    return calls or None


def _finish(finish: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and finish == "stop" else finish


def whole_message(plan: ToolPlan, text: str, finish: str | None) -> tuple[p.ChatResponseMessage, str | None]:
    """A whole reply's message and finish_reason."""
    parsed = parse_whole(plan.new_parser(), text)
    calls = parsed.tool_calls if plan.parallel else parsed.tool_calls[:1]
    tool_calls = [p.ToolCallOut(id=c.id, function=p.FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls]
    message = p.ChatResponseMessage(content=parsed.content, tool_calls=tool_calls or None)
    return message, _finish(finish, bool(calls))


class ToolStream:
    """One choice's stream read for calls: each delta's text becomes content and call pieces."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.parser = plan.new_parser()
        self.any_call = False

    def delta(self, text: str, finish: str | None) -> tuple[p.DeltaMessage, str | None]:
        piece = self.parser.feed(text)
        if finish is not None:
            piece.add(self.parser.finish())
        deltas = [d for d in piece.calls if self.plan.parallel or d.index == 0]
        self.any_call = self.any_call or bool(deltas)
        return p.DeltaMessage(content=piece.content or None, tool_calls=_delta_calls(deltas)), _finish(
            finish, self.any_call
        )
