"""OpenAI-compatible completions on the engine actor: ``/v1/chat/completions`` and ``/v1/completions``.

A request becomes one ``GenJob`` on one slot, submitted to the same actor and scheduler
as RPC work, so HTTP generations batch and interleave with RPC decodes. The job is
cancelled whenever the handler leaves without a finished result: the client closed the
connection (aiohttp cancels the handler, see ``http.app``), a stream write failed, or a
stop sequence was matched here first. Cancelling frees the slot before the next step.

Also here, because ``GET /v1/decode/{id}`` answers with the same objects: the OpenAI error
body, the completion object builders and the stop-sequence handling.
"""
from __future__ import annotations

import asyncio
import codecs
import json
import math
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

from engine.chat.prompt import ChatPlan, ChatRequestError, normalize_messages, plan_chat, read_chat_options
from engine.jobs import BadInput, EngineBusy, EngineUnavailable, GenJob, GenResult, ReloadFailed
from engine.sampling import GrammarSpec
from engine.status import ModelChoice

from hydra_rpc.http.chat import (ChunkSink, dumps, finish_reason, is_int, is_number, logprobs_object, message_object,
                        parse_message, read_logit_bias, read_logprobs)
from hydra_rpc.hydra.wire import client_behind, limit_send_buffer

MAX_STOPS, MAX_STOP_BYTES = 16, 256
ERROR_TYPES = {400: "invalid_request_error", 403: "permission_error", 404: "not_found_error",
               405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
               429: "rate_limit_error", 501: "not_supported_error", 503: "unavailable_error"}


# ---------------------------------------------------------------- errors
class ApiError(Exception):
    """Answered as an OpenAI-style error object (llama-server puts the HTTP status in ``code``)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 headers: dict[str, str] | None = None, extra: dict[str, Any] | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers or {}
        self.extra = extra or {}

    def body(self) -> dict[str, Any]:
        return {**error_body(self.status, self.message, self.param), **self.extra}

    def response(self) -> web.Response:
        return json_response(self.body(), status=self.status, headers=self.headers)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=dumps(obj), status=status, headers=headers, content_type="application/json")


def engine_error(e: BaseException) -> ApiError:
    """Map an engine refusal to an HTTP answer (never a traceback)."""
    if isinstance(e, EngineBusy):
        if e.retry_after_ms is not None:  # reloading with the reject policy: come back later
            return ApiError(503, str(e), headers={"Retry-After": str(max(1, math.ceil(e.retry_after_ms / 1000)))},
                            extra={"retry_after_ms": e.retry_after_ms})
        # the slot's queue (--slot-queue) is full: the request was deferred as far as llama-server
        # defers one, and the client may come back (503 + Retry-After, not 429: nobody is rate-limited)
        return ApiError(503, str(e), headers={"Retry-After": "1"}, extra={"retry_after_ms": 1000})
    if isinstance(e, BadInput):
        return ApiError(400, str(e))
    if isinstance(e, EngineUnavailable):
        return ApiError(503, str(e))
    if type(e).__module__.startswith("jinja2"):  # the model's chat template refused the messages
        return ApiError(400, f"the chat template rejected the messages: {e}", param="messages")
    return ApiError(500, f"generation failed: {type(e).__name__}: {e}")


def require_ready(engine: Any) -> None:
    if engine is None or engine.startup_stage != "ready":
        stage = getattr(engine, "startup_stage", "init")
        raise ApiError(503, f"no model loaded yet (startup stage {stage})", headers={"Retry-After": "1"})


async def read_json_object(request: web.Request, max_body: int) -> dict[str, Any]:
    # Refuse a declared oversize body before reading any of it.
    if request.content_length is not None and request.content_length > max_body:
        raise ApiError(413, f"request body of {request.content_length} bytes exceeds the limit of {max_body}")
    raw = await request.read()  # aiohttp enforces client_max_size for chunked bodies → 413
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"invalid JSON body: {e}") from None
    except RecursionError:
        raise ApiError(400, "invalid JSON body: nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, not {type(body).__name__}")
    return body


# ---------------------------------------------------------------- request parsing
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
    if kind == "chat":
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
    n = body.get("n")
    if n is not None and n != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    if body.get("echo") or (body.get("best_of") not in (None, 1)):
        raise ApiError(400, "'echo' and 'best_of' are not supported", param="echo")
    req.n_predict = _max_tokens(body, engine)
    for key, check, what in (("temperature", lambda v: is_number(v) and v >= 0, "a number ≥ 0"),
                             ("top_p", lambda v: is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
                             ("min_p", lambda v: is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
                             ("top_k", lambda v: is_int(v) and 0 <= v < 2**31, "an integer ≥ 0"),
                             ("seed", is_int, "an integer"),
                             ("repeat_penalty", lambda v: is_number(v) and v > 0, "a number > 0"),
                             ("frequency_penalty", lambda v: is_number(v) and -2 <= v <= 2, "a number in [-2, 2]"),
                             ("presence_penalty", lambda v: is_number(v) and -2 <= v <= 2, "a number in [-2, 2]")):
        v = body.get(key)
        if v is None:
            continue
        if not check(v):
            raise ApiError(400, f"'{key}' must be {what}", param=key)
        req.sampling[key] = v
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise ApiError(400, "'stop' must be a string or an array of strings", param="stop")
    req.stop = [s for s in (stop or []) if s]
    # The engine looks for stops in the last 256 bytes it generated; longer ones could only
    # be caught here, after the tokens were already spent.
    if len(req.stop) > MAX_STOPS or any(len(s.encode("utf-8")) > MAX_STOP_BYTES for s in req.stop):
        raise ApiError(400, f"at most {MAX_STOPS} stop sequences of at most {MAX_STOP_BYTES} bytes each",
                       param="stop")
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
    _read_constraints(req, body, engine)
    return req


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
    """The ``model`` field, like PREFILL's (see ``Engine.select_model``): a configured alias of
    another file swaps the model and the request runs on it; any other name is served by the
    resident model, as llama-server does."""
    try:
        return await engine.select_model(requested)
    except ReloadFailed as e:  # the reload failed or was dropped; the old model still serves
        raise ApiError(503, f"model {requested!r} could not be loaded: {e}", param="model") from None


# ---------------------------------------------------------------- stop sequences
def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """Text up to the earliest stop sequence (OpenAI returns it without the stop)."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


