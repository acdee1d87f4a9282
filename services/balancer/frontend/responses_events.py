"""Responses API output: the response object (whole, or as it stands mid-stream) and
the server-sent events of a streamed one, in the shapes of the `openai` package's
types (openai/types/responses), so its client parses them.

A streamed response is a sequence of typed events, each with a sequence_number:
response.created, response.in_progress, then per output item output_item.added,
(a reasoning item:) content_part.added, reasoning_text.delta...,
reasoning_text.done, content_part.done, (a message:) content_part.added,
output_text.delta..., output_text.done, content_part.done, (a function call:)
function_call_arguments.delta..., function_call_arguments.done, then
output_item.done; last response.completed (or response.incomplete at
max_output_tokens, response.failed on an error). No `data: [DONE]`: OpenAI's
Responses stream has none.

Reasoning: the chat call's own split (choices.split_whole, split_delta: the
reasoning parser the server chose) becomes a reasoning item before the message,
its text as one reasoning_text part (OpenAI's shape for raw reasoning, as vLLM
writes it; no summary is made).
"""

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.balancer.frontend.responses_bodies import ResponsesRequest
from services.balancer.generation import Usage

def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(slots=True)
class ToolCall:
    call_id: str
    name: str
    arguments: str


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [_text_part(text)] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.call_id, "name": call.name,
            "arguments": call.arguments, "status": status}  # fmt: skip


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [_reasoning_part(text)] if status == "completed" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def usage_body(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def output_items(reasoning: str | None, text: str | None, calls: list[ToolCall]) -> list[dict[str, Any]]:
    """A whole reply's output items: the reasoning item (when the reply reasoned), the
    message (unless the reply is calls only), the calls."""
    items: list[dict[str, Any]] = []
    content = text or ""
    if reasoning:
        items.append(reasoning_item(new_id("rs"), reasoning))
    if content or not calls:
        items.append(message_item(new_id("msg"), content))
    items += [call_item(new_id("fc"), call) for call in calls]
    return items


def conversation_turn(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The output as the chat message a next turn (previous_response_id) continues
    from: the assistant's text and calls (its reasoning left out, as chat templates do)."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [
        {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in output if item["type"] == "function_call"
    ]  # fmt: skip
    turn: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        turn["tool_calls"] = calls
    return turn


@dataclass(slots=True)
class ResponseShape:
    """What every state of one response shares: the request's settings, echoed."""

    id: str
    body: ResponsesRequest
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(
        self, status: str, output: list[dict[str, Any]], usage: Usage | None = None,
        error: dict[str, Any] | None = None, incomplete_reason: str | None = None,
    ) -> dict[str, Any]:
        body = self.body
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        tool_choice: Any = body.tool_choice or ("auto" if body.tools else "none")
        if not isinstance(tool_choice, str):
            tool_choice = tool_choice.model_dump()
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": body.model, "output": output, "usage": usage_body(usage), "error": error,
            "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
            "instructions": body.instructions, "metadata": body.metadata or {}, "user": body.user,
            "max_output_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()], "tool_choice": tool_choice,
            "parallel_tool_calls": body.parallel_tool_calls,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "previous_response_id": body.previous_response_id, "store": body.store,
        }


def final_status(finish_reason: str | None) -> tuple[str, str | None]:
    """(status, incomplete reason) of a reply that ended with finish_reason."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


class EventWriter:
    """One streamed response's events, numbered; fed the chat stream's pieces
    (reasoning, text, call pieces) in order, it opens and closes output items as
    OpenAI's stream does."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []
        """Finished items, in order."""
        self._reasoning: tuple[str, str] | None = None
        """The open reasoning item: (item id, text so far)."""
        self._message: tuple[str, str] | None = None
        """The open message: (item id, text so far)."""
        self._call: tuple[str, ToolCall] | None = None
        """The open function call: (item id, call so far)."""
        self.final: dict[str, Any] | None = None
        """The response as response.completed (or .incomplete) carries it."""

    def event(self, type_: str, **fields: Any) -> str:
        body = {"type": type_, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {type_}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        state = self.shape.response("in_progress", [])
        return [self.event("response.created", response=state), self.event("response.in_progress", response=state)]

    def reasoning(self, delta: str) -> list[str]:
        """A piece of reasoning: it opens the reasoning item (closing what is open), or adds to it."""
        if not delta:
            return []
        events = self._close_message() + self._close_call()
        index = len(self.output)
        if self._reasoning is None:
            item_id = new_id("rs")
            self._reasoning = (item_id, "")
            events.append(self.event("response.output_item.added", output_index=index,
                                     item=reasoning_item(item_id, "", "in_progress")))  # fmt: skip
            events.append(self.event("response.content_part.added", item_id=item_id, output_index=index,
                                     content_index=0, part=_reasoning_part("")))  # fmt: skip
        item_id, text = self._reasoning
        self._reasoning = (item_id, text + delta)
        events.append(self.event("response.reasoning_text.delta", item_id=item_id, output_index=index,
                                 content_index=0, delta=delta))  # fmt: skip
        return events

    def text(self, delta: str) -> list[str]:
        if not delta:
            return []
        events = self._close_reasoning() + self._close_call()
        index = len(self.output)
        if self._message is None:
            item_id = new_id("msg")
            self._message = (item_id, "")
            events.append(self.event("response.output_item.added", output_index=index,
                                     item=message_item(item_id, "", "in_progress")))  # fmt: skip
            events.append(self.event("response.content_part.added", item_id=item_id, output_index=index,
                                     content_index=0, part=_text_part("")))  # fmt: skip
        item_id, text = self._message
        self._message = (item_id, text + delta)
        events.append(self.event("response.output_text.delta", item_id=item_id, output_index=index,
                                 content_index=0, delta=delta, logprobs=[]))  # fmt: skip
        return events

    def call(self, call_id: str | None, name: str | None, arguments: str | None) -> list[str]:
        """A piece of a call: call_id and name start a new one; arguments add to the open one."""
        events: list[str] = []
        if call_id is not None:
            events += self._close_reasoning() + self._close_message() + self._close_call()
            item_id = new_id("fc")
            self._call = (item_id, ToolCall(call_id, name or "", ""))
            events.append(self.event("response.output_item.added", output_index=len(self.output),
                                     item=call_item(item_id, self._call[1], "in_progress")))  # fmt: skip
        if arguments and self._call is not None:
            item_id, call = self._call
            call.arguments += arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=item_id,
                                     output_index=len(self.output), delta=arguments))  # fmt: skip
        return events

    def finish(self, finish_reason: str | None, usage: Usage | None) -> list[str]:
        events = self._close_open()
        status, reason = final_status(finish_reason)
        self.final = self.shape.response(status, self.output, usage, incomplete_reason=reason)
        events.append(self.event(f"response.{status}", response=self.final))
        return events

    def fail(self, code: str, message: str) -> list[str]:
        events = self._close_open()
        error = {"code": code, "message": message}
        events.append(self.event("response.failed", response=self.shape.response("failed", self.output, error=error)))
        return events

    def _close_open(self) -> list[str]:
        """Close whichever item is open (at most one is)."""
        return self._close_reasoning() + self._close_message() + self._close_call()

    def _close_reasoning(self) -> list[str]:
        if self._reasoning is None:
            return []
        item_id, text = self._reasoning
        self._reasoning = None
        index = len(self.output)
        item = reasoning_item(item_id, text)
        self.output.append(item)
        return [
            self.event("response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0,
                       text=text),
            self.event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                       part=_reasoning_part(text)),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def _close_message(self) -> list[str]:
        if self._message is None:
            return []
        item_id, text = self._message
        self._message = None
        index = len(self.output)
        item = message_item(item_id, text)
        self.output.append(item)
        return [
            self.event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                       text=text, logprobs=[]),
            self.event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                       part=_text_part(text)),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def _close_call(self) -> list[str]:
        if self._call is None:
            return []
        item_id, call = self._call
        self._call = None
        index = len(self.output)
        item = call_item(item_id, call)
        self.output.append(item)
        return [
            self.event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                       name=call.name, arguments=call.arguments),
            self.event("response.output_item.done", output_index=index, item=item),
        ]
