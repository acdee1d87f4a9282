"""The body of POST /v1/responses (OpenAI's Responses API) and how it becomes a chat
request: a Responses request is served as the chat completion of the same
conversation, sampling, tools and structured output (serving.py's chat path), so
both endpoints answer alike.

  * input: a string (one user message) or items: messages (user, system, developer,
    assistant; input_text / output_text parts), function_call and
    function_call_output (a tool round trip: an assistant tool call, a tool message),
    reasoning (an earlier output's reasoning item, sent back as OpenAI asks clients
    that keep their own context to: accepted, and left out of the prompt, as chat
    templates leave out past reasoning and previous_response_id's turns do);
  * instructions: a system message first (not carried to the next turn, as OpenAI);
  * previous_response_id: the stored conversation goes before the new input;
  * tools: Responses' flat function tools, tool_choice, parallel_tool_calls;
  * text.format: text, json_schema or json_object, as chat's response_format;
  * max_output_tokens, temperature, top_p, seed as chat's.

Every other field is refused with a 400 naming it (extra="forbid"): reasoning,
include, truncation, background, prompt, conversation, top_logprobs, built-in tools...
"""

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationError

from services.balancer.frontend.body_fields import StrictBody, Text
from services.balancer.frontend.errors import APIError
from services.balancer.frontend.request_bodies import ChatCompletionRequest
from services.balancer.frontend.tool_bodies import MAX_TOOLS, FunctionName

MAX_METADATA_KEYS = 16
"""OpenAI's: at most 16 pairs, keys up to 64 characters, values up to 512."""


class InputText(StrictBody):
    type: Literal["input_text"]
    text: Text


class OutputText(StrictBody):
    type: Literal["output_text"]
    text: Text
    annotations: list[Any] | None = Field(None, max_length=0)
    """Echoed back from an earlier response; none are made here, so none may come."""
    logprobs: list[Any] | None = None
    """Echoed back from an earlier response; ignored (they describe past output)."""


Part = Annotated[InputText | OutputText, Field(discriminator="type")]


class MessageItem(StrictBody):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[Part]
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(StrictBody):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(StrictBody):
    type: Literal["function_call_output"]
    call_id: Text
    output: Text
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class SummaryText(StrictBody):
    type: Literal["summary_text"]
    text: Text


class ReasoningText(StrictBody):
    type: Literal["reasoning_text"]
    text: Text


class ReasoningItem(StrictBody):
    type: Literal["reasoning"]
    id: Text
    summary: list[SummaryText]
    content: list[ReasoningText] | None = None
    encrypted_content: None = None
    """None made here; another server's cannot be read, so one is refused, not ignored."""
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_type(item: Any) -> str:
    # OpenAI's "easy" message ({role, content}) has no type: it is a message.
    if isinstance(item, dict):
        return str(item.get("type", "message"))
    return str(getattr(item, "type", "message"))


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(StrictBody):
    type: Literal["function"]
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(StrictBody):
    type: Literal["function"]
    name: Text


class TextFormatText(StrictBody):
    type: Literal["text"]


class TextFormatJsonObject(StrictBody):
    type: Literal["json_object"]


class TextFormatJsonSchema(StrictBody):
    type: Literal["json_schema"]
    name: Text = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: Text | None = None
    strict: bool | None = None


TextFormat = Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")]


class TextConfig(StrictBody):
    format: TextFormat | None = None


class ResponsesRequest(StrictBody):
    model: Text
    input: Text | list[InputItem]
    instructions: Text | None = None
    previous_response_id: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    """vLLM's extension (not in OpenAI's Responses): as chat's seed."""
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    """OpenAI's default: kept (with a TTL) for previous_response_id and GET."""
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[Text, Field(max_length=512)]] | None = Field(
        None, max_length=MAX_METADATA_KEYS
    )
    """Labels only: returned with the response, never read."""
    user: Text | None = None
    """Labels only: returned with the response, never read."""


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as chat messages (without instructions nor earlier turns):
    function_call items join the assistant message before them (its text and calls
    are one turn, as a stored response's output becomes one), else start one."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[dict[str, Any]] = []
    for item in body.input:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text})
        elif isinstance(item, ReasoningItem):
            continue  # past reasoning: not in the prompt (the template would drop it too)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the turn's text and its calls: one message
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


def chat_request(body: ResponsesRequest, history: list[dict[str, Any]], stream: bool) -> ChatCompletionRequest:
    """The chat request that serves body: instructions, then history (the stored
    conversation of previous_response_id), then the input. A 400 names the
    Responses field at fault."""
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions is not None else [])
    messages += history + input_messages(body)
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "stream": stream,
                            "parallel_tool_calls": body.parallel_tool_calls}  # fmt: skip
    if stream:
        chat["stream_options"] = {"include_usage": True}
    for name, chat_name in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                            ("top_p", "top_p"), ("seed", "seed")):
        value = getattr(body, name)
        if value is not None:
            chat[chat_name] = value
    if body.tools:
        chat["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in body.tools
        ]
    if body.tool_choice is not None:
        choice = body.tool_choice
        chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
    fmt = body.text.format if body.text is not None else None
    if isinstance(fmt, TextFormatJsonObject):
        chat["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, TextFormatJsonSchema):
        schema = fmt.model_dump(exclude={"type"}, exclude_none=True, by_alias=True)
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        raise _responses_error(exc) from None


def responses_param(chat_param: str | None) -> str | None:
    """A chat field's name as the Responses request names it."""
    if chat_param is None:
        return None
    head, _, rest = chat_param.partition(".")
    if head == "messages":
        return "input"
    if head == "tools":  # tools.0.function.strict -> tools.0.strict
        return "tools" + ("." + rest.replace("function.", "", 1) if rest else "")
    if head == "response_format":
        return "text.format" + ("." + rest.replace("json_schema.", "", 1) if rest else "")
    return {"max_completion_tokens": "max_output_tokens"}.get(head, chat_param)


def _responses_error(exc: ValidationError) -> APIError:
    error = exc.errors()[0]
    loc = ".".join(str(x) for x in error.get("loc", ()) if "[" not in str(x))
    message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    param = responses_param(loc) or "input"
    return APIError(400, f"{param}: {message}", param=param)