class StopFilter:
    """Streaming twin of :func:`cut_at_stop`: holds back any tail that could start a stop
    sequence, so a stop split across tokens is never sent."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.buf = ""
        self.hit = False

    def feed(self, text: str) -> str:
        if not self.stops or self.hit:
            return "" if self.hit else text
        self.buf += text
        out, self.hit = cut_at_stop(self.buf, self.stops)
        if self.hit:
            self.buf = ""
            return out
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.buf)), keep, -1):
                if self.buf.endswith(s[:k]):
                    keep = k
                    break
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out

    def flush(self) -> str:
        out, self.buf = ("" if self.hit else self.buf), ""
        return out


# ---------------------------------------------------------------- response objects
def usage_of(res: GenResult | None) -> dict[str, Any]:
    p = res.prompt_tokens if res else 0
    c = res.tokens_generated if res else 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": res.cached_tokens if res else 0}}


def completion_object(kind: str, cid: str, created: int, model: str, text: str, finish: str | None,
                      res: GenResult | None, generation: int) -> dict[str, Any]:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": cid, "object": "chat.completion" if kind == "chat" else "text_completion", "created": created,
            "model": model, "system_fingerprint": f"hydra-rpc-g{generation}", "choices": [choice],
            "usage": usage_of(res)}


def chunk_object(kind: str, cid: str, created: int, model: str, generation: int, text: str | None = None,
                 finish: str | None = None, role: bool = False) -> dict[str, Any]:
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    return {"id": cid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": created, "model": model, "system_fingerprint": f"hydra-rpc-g{generation}",
            "choices": [choice]}


def timings_of(res: GenResult) -> dict[str, Any]:
    """llama-server's ``timings`` (integer counts, float ms and rates), then ours."""
    def per_second(n: int, ms: float) -> float:
        return round(n / ms * 1000, 3) if ms > 0 else 0.0

    prompt_n, predicted_n = res.prompt_tokens - res.cached_tokens, res.tokens_generated
    return {"cache_n": res.cached_tokens, "prompt_n": prompt_n, "prompt_ms": round(res.prefill_ms, 3),
            "prompt_per_second": per_second(prompt_n, res.prefill_ms), "predicted_n": predicted_n,
            "predicted_ms": round(res.decode_ms, 3), "predicted_per_second": per_second(predicted_n, res.decode_ms),
            "prefill_ms": round(res.prefill_ms, 3), "decode_ms": round(res.decode_ms, 3),
            "cached_tokens": res.cached_tokens}


