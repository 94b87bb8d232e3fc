"""An OpenAI completion request, validated before a slot is taken (``/v1/chat/completions``,
``/v1/completions`` and llama-server's ``/completion``): every field we act on is checked
and refused with the parameter it names; unknown fields are ignored, as OpenAI servers do.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.chat.prompt import ChatPlan, ChatRequestError, normalize_messages, plan_chat, read_chat_options
from engine.jobs import ReloadFailed, stops_refused
from engine.sampling import GrammarSpec
from engine.status import ModelChoice

from hydra_rpc.http.chat import is_int, is_number, read_logit_bias, read_logprobs
from hydra_rpc.http.errors import ApiError

@dataclass
class CompletionRequest:
    kind: str  # chat | text
    messages: list | None = None
    prompt: str | None = None
    tokens: list[int] | None = None
    n_predict: int = 0
    sampling: dict[str, Any] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    slot: int | None = None
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    chat: ChatPlan | None = None  # chat requests: template variables, grammar, output parsing
    grammar: GrammarSpec | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    n_probs: int = 0  # top alternatives per token (OpenAI top_logprobs, llama-server n_probs)
    logprobs: bool = False  # report each generated token's logprob


def parse_completion_request(body: dict[str, Any], kind: str, engine: Any) -> CompletionRequest:
    """Validate the fields we act on; unknown fields are ignored, as OpenAI servers do."""
    req = CompletionRequest(kind)
    _read_input(req, body)
    n = body.get("n")
    if n is not None and n != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    if body.get("echo") or (body.get("best_of") not in (None, 1)):
        raise ApiError(400, "'echo' and 'best_of' are not supported", param="echo")
    req.n_predict = _max_tokens(body, engine)
    req.sampling = _read_sampling(body)
    req.stop = _read_stop(body)
    _read_routing(req, body, engine)
    _read_constraints(req, body, engine)
    return req


def _read_input(req: CompletionRequest, body: dict[str, Any]) -> None:
    if req.kind == "chat":
        try:
            req.messages = normalize_messages(body.get("messages"))
        except ChatRequestError as e:
            raise ApiError(400, str(e), param=e.param) from None
    else:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            req.prompt = p
        elif isinstance(p, list) and p and all(is_int(t) for t in p):
            req.tokens = p
        else:
            raise ApiError(400, "'prompt' must be a string or an array of token ids (one prompt per request)",
                           param="prompt")


_SAMPLING_FIELDS = (("temperature", lambda v: is_number(v) and v >= 0, "a number ≥ 0"),
                    ("top_p", lambda v: is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
                    ("min_p", lambda v: is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
                    ("top_k", lambda v: is_int(v) and 0 <= v < 2**31, "an integer ≥ 0"),
                    ("seed", is_int, "an integer"),
                    ("repeat_penalty", lambda v: is_number(v) and v > 0, "a number > 0"),
                    ("frequency_penalty", lambda v: is_number(v) and -2 <= v <= 2, "a number in [-2, 2]"),
                    ("presence_penalty", lambda v: is_number(v) and -2 <= v <= 2, "a number in [-2, 2]"))


def _read_sampling(body: dict[str, Any]) -> dict[str, Any]:
    sampling = {}
    for key, check, what in _SAMPLING_FIELDS:
        v = body.get(key)
        if v is None:
            continue
        if not check(v):
            raise ApiError(400, f"'{key}' must be {what}", param=key)
        sampling[key] = v
    return sampling


def _read_stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise ApiError(400, "'stop' must be a string or an array of strings", param="stop")
    stops = [s for s in (stop or []) if s]
    if (why := stops_refused(stops)) is not None:
        raise ApiError(400, why, param="stop")
    return stops


def _read_routing(req: CompletionRequest, body: dict[str, Any], engine: Any) -> None:
    """The slot, the model and how the answer is sent."""
    slot = body.get("slot", body.get("id_slot"))  # id_slot: llama-server's name
    if slot is not None and slot != -1:
        if not is_int(slot):
            raise ApiError(400, "'slot' must be an integer", param="slot")
        if not 0 <= slot < engine.n_slots:
            raise ApiError(404, f"unknown slot {slot} (this engine has slots 0..{engine.n_slots - 1})", param="slot")
        req.slot = slot
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", param="model")
    req.model = model or None
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    req.stream = bool(stream)
    opts = body.get("stream_options")
    req.include_usage = isinstance(opts, dict) and opts.get("include_usage") is True


def _read_constraints(req: CompletionRequest, body: dict[str, Any], engine: Any) -> None:
    """Tools, reasoning, grammars, logit_bias and logprobs: all checked here, before a slot is taken."""
    try:
        opts = read_chat_options(body, default_reasoning_format=engine.reasoning_format,
                                 default_grammar=engine.default_grammar, default_budget=engine.reasoning_budget)
        if req.kind == "chat":
            assert req.messages is not None
            req.chat = plan_chat(req.messages, opts, engine.chat_syntax)
            req.messages, req.grammar = req.chat.messages, req.chat.grammar
        elif body.get("tools") is not None:
            raise ChatRequestError("'tools' are for /v1/chat/completions", "tools")
        else:
            req.grammar = opts.response_format
        req.logit_bias = read_logit_bias(body.get("logit_bias"), engine.n_vocab)
        req.logprobs, req.n_probs = read_logprobs(body, req.kind)
    except ChatRequestError as e:
        raise ApiError(400, str(e), param=e.param) from None


def _max_tokens(body: dict[str, Any], engine: Any) -> int:
    # n_predict first, as llama-server reads it: Hydra Core's prefill fallback adds n_predict 0
    # to a client body that may carry its own max_tokens
    for key in ("n_predict", "max_completion_tokens", "max_tokens"):
        v = body.get(key)
        if v is None:
            continue
        if not is_int(v) or v < -1:
            raise ApiError(400, f"'{key}' must be an integer ≥ 0", param=key)
        if v >= 0:
            return v
    # No limit given: the T1 default, else up to the slot's context (the engine stops at ctx_full).
    return engine.default_n_predict


async def select_model(engine: Any, requested: str | None) -> ModelChoice:
    """The ``model`` field, like PREFILL's (see ``EngineApi.select_model``): a configured alias of
    another file swaps the model and the request runs on it; any other name is served by the
    resident model, as llama-server does."""
    try:
        return await engine.select_model(requested)
    except ReloadFailed as e:  # the reload failed or was dropped; the old model still serves
        raise ApiError(503, f"model {requested!r} could not be loaded: {e}", param="model") from None


