"""Opcode handlers: the wire side of every engine opcode, in every dialect.

Each handler turns one request into engine calls and writes one response. Reads of
slot state (STATE_META, INFO) come from the engine's published snapshots and never
wait for the actor. Errors map to statuses in one place (``engine_errors``).
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, replace
from typing import Any

from codec import payloads as P
from codec.dialects import V3_PREFIX_PROBE, Dialect, decode_dialect, looks_like_decode_v3_prefix, prefill_dialect
from codec.enums import Op, Status
from codec.errors import CodecError, MalformedPayload
from codec.hashing import Xxh3Stream
from codec.limits import HYDRA_MAX_PROMPT_BYTES
from codec.kvblob import KvBlobLayout, encode_kv_blob_header, max_kv_blob_size, parse_kv_blob, split_logits_tail
from engine.api import EngineApi
from engine.chat.prompt import ChatRequestError, normalize_messages, plan_chat, read_chat_options
from engine.jobs import (BadInput, EngineBusy, EngineUnavailable, GenRequest, GenResult, JobHandle, ReloadFailed,
                         Unservable)
from engine.kv_cache import BadDeclaration, KvStateMismatch
from engine.reasoning_budget import ReasoningBudget
from engine.sampling import GREEDY, GrammarSpec
from engine.status import ModelChoice

from hydra_rpc.hydra.engine_meta import configure_meta, identity_meta, info_meta, slot_meta
from hydra_rpc.hydra.keys import parse_slot_key
from hydra_rpc.hydra.wire import PeerGone, Request, ResponseWriter
from hydra_rpc.services import Services

KV_VERSION = 3
SWAP_ANSWER_WITHIN_S = 25.0  # under the C++ engine's 30 s SWAP_QUANT task timeout


class Handlers:
    def __init__(self, services: Services, decode_v3: Any = None):
        self.engine = services.engine
        self.info_extra = services.info_extra  # INFO keys of the process, e.g. ignored_args
        # merged DECODE v3 frames go here: ``await decode_v3(req, resp, slot, first_bytes)``
        self.decode_v3 = decode_v3
        self.put_buffer = services.put_buffer  # shared with HTTP PUT /slots/{id}/state

    def table(self) -> dict[int, Any]:
        t = {
            Op.INFO: self.info,
            Op.STATE_META: self.state_meta,
            Op.STATE_GET: self.state_get,
            Op.STATE_PUT: self.state_put,
            Op.CONFIGURE: self.configure,
            Op.PREFILL: self.prefill,
            Op.DECODE: self.decode,
            Op.SET_EXPERT_MODE: self.set_expert_mode,
            Op.SWAP_QUANT: self.swap_quant,
            Op.PIPELINE_ATTACH: self.pipeline_attach,
        }
        return {int(k): engine_errors(v) for k, v in t.items()}

    def slot(self, req: Request) -> int:
        return parse_slot_key(req.key, req.op, self.engine.n_slots)

    # ---------------------------------------------------------------- snapshot reads
    async def info(self, req: Request, resp: ResponseWriter) -> None:
        if req.key:
            self.slot(req)  # a given key must still name a slot
        await resp.send(Status.OK, {**info_meta(self.engine.info()), **self.info_extra})

    async def state_meta(self, req: Request, resp: ResponseWriter) -> None:
        slot = self.slot(req)
        await resp.send(Status.OK, slot_meta(self.engine.snapshot(slot), slot, self.engine.kv_cache))

    # ---------------------------------------------------------------- state transfer
    async def state_get(self, req: Request, resp: ResponseWriter) -> None:
        slot = self.slot(req)
        out = await self.engine.state_get(slot)
        try:
            head = encode_kv_blob_header(KV_VERSION, out.n_past, out.tokens)
            meta = {"n_past": out.n_past, "state_size": len(out.state), **identity_meta(out.identity),
                    "config_generation": out.config_generation}
            await resp.start(Status.OK, meta, len(head) + len(out.state))
            await resp.write(head)
            await write_chunked(resp, out.state, self.engine.state_chunk_size)
            await resp.drain_all()  # the transport holds views of the buffer until sent
        finally:
            out.release()

    async def state_put(self, req: Request, resp: ResponseWriter) -> None:
        slot = self.slot(req)
        if req.body.length == 0:
            raise MalformedPayload("STATE_PUT needs a KV blob", rule="state_put.empty")
        check_kv_blob_size(self.engine, req.body.length, "STATE_PUT payload", "state_put.size")
        buf, release = self.put_buffer.lease(req.body.length)
        try:
            await req.body.read_into(buf)
            t0 = time.perf_counter()
            try:
                layout, consumed = await restore_kv_blob(self.engine, slot, buf)
            except BlobRejected as e:
                await resp.send(Status.ERROR, {"error": str(e), "restored": False, "model_match": False,
                                               **identity_meta(self.engine.identity)})
                return
        finally:
            release()
        layout = split_logits_tail(layout, consumed, self.engine.n_vocab)
        snap = self.engine.snapshot(slot)
        await resp.send(Status.OK, {
            "restored": True, "bytes": consumed, "model_match": True, **identity_meta(self.engine.identity),
            "n_past": snap.n_past, "blob_version": layout.header.version,
            "logits_tail": layout.logits_offset is not None,
            "restore_ms": round((time.perf_counter() - t0) * 1000, 3),
            "config_generation": snap.config_generation})

    # ---------------------------------------------------------------- configuration
    async def configure(self, req: Request, resp: ResponseWriter) -> None:
        self.slot(req)
        try:
            cfg = P.parse_configure(await req.body.read_all())
        except MalformedPayload as e:
            await resp.send(Status.ERROR, {"success": False, "error": f"CONFIGURE: invalid config_json: {e}"})
            return
        await resp.send(Status.OK, configure_meta(await self.engine.configure(cfg)))

    async def set_expert_mode(self, req: Request, resp: ResponseWriter) -> None:
        self.slot(req)
        try:
            m = P.parse_expert_mode(await req.body.read_all())
        except MalformedPayload as e:
            await resp.send(Status.ERROR, {"success": False, "error": str(e)})
            return
        meta: dict[str, Any] = {"success": True, "mode": self.engine.set_expert_mode(m.mode)}
        if m.mode == "combined" and meta["mode"] != "combined":
            # No combined head/peer exists in this engine: the mode in effect stays solo,
            # and we say so (clients treat mode == "solo" as not combined).
            meta.update(requested="combined", peer_connected=False,
                        reason="no combined peer configured; staying solo")
        await resp.send(Status.OK, meta)

    async def swap_quant(self, req: Request, resp: ResponseWriter) -> None:
        try:
            sq = P.parse_swap_quant(await req.body.read_all())
        except MalformedPayload as e:
            await resp.send(Status.ERROR, {"success": False, "error": str(e)})
            return
        aliases = list(self.engine.aliases)
        if sq.qk not in aliases:
            await resp.send(Status.NOT_IMPLEMENTED, {
                "success": False,
                "error": f"SWAP_QUANT: quant key {sq.qk!r} is not a known model alias "
                         f"({aliases or 'none configured'}); per-tensor quant swaps are not supported"})
            return
        if sq.pattern not in ("", "*", ".*", ".+", "^.*$"):
            await resp.send(Status.NOT_IMPLEMENTED, {
                "success": False,
                "error": f"SWAP_QUANT: tensor pattern {sq.pattern!r} covers part of the model; only a whole-model "
                         f"swap (empty or '.*' pattern) is supported"})
            return
        out = await self.engine.swap_model(sq.qk)
        # ``swapped``: the alias's model went live through this request (not "a reload started");
        # false when it was live already. A reload that does not happen is an ERROR.
        # A load that outlasts the C++ engine's 30 s task timeout answers "still loading" rather
        # than keep the client past it: swapped false, reload "loading" — true, and retryable.
        swapped = out.reload_ticket is not None
        if swapped:
            try:
                async with asyncio.timeout(SWAP_ANSWER_WITHIN_S):
                    await self.engine.wait_reload(out.reload_ticket)
            except ReloadFailed as e:
                await resp.send(Status.ERROR, {"success": False, "swapped": False, "quant": sq.qk, "error": str(e),
                                               "reload": self.engine.reload.state.value})
                return
            except TimeoutError:
                swapped = False
        await resp.send(Status.OK, {"success": True, "swapped": swapped,
                                    "quant": sq.qk, "reload": (self.engine.reload.state if swapped
                                                               else out.reload or self.engine.reload.state).value,
                                    "config_generation": out.config_generation})

    async def pipeline_attach(self, req: Request, resp: ResponseWriter) -> None:
        parse_slot_key(req.key, Op.STATE_META, self.engine.n_slots)  # numeric key, as the C++
        await req.body.read_all()
        await resp.send(Status.NOT_IMPLEMENTED, {
            "error": "HYDRA_OP_PIPELINE_ATTACH is not implemented: this engine runs no pipeline-parallel peers "
                     "(layers can be offloaded to ggml RPC servers with --rpc instead)",
            "success": False})

    # ---------------------------------------------------------------- prefill
    async def prefill(self, req: Request, resp: ResponseWriter) -> None:
        slot = self.slot(req)
        if req.body.length == 0:
            raise MalformedPayload("PREFILL needs a payload", rule="prefill.empty")
        payload = await req.body.read_all()
        if prefill_dialect(payload) is Dialect.PREFILL_E1:
            tokens = P.decode_e1_tokens(payload)
            res = await run_job(req, self.engine.submit(GenRequest(slot, tokens=tokens, n_predict=0)))
            await resp.send(Status.OK, {"n_past": res.n_past, "config_generation": res.config_generation})
            return
        body = P.parse_prefill_json(payload)
        choice = await select_model(self.engine, body.get("model"), body.get("hydra_config"))
        messages, prompt = body.get("messages"), body.get("prompt")
        if messages is None and not isinstance(prompt, str):
            raise MalformedPayload("PREFILL needs 'messages' (array) or 'prompt' (string)", rule="prefill.input")
        if messages is not None and not isinstance(messages, list):
            raise MalformedPayload("messages must be an array", rule="prefill.messages")
        chat = chat_input(self.engine, body, messages)
        job = GenRequest(slot, messages=chat.messages, prompt=None if messages is not None else prompt, n_predict=0,
                         capture_state=True, params=choice.params, template_vars=chat.template_vars)
        res = await run_job(req, self.engine.submit(job))
        state, logits = res.state or b"", res.logits or b""
        head = encode_kv_blob_header(KV_VERSION, res.n_past, res.tokens)
        h = Xxh3Stream(head)
        h.update(state)
        h.update(logits)
        meta: dict[str, Any] = {"n_past": res.n_past, "state_size": len(state), "logits_size": len(logits),
                                **identity_meta(res.identity), "model_fallback": choice.fallback}
        if res.prefill_ms > 0:
            meta["prefill_ms"] = round(res.prefill_ms, 3)
        if choice.load_ms > 0:
            meta["model_load_ms"] = round(choice.load_ms, 3)
        meta.update(kv_hash_str=h.kv_hash_str(), **prompt_meta(res), config_generation=res.config_generation)
        await resp.start(Status.OK, meta, len(head) + len(state) + len(logits))
        await resp.write(head)
        await write_chunked(resp, state, self.engine.state_chunk_size)
        await resp.write(logits)

    # ---------------------------------------------------------------- decode
    async def decode(self, req: Request, resp: ResponseWriter) -> None:
        slot = self.slot(req)
        if req.body.length == 0:
            raise MalformedPayload("DECODE needs a payload", rule="decode.empty")
        first = await req.body.read_exactly(min(req.body.length, V3_PREFIX_PROBE))
        if looks_like_decode_v3_prefix(first):
            if self.decode_v3 is None:
                raise MalformedPayload("DECODE v3 frames are not enabled", rule="decode.v3_disabled")
            await self.decode_v3(req, resp, slot, first)
            return
        if req.body.remaining > HYDRA_MAX_PROMPT_BYTES:
            raise MalformedPayload(f"a JSON/E1 DECODE body over {HYDRA_MAX_PROMPT_BYTES} bytes", rule="decode.size")
        payload = first + await req.body.read_all()
        dialect = decode_dialect(payload)
        if dialect is Dialect.DECODE_E1:
            n_predict, tokens = P.decode_e1_decode(payload)
            job = GenRequest(slot, tokens=tokens, append=True, n_predict=max(0, n_predict), sampling=GREEDY,
                             stream=False)
            res = await run_job(req, self.engine.submit(job))
            await resp.send(Status.OK, {"tokens_generated": res.tokens_generated, "n_past": res.n_past,
                                        "stop_reason": "complete", "config_generation": res.config_generation,
                                        **prompt_meta(res)}, res.text)
            return
        if dialect is Dialect.DECODE_V3:  # a v3 frame would have been seen in its first bytes
            raise MalformedPayload("DECODE payload is neither a v3 frame, JSON nor E1 tokens", rule="decode.dialect")
        d = P.parse_json_decode(payload)
        # PIN decodes greedily (top_k 1, temp 0); a request may ask for sampling explicitly.
        sampling = self.engine.sampling_for(d.body) if "temperature" in d.body else GREEDY
        chat = chat_input(self.engine, d.body, d.messages)
        job = GenRequest(slot, messages=chat.messages, append=d.messages is None, n_predict=d.n_predict,
                         sampling=replace(sampling, grammar=chat.grammar), want_logprobs=dialect is Dialect.DECODE_SPEC,
                         template_vars=chat.template_vars, reasoning_budget=chat.reasoning_budget,
                         stream=dialect is not Dialect.DECODE_SPEC)  # SPEC answers once, with every token
        handle = self.engine.submit(job)
        if dialect is Dialect.DECODE_SPEC:
            res = await run_job(req, handle)
            frames = bytearray()
            events = [ev for ev in handle.ready_events() if ev is not None]
            for i, ev in enumerate(events):
                frames += P.encode_token_frame(ev.token, ev.logprob, final=i == len(events) - 1)
            await resp.send(Status.OK, {"tokens_generated": res.tokens_generated, "n_past": res.n_past,
                                        "stop_reason": res.stop_reason, "config_generation": res.config_generation,
                                        **prompt_meta(res)}, bytes(frames))
            return
        await stream_pin(req, resp, handle)


@dataclass(frozen=True)
class ChatInput:
    """What a Hydra request's chat fields make of its job."""

    messages: list | None = None
    template_vars: dict[str, Any] | None = None
    grammar: GrammarSpec | None = None
    reasoning_budget: ReasoningBudget | None = None


