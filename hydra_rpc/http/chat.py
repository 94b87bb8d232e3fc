"""The chat side of the OpenAI answers: tool calls, reasoning and logprobs.

A chat completion's generated text is read back through the template's format
(``engine.chat``): ``<think>`` blocks become ``reasoning_content``, tool calls become
``tool_calls`` and ``finish_reason: "tool_calls"``. Streamed, the same parse runs on the text so
far and only what changed goes out as a delta, so the deltas add up to the whole answer.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable

from codec.json_text import compact_utf8
from engine.chat.parse import ChatMessage, parse_output
from engine.chat.prompt import ChatPlan, ChatRequestError
from engine.chat.stream import ChatStream
from engine.jobs import TokenEvent

def dumps(obj: Any) -> bytes:
    return compact_utf8(obj, allow_nan=True)  # json.dumps' default: an infinity is written, not refused


# engine stop_reason → OpenAI finish_reason ("none" is a zero-token request; cancelled has none;
# "grammar": the grammar allowed no further token — it is complete as far as it can be)
FINISH_REASON = {"eos": "stop", "stop": "stop", "length": "length", "ctx_full": "length", "none": "length",
                 "grammar": "stop", "cancelled": None}


def finish_reason(stop_reason: str, stop_hit: bool, has_tool_calls: bool) -> str | None:
    """llama-server's rule: a generation that ended on its own with calls in it ends in calls."""
    finish = "stop" if stop_hit else FINISH_REASON.get(stop_reason, "stop")
    return "tool_calls" if has_tool_calls and finish == "stop" else finish


def needs_parsing(plan: ChatPlan | None) -> bool:
    """Whether the output must go through the parser (else it is plain content)."""
    return plan is not None and (plan.parse_tools or (plan.reasoning and plan.fmt.think_open is not None))


def read_reasoning(plan: ChatPlan, opens_reasoning: bool) -> bool:
    return plan.reasoning and opens_reasoning


def parse_message(plan: ChatPlan | None, text: str, opens_reasoning: bool, id_prefix: str) -> ChatMessage:
    """The whole answer's message parts."""
    if not needs_parsing(plan):
        return ChatMessage(content=text, reasoning_content="", tool_calls=[])
    assert plan is not None
    return parse_output(text, plan.fmt, partial=False, in_reasoning=read_reasoning(plan, opens_reasoning),
                        reasoning=plan.reasoning, tools=plan.parse_tools, tool_schemas=plan.tool_schemas,
                        id_prefix=id_prefix)


def message_object(msg: ChatMessage) -> dict[str, Any]:
    """OpenAI's ``message``: content is null when the answer is only tool calls."""
    out: dict[str, Any] = {"role": "assistant",
                           "content": msg.content if msg.content or not msg.tool_calls else None}
    if msg.reasoning_content:
        out["reasoning_content"] = msg.reasoning_content
    if msg.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in msg.tool_calls]
    return out


