"""OpenAI-compatible completions on the engine actor: ``/v1/chat/completions`` and ``/v1/completions``.

A request becomes one ``GenRequest`` on one slot, submitted to the same actor and scheduler
as RPC work, so HTTP generations batch and interleave with RPC decodes. The job is
cancelled whenever the handler leaves without a finished result: the client closed the
connection (its connection cancels the handler, see ``http.server.connection``), a stream write failed, or a
stop sequence was matched here first. Cancelling frees the slot before the next step.

Also here, because ``GET /v1/decode/{id}`` answers with the same objects: the completion object
builders and the stop-sequence handling. The request's validation is ``http.openai_request``,
the error body ``http.errors``.
"""
from __future__ import annotations

import asyncio
import codecs
import random
import time
from typing import Any

from engine.jobs import BadInput, EngineBusy, EngineUnavailable, GenRequest, GenResult, JobHandle

from hydra_rpc.http.chat import ChunkSink, finish_reason, logprobs_object, message_object, parse_message
from hydra_rpc.http.errors import ApiError, engine_error, json_response, read_json_object, require_ready
from hydra_rpc.http.openai_request import CompletionRequest, parse_completion_request, select_model
from hydra_rpc.http.sse import SseStream
from hydra_rpc.services import Services
from hydra_rpc.http.server.messages import Request, Response, StreamResponse
from hydra_rpc.http.server.router import Router

# completion ids need to be unique, not secret: uuid4 reads the OS's random source on the path
# of the first token
_IDS = random.Random()


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


def drain_events(job: JobHandle) -> list[Any]:
    """The token events of a finished job that nobody streamed."""
    return [ev for ev in job.ready_events() if ev is not None]


async def outcome(job: JobHandle) -> GenResult | None:
    """The job's result; None if the engine cancelled it (a stop); engine errors as ApiError."""
    res = await job.outcome()
    if isinstance(res, asyncio.CancelledError):
        return None
    if isinstance(res, BaseException):
        raise engine_error(res)
    return res


# ---------------------------------------------------------------- the handlers
class OpenAIRoutes:
    def __init__(self, services: Services, metrics: Any):
        self.services, self.metrics = services, metrics

    def add_to(self, router: Router) -> None:
        for path in ("/v1/chat/completions", "/chat/completions"):
            router.add_post(path, self.chat)
        for path in ("/v1/completions", "/completions"):
            router.add_post(path, self.completions)

    async def chat(self, request: Request) -> StreamResponse:
        return await self._serve(request, "chat")

    async def completions(self, request: Request) -> StreamResponse:
        return await self._serve(request, "text")

    async def _serve(self, request: Request, kind: str) -> StreamResponse:
        engine = self.services.engine
        require_ready(engine)
        creq = parse_completion_request(await read_json_object(request), kind, engine)
        choice = await select_model(engine, creq.model)
        model = choice.name
        # no slot named: the engine picks one when it admits the job (prompt similarity, then LRU)
        sampling = engine.sampling_for(creq.sampling, grammar=creq.grammar, logit_bias=creq.logit_bias,
                                       n_probs=creq.n_probs)
        gen_request = GenRequest(creq.slot, messages=creq.messages, prompt=creq.prompt, tokens=creq.tokens,
                                 n_predict=creq.n_predict, sampling=sampling, stop=creq.stop, params=choice.params,
                                 want_logprobs=creq.logprobs, stream=creq.stream,
                                 template_vars=creq.chat.template_vars if creq.chat else None,
                                 reasoning_budget=creq.chat.reasoning_budget if creq.chat else None)
        try:
            job = engine.submit(gen_request)
        except (EngineBusy, BadInput, EngineUnavailable) as e:
            raise engine_error(e) from None
        cid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{_IDS.getrandbits(96):024x}"
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

    async def _whole(self, creq: CompletionRequest, job: JobHandle, cid: str, model: str) -> tuple[Response, str]:
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

    @staticmethod
    async def _stream_text(ev: Any, job: JobHandle, stream: SseStream, sink: ChunkSink,
                           stops_asked: list[str]) -> StopFilter:
        """The generated text into the sink, a burst per write, up to a stop sequence."""
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        stops = StopFilter(stops_asked)
        while ev is not None:
            sink.text(stops.feed(utf8.decode(ev.piece)), ev)
            if stops.hit:
                job.cancel()  # we matched the stop first; do not generate past it
                break
            if stream.burst_over():
                await stream.flush()
            ev = await job.next_event()
        sink.text(stops.feed(utf8.decode(b"", final=True)) + stops.flush())
        sink.finish()
        return stops

    async def _stream(self, request: Request, creq: CompletionRequest, job: JobHandle, cid: str,
                      model: str) -> tuple[StreamResponse, str]:
        # Wait for the first token before sending the headers, so a refused or failed job
        # (queue full, prompt too long) still gets a real status code and an error object.
        ev = await job.next_event()
        res = await outcome(job) if ev is None else None
        gen = res.config_generation if res else self.services.engine.generation
        created = int(time.time())

        def chunk(**kw: Any) -> dict[str, Any]:
            return chunk_object(creq.kind, cid, created, model, gen, **kw)

        stream = SseStream(request, job)
        await stream.start()
        sink = ChunkSink(creq.kind, chunk, stream.out, plan=creq.chat, opens_reasoning=job.opens_reasoning,
                         id_prefix=f"call_{cid[-12:]}_", logprobs=creq.logprobs)
        try:
            if creq.kind == "chat":
                stream.event(chunk(role=True))
            stops = await self._stream_text(ev, job, stream, sink, creq.stop)
            try:
                res = res or await outcome(job)
            except ApiError as e:  # headers are out: report in-band, as llama-server does
                stream.event(e.body())
                stream.out.append(b"data: [DONE]\n\n")
                await stream.flush()
                return stream.resp, "error"
            reason = "stop" if stops.hit else (res.stop_reason if res else "cancelled")
            last = chunk(finish=finish_reason(reason, stops.hit, sink.has_tool_calls))
            usage = usage_of(res)
            if res is not None:  # as llama-server: a client without the usage chunk reads these
                last.update(id_slot=res.slot, timings=timings_of(res))
                if creq.kind != "chat":  # llama-server's last text-completion chunk carries usage too
                    last["usage"] = usage
            stream.event(last)
            if creq.include_usage:
                stream.event({**chunk(), "choices": [], "usage": usage})
            stream.out.append(b"data: [DONE]\n\n")
            return await stream.end(), reason
        except ConnectionResetError:  # the client went away mid-stream
            return stream.resp, "cancelled"