def chat_input(engine: EngineApi, body: dict[str, Any], messages: list | None) -> ChatInput:
    """A Hydra request's ``messages`` as the HTTP chat endpoint renders them (``tools``,
    ``chat_template_kwargs``), so a P/D split prefills the prompt HTTP decode continues; and
    the grammar its ``tools``/``tool_choice``, ``grammar``, ``json_schema`` or
    ``response_format`` ask for and its reasoning budget, as llama-server reads a body."""
    try:
        opts = read_chat_options(body, default_grammar=engine.default_grammar, default_budget=engine.reasoning_budget)
        if messages is None:
            return ChatInput(grammar=opts.response_format)
        plan = plan_chat(normalize_messages(messages), opts, engine.chat_syntax)
    except ChatRequestError as e:
        raise MalformedPayload(str(e), rule=f"chat.{e.param}") from None
    return ChatInput(plan.messages, plan.template_vars, plan.grammar, plan.reasoning_budget)


def prompt_meta(res: GenResult) -> dict[str, int]:
    """What the prompt cost: tokens computed, tokens in all, tokens reused from a cache."""
    return {"tokens_processed": res.prompt_tokens - res.cached_tokens, "prompt_tokens": res.prompt_tokens,
            "cache_tokens": res.cached_tokens}


async def select_model(engine: EngineApi, alias: Any, hydra_config: Any) -> ModelChoice:
    """PREFILL ``model`` / ``hydra_config`` and DECODE v3 ``model``: see ``EngineApi.select_model``."""
    if hydra_config is not None and not isinstance(hydra_config, dict):
        raise MalformedPayload("hydra_config must be an object", rule="prefill.hydra_config")
    return await engine.select_model(alias if isinstance(alias, str) else None, hydra_config)