def drain_events(job: GenJob) -> list[Any]:
    """The token events of a finished job that nobody streamed."""
    out = []
    while not job.events.empty():
        ev = job.events.get_nowait()
        if ev is not None:
            out.append(ev)
    return out


async def outcome(job: GenJob) -> GenResult | None:
    """The job's result; None if the engine cancelled it; engine errors as ApiError.

    ``asyncio.wait`` rather than ``await job.result()``: a job the engine cancels resolves
    to a cancelled future, which must not look like this handler being cancelled.
    """
    await asyncio.wait({job.done})
    if job.done.cancelled():
        return None
    exc = job.done.exception()
    if exc is not None:
        raise engine_error(exc)
    return job.done.result()


# ---------------------------------------------------------------- the handlers
class OpenAIRoutes:
    def __init__(self, app: Any, max_body: int, metrics: Any):
        self.app, self.max_body, self.metrics = app, max_body, metrics

    def add_to(self, router: web.UrlDispatcher) -> None:
        for path in ("/v1/chat/completions", "/chat/completions"):
            router.add_post(path, self.chat)
        for path in ("/v1/completions", "/completions"):
            router.add_post(path, self.completions)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "text")

    async def _serve(self, request: web.Request, kind: str) -> web.StreamResponse:
        engine = self.app.engine
        require_ready(engine)
        creq = parse_completion_request(await read_json_object(request, self.max_body), kind, engine)
        choice = await select_model(engine, creq.model)
        model = choice.name
        # no slot named: the engine picks one when it admits the job (prompt similarity, then LRU)
        sampling = replace(engine.sampling_for(creq.sampling), grammar=creq.grammar, logit_bias=creq.logit_bias,
                           n_probs=creq.n_probs)
        job = GenJob(creq.slot, messages=creq.messages, prompt=creq.prompt, tokens=creq.tokens, n_predict=creq.n_predict,
                     sampling=sampling, stop=creq.stop, params=choice.params, want_logprobs=creq.logprobs,
                     template_vars=creq.chat.template_vars if creq.chat else None,
                     reasoning_budget=creq.chat.reasoning_budget if creq.chat else None)
        try:
            engine.submit(job)
        except (EngineBusy, BadInput, EngineUnavailable) as e:
            raise engine_error(e) from None
        cid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        reason = "cancelled"  # unless we get to the end
        try:
            if creq.stream:
                resp, reason = await self._stream(request, creq, job, cid, model)
            else:
                resp, reason = await self._whole(creq, job, cid, model)
            return resp
        except ApiError:
            reason = "error"
            raise
        finally:
            job.cancel()  # no-op for a finished job; otherwise frees the slot before the next step
            if self.metrics is not None:
                self.metrics.observe_generation("chat" if kind == "chat" else "completions", reason)

    async def _whole(self, creq: CompletionRequest, job: GenJob, cid: str, model: str) -> tuple[web.Response, str]:
        res = await outcome(job)
        if res is None:
            raise ApiError(503, "generation cancelled: the engine is stopping")
        text, hit = cut_at_stop(res.text.decode("utf-8", "replace"), creq.stop)
        obj = completion_object(creq.kind, cid, int(time.time()), model, text, None, res, res.config_generation)
        choice = obj["choices"][0]
        calls = False
        if creq.kind == "chat":
            msg = parse_message(creq.chat, text, job.opens_reasoning, id_prefix=f"call_{cid[-12:]}_")
            choice["message"], calls = message_object(msg), bool(msg.tool_calls)
        choice["finish_reason"] = finish_reason(res.stop_reason, hit, calls)
        if creq.logprobs:
            choice["logprobs"] = logprobs_object(drain_events(job))
        obj.update(slot=res.slot, id_slot=res.slot, config_generation=res.config_generation, timings=timings_of(res))
        return json_response(obj), ("stop" if hit else res.stop_reason)

    async def _stream(self, request: web.Request, creq: CompletionRequest, job: GenJob, cid: str,
                      model: str) -> tuple[web.StreamResponse, str]:
        events = job.stream()
        try:
            return await self._stream_events(request, creq, job, cid, model, events)
        finally:
            await events.aclose()

    async def _stream_events(self, request: web.Request, creq: CompletionRequest, job: GenJob, cid: str,
                             model: str, events: Any) -> tuple[web.StreamResponse, str]:
        # Wait for the first token before sending the headers, so a refused or failed job
        # (queue full, prompt too long) still gets a real status code and an error object.
        ev = await anext(events, None)
        res = None
        if ev is None:
            res = await outcome(job)
        gen = res.config_generation if res else self.app.engine.generation
        created = int(time.time())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        if request.transport is not None:
            limit_send_buffer(request.transport)
        await resp.prepare(request)

        def chunk(**kw: Any) -> dict[str, Any]:
            return chunk_object(creq.kind, cid, created, model, gen, **kw)

        out: list[bytes] = []  # events not written yet
        sink = ChunkSink(creq.kind, chunk, out, plan=creq.chat, opens_reasoning=job.opens_reasoning,
                         id_prefix=f"call_{cid[-12:]}_", logprobs=creq.logprobs)

        async def flush() -> None:
            if out:
                data = b"".join(out)
                out.clear()
                # a write into a transport that flow control paused waits on the client: the job
                # pauses meanwhile and its slot says waiting_on "client"
                transport = request.transport
                blocked = transport is not None and client_behind(transport)
                if blocked:
                    job.set_client_blocked(True)
                try:
                    await resp.write(data)
                finally:
                    if blocked:
                        job.set_client_blocked(False)

        def event(obj: dict[str, Any]) -> None:
            out.append(b"data: " + dumps(obj) + b"\n\n")

        try:
            if creq.kind == "chat":
                event(chunk(role=True))
            utf8 = codecs.getincrementaldecoder("utf-8")("replace")
            stops = StopFilter(creq.stop)
            while ev is not None:
                sink.text(stops.feed(utf8.decode(ev.piece)), ev)
                if stops.hit:
                    job.cancel()  # we matched the stop first; do not generate past it
                    break
                # Tokens arrive in bursts (one scheduler step can yield many): write a burst
                # at once; a write per token costs more than a small model's decode.
                if job.events.empty() or len(out) >= 256:
                    await flush()
                ev = await anext(events, None)
            sink.text(stops.feed(utf8.decode(b"", final=True)) + stops.flush())
            sink.finish()
            try:
                res = res or await outcome(job)
            except ApiError as e:  # headers are out: report in-band, as llama-server does
                event(e.body())
                out.append(b"data: [DONE]\n\n")
                await flush()
                return resp, "error"
            reason = "stop" if stops.hit else (res.stop_reason if res else "cancelled")
            last = chunk(finish=finish_reason(reason, stops.hit, sink.has_tool_calls))
            if res is not None:  # as llama-server: a client without the usage chunk reads these
                last.update(id_slot=res.slot, timings=timings_of(res))
            event(last)
            if creq.include_usage:
                event({**chunk(), "choices": [], "usage": usage_of(res)})
            out.append(b"data: [DONE]\n\n")
            await flush()
            await resp.write_eof()
            return resp, reason
        except ConnectionResetError:  # the client went away mid-stream (aiohttp's ClientConnectionResetError)
            return resp, "cancelled"
