"""A named tool_choice: the output is constrained to the function's arguments (its
JSON schema, tool_schema.py), so the whole output, ends stripped, is one call's
arguments. The call's name and id go out before its first piece."""

from services.balancer.frontend.tool_parsers.base import CallStream, StreamingParser, StreamPiece, ToolCallDelta


class NamedCallParser(StreamingParser):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self._call = CallStream(0)
        self._sent = 0

    def advance(self, final: bool) -> StreamPiece:
        out = StreamPiece()
        arguments = self.text.strip() if final else self.text.lstrip()
        if not final:  # trailing whitespace may end the arguments: hold it until more comes
            arguments = arguments.rstrip()
        if (arguments or final) and not self._call.started:
            self._call.started = True
            out.calls.append(ToolCallDelta(0, "", id=self._call.id, name=self.name))
        if len(arguments) > self._sent:
            out.calls.append(ToolCallDelta(0, arguments[self._sent :]))
            self._sent = len(arguments)
        return out
