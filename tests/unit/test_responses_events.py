"""The Responses event stream and conversation turns, exactly: EventWriter fed a
reply's pieces (reasoning, text, a call) writes OpenAI's events in order, numbered,
with each item's output_index; the request's items become chat messages."""

import json
from typing import Any

from services.balancer.frontend.responses_bodies import ResponsesRequest, input_messages
from services.balancer.frontend.responses_events import (
    EventWriter,
    ResponseShape,
    ToolCall,
    conversation_turn,
    output_items,
)
from services.balancer.generation import Usage


def parsed(events: list[str]) -> list[dict[str, Any]]:
    out = []
    for event in events:
        head, data = event.removesuffix("\n\n").split("\n")
        body = json.loads(data.removeprefix("data: "))
        assert head == f"event: {body['type']}"
        out.append(body)
    return out


def test_text_then_a_call_closes_the_message_before_the_call() -> None:
    body = ResponsesRequest.model_validate({"model": "m", "input": "x"})
    writer = EventWriter(ResponseShape("resp_1", body, created_at=7))
    events = writer.start() + writer.text("Let me ") + writer.text("check.") + writer.text("")
    events += writer.call("call_9", "get_weather", '{"city":') + writer.call(None, None, ' "Bern"}')
    events += writer.finish("stop", Usage(5, 4, 2))
    got = parsed(events)
    assert [(e["type"], e.get("output_index")) for e in got] == [
        ("response.created", None), ("response.in_progress", None),
        ("response.output_item.added", 0), ("response.content_part.added", 0),
        ("response.output_text.delta", 0), ("response.output_text.delta", 0),
        ("response.output_text.done", 0), ("response.content_part.done", 0), ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.delta", 1), ("response.function_call_arguments.done", 1),
        ("response.output_item.done", 1), ("response.completed", None),
    ]  # fmt: skip
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    assert got[0]["response"]["status"] == "in_progress" and got[0]["response"]["output"] == []
    assert got[6]["text"] == "Let me check."
    assert got[12]["arguments"] == '{"city": "Bern"}' and got[12]["name"] == "get_weather"
    final = got[-1]["response"]
    assert final["status"] == "completed" and final["created_at"] == 7
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert final["output"][1]["call_id"] == "call_9" and final["output"][1]["id"] == got[9]["item"]["id"]
    assert final["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 4,
                              "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 9}  # fmt: skip
    assert conversation_turn(final["output"]) == {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Bern"}'}}]}



def test_reasoning_is_its_own_item_closed_before_the_message() -> None:
    body = ResponsesRequest.model_validate({"model": "m", "input": "x"})
    writer = EventWriter(ResponseShape("resp_1", body))
    events = writer.start() + writer.reasoning("Think ") + writer.reasoning("") + writer.reasoning("hard.")
    events += writer.text("Done.") + writer.finish("stop", Usage(1, 3, 0))
    got = parsed(events)
    assert [(e["type"], e.get("output_index")) for e in got][2:] == [
        ("response.output_item.added", 0), ("response.content_part.added", 0),
        ("response.reasoning_text.delta", 0), ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0), ("response.content_part.done", 0), ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.content_part.added", 1), ("response.output_text.delta", 1),
        ("response.output_text.done", 1), ("response.content_part.done", 1), ("response.output_item.done", 1),
        ("response.completed", None),
    ]  # fmt: skip
    item_id = got[2]["item"]["id"]
    assert item_id.startswith("rs_") and got[2]["item"] == {"type": "reasoning", "id": item_id, "summary": [],
                                                            "content": [], "status": "in_progress"}  # fmt: skip
    assert got[3]["part"] == {"type": "reasoning_text", "text": ""}
    assert [e["delta"] for e in got[4:6]] == ["Think ", "hard."]
    assert all(e["item_id"] == item_id and e["content_index"] == 0 for e in got[3:8])
    assert got[6]["text"] == "Think hard." and got[7]["part"] == {"type": "reasoning_text", "text": "Think hard."}
    reasoning = {"type": "reasoning", "id": item_id, "summary": [],
                 "content": [{"type": "reasoning_text", "text": "Think hard."}], "status": "completed"}  # fmt: skip
    assert got[8]["item"] == reasoning and got[-1]["response"]["output"][0] == reasoning
    assert conversation_turn(got[-1]["response"]["output"]) == {"role": "assistant", "content": "Done."}


def test_a_failure_mid_reasoning_closes_the_reasoning_item() -> None:
    body = ResponsesRequest.model_validate({"model": "m", "input": "x"})
    writer = EventWriter(ResponseShape("resp_1", body))
    got = parsed(writer.start() + writer.reasoning("Hm") + writer.fail("server_error", "boom"))
    assert [e["type"] for e in got][-4:] == ["response.reasoning_text.done", "response.content_part.done",
                                             "response.output_item.done", "response.failed"]  # fmt: skip
    assert got[-1]["response"]["output"][0]["content"] == [{"type": "reasoning_text", "text": "Hm"}]


def test_whole_output_items() -> None:
    [reasoning, message] = output_items("Hm.", "Hi.", [])
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text", "text": "Hm."}]
    assert message["content"][0]["text"] == "Hi."
    # No reasoning (None, or a block left empty): no reasoning item; calls only: no message.
    assert [i["type"] for i in output_items(None, "Hi.", [])] == ["message"]
    assert [i["type"] for i in output_items("", "Hi.", [])] == ["message"]
    assert [i["type"] for i in output_items("Hm.", "", [ToolCall("c", "f", "{}")])] == ["reasoning", "function_call"]


def test_a_reply_cut_at_max_output_tokens_ends_incomplete() -> None:
    body = ResponsesRequest.model_validate({"model": "m", "input": "x", "max_output_tokens": 2})
    writer = EventWriter(ResponseShape("resp_1", body))
    got = parsed(writer.start() + writer.text("ab") + writer.finish("length", Usage(1, 2, 0)))
    assert got[-1]["type"] == "response.incomplete"
    assert got[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_failure_after_the_start_is_response_failed() -> None:
    body = ResponsesRequest.model_validate({"model": "m", "input": "x"})
    writer = EventWriter(ResponseShape("resp_1", body))
    got = parsed(writer.start() + writer.text("a") + writer.fail("service_unavailable", "decode died"))
    assert [e["type"] for e in got][-2:] == ["response.output_item.done", "response.failed"]
    assert got[-1]["response"]["error"] == {"code": "service_unavailable", "message": "decode died"}


def test_items_become_chat_messages() -> None:
    body = ResponsesRequest.model_validate({"model": "m", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "c", "annotations": []}]},
        {"type": "function_call", "call_id": "1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "1", "output": "x"},
        {"type": "function_call_output", "call_id": "2", "output": "y"},
    ]})  # fmt: skip
    # The assistant's text and the calls after it are one turn.
    assert input_messages(body) == [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "c", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "1", "content": "x"}, {"role": "tool", "tool_call_id": "2", "content": "y"},
    ]  # fmt: skip