def kv_blob_cap(engine: EngineApi) -> int:
    """The largest KV blob this model and context can produce: a longer one is refused before a
    byte of it is stored (STATE_PUT payload, DECODE v3 kv segment, HTTP state PUT)."""
    return max_kv_blob_size(engine.n_ctx_slot, engine.max_state_size, engine.n_vocab)


def check_kv_blob_size(engine: EngineApi, size: int, what: str, rule: str) -> None:
    cap = kv_blob_cap(engine)
    if size > cap:
        raise MalformedPayload(
            f"{what} of {size} bytes: the largest KV blob this model can produce with {engine.n_ctx_slot} tokens "
            f"per slot is {cap} bytes (a state of at most {engine.max_state_size}, header, checkpoint, logits)",
            rule=rule)


class BlobRejected(Exception):
    """A KV blob this model cannot take (foreign tokens, or a state llama.cpp refuses)."""


async def restore_kv_blob(engine: EngineApi, slot: int, buf, declared: Any = None) -> tuple[KvBlobLayout, int]:
    """Parse a v1/v2/v3 KV blob and restore it into ``slot`` (STATE_PUT and DECODE v3 alike).
    ``declared``: the sender's ``kv_cache`` (DECODE v3 ``kv_metadata.kv_cache``, HTTP
    ``X-Hydra-KV-Cache``; a binary STATE_PUT has none), compared with this engine's first
    (engine.kv_cache.check_declared: the rotation and RoPE the state's header does not carry).

    Returns the layout and the bytes the state loader consumed. Raises EngineBusy,
    KvStateMismatch (BAD_REQUEST naming the field), a codec error (a broken or oversized state
    header: BAD_REQUEST), or BlobRejected with the reason llama.cpp gave.
    """
    layout = parse_kv_blob(buf, has_logits=False)
    tokens = list(layout.header.tokens)
    nv = engine.n_vocab
    if any(t < 0 or t >= nv for t in tokens):
        raise BlobRejected(f"blob tokens outside this model's vocabulary (n_vocab {nv})")
    state = buf[layout.state_offset:layout.state_offset + layout.state_len]
    try:
        consumed = await engine.state_put(slot, tokens, state, declared)
    except (EngineBusy, KvStateMismatch, BadDeclaration, CodecError):
        raise  # busy; a state this context cannot take (or a declaration of it that is no object); a broken header
    except Exception as e:
        raise BlobRejected(f"llama_state_seq_set_data rejected the state: {e}") from e
    return layout, consumed


