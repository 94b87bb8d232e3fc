"""OpenAI streaming deltas for a chat answer being generated.

Each piece of generated text re-parses the answer so far as partial (see ``parse``) and sends
what grew since the last piece. The parse is prefix-consistent, so a delta only ever appends;
should a parse disagree with what was already sent (a call that turns out malformed), nothing
is taken back: the disagreeing part is simply not sent, and the final message is what the
deltas add up to.
"""
from __future__ import annotations

from typing import Any

from .parse_json import Memo
from .formats import ChatFormat
from .parse import ChatMessage, ParseOptions, ToolCall, parse_with


class ChatStream:
    """Turns text pieces into OpenAI ``delta`` dicts.

    Guarantee: the ``reasoning_content``, the ``content`` and, per call index, the
    ``arguments`` of all deltas from :meth:`feed` and :meth:`finish` concatenate to the fields
    of the message :meth:`finish` returns, whose call names and ids are those first sent.
    """

    def __init__(self, fmt: ChatFormat, *, in_reasoning: bool = False, reasoning: bool = True,
                 tools: bool = True, tool_schemas: dict[str, dict] | None = None,
                 id_prefix: str = "call_") -> None:
        self._opts = ParseOptions(fmt, in_reasoning, reasoning, tools, tool_schemas, id_prefix)
        self._memo = Memo()  # valid because the text only grows
        self._text = ""
        self._sent = ChatMessage()

    @property
    def text(self) -> str:
        """All text fed so far."""
        return self._text

    def feed(self, text_piece: str) -> list[dict[str, Any]]:
        """Appends a piece of generated text; returns the deltas for what it made certain."""
        if not text_piece:
            return []
        self._text += text_piece
        return self._send(parse_with(self._text, self._opts, True, self._memo))

    def finish(self) -> tuple[list[dict[str, Any]], ChatMessage]:
        """The deltas still owed once generation has ended, and the final message."""
        deltas = self._send(parse_with(self._text, self._opts, False, self._memo))
        sent = self._sent
        final = ChatMessage(sent.content, sent.reasoning_content,
                            [ToolCall(c.name, c.arguments, c.id) for c in sent.tool_calls])
        return deltas, final

    def _send(self, msg: ChatMessage) -> list[dict[str, Any]]:
        sent = self._sent
        deltas: list[dict[str, Any]] = []
        grown = _growth(sent.reasoning_content, msg.reasoning_content)
        if grown:
            sent.reasoning_content += grown
            deltas.append({"reasoning_content": grown})
        grown = _growth(sent.content, msg.content)
        if grown:
            sent.content += grown
            deltas.append({"content": grown})
        for index, call in enumerate(msg.tool_calls):
            if index == len(sent.tool_calls):
                sent.tool_calls.append(ToolCall(call.name, call.arguments, call.id))
                deltas.append(_new_call(index, call))
                continue
            old = sent.tool_calls[index]
            if old.name != call.name or old.id != call.id:
                break  # a disagreeing parse: nothing after it can be trusted either
            grown = _growth(old.arguments, call.arguments)
            if grown:
                old.arguments += grown
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": grown}}]})
            if not call.arguments.startswith(old.arguments):
                break
        return deltas


def _growth(sent: str, now: str) -> str:
    """What ``now`` appends to ``sent``; "" when it does not extend it."""
    if len(now) > len(sent) and now.startswith(sent):
        return now[len(sent):]
    return ""


def _new_call(index: int, call: ToolCall) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments}}]}
