"""POST /v1/responses, GET and DELETE /v1/responses/{id}: a Responses request served
as the chat completion of its conversation (responses_bodies.py), answered in the
Responses shapes (responses_events.py), and kept, with store (OpenAI's default),
in the store the app is given (responses_store.py) for previous_response_id and
retrieval.

The chat path does the work (checks, admission, tools, structured output, the
span, the pump); this file gives it another producer: one that reads the call's
deltas and writes a response object or Responses events. A refusal before the
first token keeps its real status; a 400 names the Responses field, not chat's.
"""

import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, RootModel

from services.balancer.frontend.choices import Call, Finished, split_delta, split_whole
from services.balancer.frontend.errors import APIError
from services.balancer.frontend.responses_bodies import ResponsesRequest, chat_request, input_messages, responses_param
from services.balancer.frontend.responses_events import (
    EventWriter,
    ResponseShape,
    ToolCall,
    conversation_turn,
    final_status,
    new_id,
    output_items,
)
from services.balancer.frontend.responses_store import ResponseStore, StoredResponse
from services.balancer.frontend.serving import OpenAIServer
from services.balancer.frontend.tool_output import whole_message
from services.balancer.generation import GenerationError, Usage

log = logging.getLogger(__name__)


class ResponsesServer:
    def __init__(self, server: OpenAIServer, store: ResponseStore) -> None:
        self.server = server
        self.store = store

    async def create(self, body: ResponsesRequest, http: Request) -> Response:
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            previous = await self._get(body.previous_response_id)
            if previous is None:
                raise APIError(404, f"Previous response with id '{body.previous_response_id}' not found.",
                               param="previous_response_id", code="previous_response_not_found")  # fmt: skip
            history = previous.messages
        chat = chat_request(body, history, body.stream)
        shape = ResponseShape(new_id("resp"), body)
        turns = history + input_messages(body)
        produce = self._events(shape, turns) if body.stream else self._whole(shape, turns)
        try:
            return await self.server.chat(chat, http, produce)
        except APIError as exc:
            param = responses_param(exc.param)
            if exc.param is not None and param != exc.param:
                exc.message = exc.message.replace(exc.param, param or "", 1)
                exc.param = param
            raise

    async def retrieve(self, response_id: str) -> dict[str, Any]:
        stored = await self._get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return stored.response

    async def delete(self, response_id: str) -> dict[str, Any]:
        try:
            deleted = await self.store.delete(response_id)
        except Exception as exc:
            raise _store_down(exc) from None
        if not deleted:
            raise _not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    # -- producers over the chat call -------------------------------------------------

    def _whole(self, shape: ResponseShape, turns: list[dict[str, Any]]):  # noqa: ANN202
        async def produce(call: Call) -> AsyncGenerator[BaseModel, None]:
            finished = Finished(call.jobs[0])
            async with aclosing(self.server.chat_deltas(call)) as deltas:
                async for _, delta in deltas:
                    finished.add(delta)
            reasoning, content = split_whole(call, finished.text)  # as chat splits: before the tool parser
            calls: list[ToolCall] = []
            finish = finished.finish_reason
            if call.tools is not None:
                message, finish = whole_message(call.tools, content, finish)
                content = message.content or ""
                calls = [ToolCall(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or ()]
            status, reason = final_status(finish)
            output = output_items(reasoning, content, calls)
            response = shape.response(status, output, finished.usage, incomplete_reason=reason)
            await self._keep(shape, response, turns)
            yield RootModel[dict[str, Any]](response)

        return produce

    def _events(self, shape: ResponseShape, turns: list[dict[str, Any]]):  # noqa: ANN202
        async def produce(call: Call) -> AsyncGenerator[str, None]:
            writer = EventWriter(shape)
            job = call.jobs[0]
            usage: Usage | None = None
            finish: str | None = None
            async with aclosing(self.server.chat_deltas(call)) as deltas:
                item = await anext(deltas)  # a refusal before the first token raises: its real status
                for event in writer.start():
                    yield event
                try:
                    while item is not None:
                        _, delta = item
                        usage, finish = delta.usage or usage, delta.finish_reason or finish
                        reasoning, text = split_delta(job, delta)  # as chat's chunks: before the tool parser
                        events = writer.reasoning(reasoning or "")
                        if job.tool_stream is None:
                            events += writer.text(text)
                        else:
                            message, _ = job.tool_stream.delta(text, delta.finish_reason)
                            events += writer.text(message.content or "")
                            for piece in message.tool_calls or ():
                                events += writer.call(piece.id, piece.function.name, piece.function.arguments)
                        for event in events:
                            yield event
                        item = await anext(deltas, None)
                except GenerationError as exc:
                    for event in writer.fail(exc.code or exc.error_type, str(exc)):
                        yield event
                    return
                except Exception:
                    log.exception("response stream %s failed", shape.id)
                    for event in writer.fail("server_error", "Internal server error."):
                        yield event
                    return
            final = writer.finish(finish, usage)
            assert writer.final is not None
            await self._keep(shape, writer.final, turns)
            for event in final:
                yield event

        return produce

    # -- the store --------------------------------------------------------------------

    async def _keep(self, shape: ResponseShape, response: dict[str, Any], turns: list[dict[str, Any]]) -> None:
        if not shape.body.store:
            return
        stored = StoredResponse(response, turns + [conversation_turn(response["output"])])
        try:
            await self.store.put(shape.id, stored)
        except Exception:  # the answer still goes out; only the follow-up will not find it
            log.exception("could not store response %s", shape.id)

    async def _get(self, response_id: str) -> StoredResponse | None:
        try:
            return await self.store.get(response_id)
        except Exception as exc:
            raise _store_down(exc) from None


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found")


def _store_down(exc: Exception) -> APIError:
    log.warning("responses store unavailable: %s", exc)
    return APIError(503, "The responses store is unavailable; retry later.", "service_unavailable")