def _busy_meta(e: EngineBusy) -> dict[str, Any]:
    meta: dict[str, Any] = {"error": str(e)}
    if e.retry_after_ms is not None:
        meta["retry_after_ms"] = e.retry_after_ms
    return meta


def engine_errors(fn):
    """Map engine exceptions to one well-formed response (if none was started yet)."""

    async def wrapped(req: Request, resp: ResponseWriter) -> None:
        try:
            await fn(req, resp)
        except EngineBusy as e:
            if resp.started:
                raise
            await resp.send(Status.BUSY, _busy_meta(e))
        except BadInput as e:
            if resp.started:
                raise
            await resp.send(Status.BAD_REQUEST, e.as_meta() if isinstance(e, KvStateMismatch) else {"error": str(e)})
        except (EngineUnavailable, Unservable) as e:
            if resp.started:
                raise
            await resp.send(Status.ERROR, {"error": str(e)})

    wrapped.__name__ = getattr(fn, "__name__", "handler")
    return wrapped


async def run_job(req: Request, job: JobHandle) -> GenResult:
    """Wait for a submitted job; cancel it if the client goes away meanwhile."""
    result = asyncio.ensure_future(job.result())
    gone = asyncio.ensure_future(req.peer_gone.wait())
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        job.cancel()
        result.cancel()
        raise
    finally:
        gone.cancel()
    if not result.done():
        job.cancel()
        result.cancel()
        raise PeerGone("client went away; generation cancelled")
    return result.result()