class DeltaStream:
    """Streamed twin of :func:`parse_message`: text in, OpenAI ``delta`` objects out."""

    def __init__(self, plan: ChatPlan | None, opens_reasoning: bool, id_prefix: str):
        self.parser = None
        if needs_parsing(plan):
            assert plan is not None
            self.parser = ChatStream(plan.fmt, in_reasoning=read_reasoning(plan, opens_reasoning),
                                     reasoning=plan.reasoning, tools=plan.parse_tools,
                                     tool_schemas=plan.tool_schemas, id_prefix=id_prefix)
        self.has_tool_calls = False

    @property
    def plain(self) -> bool:
        return self.parser is None

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.parser is None:
            return [{"content": text}] if text else []
        return self._seen(self.parser.feed(text))

    def finish(self) -> list[dict[str, Any]]:
        if self.parser is None:
            return []
        deltas, msg = self.parser.finish()
        self.has_tool_calls = bool(msg.tool_calls)
        return self._seen(deltas)

    def _seen(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if any("tool_calls" in d for d in deltas):
            self.has_tool_calls = True
        return deltas


# ---------------------------------------------------------------- logprobs and logit_bias
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024


def is_int(v: Any) -> bool:
    """A JSON integer (not a bool)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """A JSON number that is a finite float (not a bool; an integer beyond float range is not)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:  # an integer beyond float range
        return False


def read_logprobs(body: dict[str, Any], kind: str) -> tuple[bool, int]:
    """(report logprobs, top alternatives per token) from OpenAI's ``logprobs``/``top_logprobs``
    (an integer ``logprobs`` on completions: the legacy form) or llama-server's ``n_probs``."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if kind == "text" and is_int(lp):
        lp, top = True, lp
    if lp not in (None, True, False):
        raise ChatRequestError("'logprobs' must be a boolean", "logprobs")
    n = body.get("n_probs", top)
    if n is not None and (not is_int(n) or not 0 <= n <= MAX_TOP_LOGPROBS):
        raise ChatRequestError(f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
    return bool(lp) or bool(n), n or 0


def read_logit_bias(value: Any, n_vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` or llama-server's ``[[id, bias|false], ...]``; false bans."""
    if value is None:
        return ()
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        pairs = [(p[0], p[1]) for p in value]
    else:
        raise ChatRequestError("'logit_bias' must be an object of token id → bias", "logit_bias")
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ChatRequestError(f"'logit_bias' may name at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
    out = []
    for tok, bias in pairs:
        tid = int(tok) if isinstance(tok, str) and tok.lstrip("-").isdigit() else tok
        if not is_int(tid) or not 0 <= tid < n_vocab:
            raise ChatRequestError(f"'logit_bias' names token {tok!r}, not an id in 0..{n_vocab - 1}", "logit_bias")
        if bias is False:
            bias = -math.inf
        elif not is_number(bias):
            raise ChatRequestError(f"'logit_bias' for token {tid} must be a number or false", "logit_bias")
        out.append((tid, float(bias)))
    return tuple(out)


def _json_logprob(lp: float) -> float:
    return lp if math.isfinite(lp) else -9999.0  # JSON has no -inf


def _token_entry(piece: bytes, logprob: float) -> dict[str, Any]:
    return {"token": piece.decode("utf-8", "replace"), "logprob": _json_logprob(logprob), "bytes": list(piece)}


def logprob_item(ev: TokenEvent) -> dict[str, Any]:
    """One generated token in OpenAI's ``logprobs.content`` form (llama-server adds the id)."""
    item = _token_entry(ev.piece, ev.logprob)
    item["id"] = ev.token
    item["top_logprobs"] = [_token_entry(p, lp) for p, lp in ev.top]
    return item


def logprobs_object(events: Iterable[TokenEvent]) -> dict[str, Any]:
    return {"content": [logprob_item(ev) for ev in events]}


# ---------------------------------------------------------------- streamed chunks
class TextEvent:
    """A text chunk's SSE event, pre-rendered around its text: the stream sends one per token,
    and dumping the whole object each time costs about as much as a tiny model's decode."""

    SENTINEL = "\x00hydra-text\x00"

    def __init__(self, template: dict[str, Any]):
        head, sep, tail = dumps(template).partition(dumps(self.SENTINEL))
        assert sep, "the template must hold the sentinel text"
        self.head, self.tail = b"data: " + head, tail + b"\n\n"

    def render(self, text: str) -> bytes:
        return self.head + dumps(text) + self.tail



class ChunkSink:
    """One stream's text → SSE events. Plain text takes the pre-rendered fast path; chat
    answers that need parsing go through :class:`DeltaStream`; logprobs ride on the chunk of
    their token."""

    def __init__(self, kind: str, chunk: Callable[..., dict[str, Any]], out: list[bytes], *,
                 plan: ChatPlan | None, opens_reasoning: bool, id_prefix: str, logprobs: bool):
        self.kind, self.chunk, self.out, self.logprobs = kind, chunk, out, logprobs
        self.deltas = DeltaStream(plan, opens_reasoning, id_prefix) if kind == "chat" else None
        self.fast = (self.deltas is None or self.deltas.plain) and not logprobs
        self.text_event = TextEvent(chunk(text=TextEvent.SENTINEL))

    @property
    def has_tool_calls(self) -> bool:
        return self.deltas is not None and self.deltas.has_tool_calls

    def text(self, text: str, ev: TokenEvent | None = None) -> None:
        """``text`` (what the stop filter let through) generated with token ``ev``."""
        if self.fast:
            if text:
                self.out.append(self.text_event.render(text))
            return
        if self.kind != "chat":
            self._event(self.chunk(text=text), ev)
            return
        assert self.deltas is not None
        deltas = self.deltas.feed(text) if text else []
        if not deltas and ev is not None and self.logprobs:
            deltas = [{}]  # the token's logprob goes out though its text is held back
        for i, d in enumerate(deltas):
            obj = self.chunk()
            obj["choices"][0]["delta"] = d
            self._event(obj, ev if i == 0 else None)

    def finish(self) -> None:
        """What the parser held back, once the text is complete."""
        for d in self.deltas.finish() if self.deltas is not None else []:
            obj = self.chunk()
            obj["choices"][0]["delta"] = d
            self._event(obj, None)

    def _event(self, obj: dict[str, Any], ev: TokenEvent | None) -> None:
        if ev is not None and self.logprobs:
            obj["choices"][0]["logprobs"] = {"content": [logprob_item(ev)]}
        self.out.append(b"data: " + dumps(obj) + b"\n\n")