async def stream_pin(req: Request, resp: ResponseWriter, job: JobHandle) -> None:
    """PIN dialect: ``OK, meta 0, payload 0`` then ``[u32 len][piece]`` frames, then close.

    Tokens that arrived together (one engine step) go out in one write: every frame is
    whole inside it, and small models do not pay a syscall per token.
    """
    await resp.start_eof_stream(Status.OK, None, client_wait=job.set_client_blocked)
    try:
        while True:
            ev = await job.next_event()
            if ev is None:
                break
            events = [ev, *job.ready_events()]
            done = events[-1] is None
            frames = [P.encode_piece(e.piece) for e in events if e is not None]
            resp.tokens_streamed += len(frames)
            await resp.write(b"".join(frames))
            if done:
                break
        with contextlib.suppress(asyncio.CancelledError):
            await job.result()
    except (BadInput, EngineBusy, EngineUnavailable, Unservable) as e:
        # the OK is out, so the close that ends every PIN stream is all the client gets (the
        # C++ does no better, docs/protocol.md §9); the request's log line says why
        resp.error_rule = f"the engine ended the stream: {e}"[:200]
    finally:
        job.cancel()


async def write_chunked(resp: ResponseWriter, data: bytes | memoryview, chunk: int) -> None:
    mv = memoryview(data)
    for off in range(0, len(mv), chunk):
        await resp.write(mv[off:off + chunk])
