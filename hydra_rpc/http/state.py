"""KV state over HTTP, as the fork's llama-server serves it (docs/http.md, "State transfer").

    GET /slots/{id}/state    200 application/octet-stream: the v3 KV blob of STATE_GET (no logits)
    PUT /slots/{id}/state    a v1/v2/v3 blob (optionally + logits) → {"restored", "n_past", "bytes"}

Both are the binary port's transfers behind another door: GET copies the state with the same
engine call and sends the same blob as STATE_GET; PUT receives into the same resident buffer
as STATE_PUT, under the same size caps (the frame limit and the largest blob this model can
produce, ``handlers.kv_blob_cap``), and restores with the same function
(``handlers.restore_kv_blob``). The body is streamed in both directions, never read whole
before the handler. Also here: the slot id of a ``/slots/{id}…`` path, shared with ``http.app``.
"""
from __future__ import annotations

import json
import time
from typing import Any

from codec.enums import Op
from codec.errors import CodecError
from codec.kvblob import encode_kv_blob_header, split_logits_tail
from codec.limits import Limits
from engine.buffers import LeasedBuffer
from engine.jobs import EngineBusy
from engine.kv_cache import BadDeclaration, KvStateMismatch, declared_kv_cache

from hydra_rpc.hydra.engine_meta import identity_meta
from hydra_rpc.hydra.handlers import KV_VERSION, BlobRejected, kv_blob_cap, restore_kv_blob
from hydra_rpc.http.limits import reading_body, streams_body
from hydra_rpc.http.errors import ApiError, json_response, require_ready
from hydra_rpc.services import Services
from hydra_rpc.http.server.messages import Request, Response, StreamResponse
from hydra_rpc.http.server.router import Router

OCTETS = "application/octet-stream"


def path_number(raw: str) -> int | None:
    """A path id: ASCII digits only (``str.isdigit`` also accepts "²"), and short."""
    return int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 18 else None


def slot_of(request: Request, engine: Any) -> int:
    raw = request.match_info["slot_id"]
    slot = path_number(raw)
    if slot is None:
        raise ApiError(400, f"slot id must be a non-negative integer, got {raw[:40]!r}")
    n = engine.n_slots if engine is not None else 0
    if n <= 0:
        raise ApiError(404, f"unknown slot {slot}: no slots yet (the model is loading)")
    return slot % n  # as the Hydra port maps a key (hydra_rpc/hydra/keys.py): id 7 of 4 slots is slot 3


class StateRoutes:
    def __init__(self, services: Services):
        self.services = services

    def add_to(self, router: Router) -> None:
        router.add_get("/slots/{slot_id}/state", self.get_state)
        router.add_put("/slots/{slot_id}/state", self.put_state)

    @property
    def engine(self) -> Any:
        return self.services.engine

    def _require_idle(self, slot: int) -> None:
        snap = self.engine.snapshot(slot)
        if snap.is_processing or snap.is_transferring or snap.queued:
            raise ApiError(503, f"slot {slot} is busy ({snap.operation})", extra={"restored": False})

    async def get_state(self, request: Request) -> StreamResponse:
        eng = self.engine
        slot = slot_of(request, eng)
        require_ready(eng)
        self._require_idle(slot)
        try:
            out = await eng.state_get(slot)
        except EngineBusy as e:  # became busy between the snapshot and the actor
            raise ApiError(503, str(e)) from None
        try:
            head = encode_kv_blob_header(KV_VERSION, out.n_past, out.tokens)
            size = len(head) + len(out.state)
            resp = StreamResponse(headers={
                "Content-Type": OCTETS, "X-Hydra-N-Past": str(out.n_past), "X-Hydra-State-Size": str(size),
                "X-Hydra-Model-Hash": out.identity.model_hash,
                "X-Hydra-Config-Generation": str(out.config_generation),
                # what the bytes mean beyond llama.cpp's header: a PUT elsewhere sends it back
                **kv_cache_header(eng)})
            resp.content_length = size
            await resp.prepare(request)
            await resp.write(head)
            chunk = eng.state_chunk_size
            for off in range(0, len(out.state), chunk):
                # a copy per chunk: a transport may keep what it is given until sent, and the
                # state's buffer is reused by the next transfer once released
                await resp.write(bytes(out.state[off:off + chunk]))
            await resp.write_eof()
            return resp
        finally:
            out.release()

    @streams_body
    async def put_state(self, request: Request) -> Response:
        eng = self.engine
        slot = slot_of(request, eng)
        require_ready(eng)
        model_hash = request.headers.get("X-Hydra-Model-Hash", "")
        if model_hash and eng.identity.model_hash and model_hash != eng.identity.model_hash:
            raise ApiError(409, f"the blob is from model {model_hash[:16]}…, this slot serves "
                                f"{eng.identity.model_hash[:16]}…",
                           extra={"restored": False, "model_match": False, **identity_meta(eng.identity)})
        length = request.content_length
        cap = min(self._limits().payload_cap(Op.STATE_PUT), kv_blob_cap(eng))
        if length is None:
            raise ApiError(411, "PUT /slots/{id}/state needs a Content-Length")
        if length > cap:
            raise ApiError(413, f"a state of {length} bytes exceeds the limit of {cap}")
        if length == 0:
            raise ApiError(400, "PUT /slots/{id}/state needs a KV blob")
        declared = declared_from(request)  # a malformed declaration: 400 before the body is read
        self._require_idle(slot)  # before reading what could be gigabytes
        buf, release = self._buffer().lease(length)  # memory follows what arrives (engine.buffers)
        try:
            with reading_body(request):  # under the HTTP side's read deadlines
                await _receive(request, buf)
            t0 = time.perf_counter()
            try:
                layout, consumed = await restore_kv_blob(eng, slot, buf, declared)
            except KvStateMismatch as e:  # the header's layout, or the declared rotation / RoPE
                raise ApiError(400, str(e), extra={"restored": False, "reason": "kv_state_mismatch", "field": e.field,
                                                   "got": e.got, "want": e.want}) from None
            except BadDeclaration as e:
                raise ApiError(400, str(e), extra={"restored": False}) from None
            except CodecError as e:
                raise ApiError(400, f"malformed KV blob: {e}", extra={"restored": False}) from None
            except EngineBusy as e:
                raise ApiError(503, str(e), extra={"restored": False}) from None
            except BlobRejected as e:
                raise ApiError(503, str(e), extra={"restored": False, "model_match": False,
                                                   **identity_meta(eng.identity)}) from None
        finally:
            release()
        layout = split_logits_tail(layout, consumed, eng.n_vocab)
        snap = eng.snapshot(slot)
        return json_response({
            "restored": True, "n_past": snap.n_past, "bytes": consumed, "model_match": True,
            "blob_version": layout.header.version, "logits_tail": layout.logits_offset is not None,
            "restore_ms": round((time.perf_counter() - t0) * 1000, 3), "config_generation": snap.config_generation,
            **identity_meta(eng.identity)})

    def _limits(self) -> Limits:
        return self.services.settings.limits

    def _buffer(self) -> LeasedBuffer:
        """STATE_PUT's resident buffer (``App`` shares it), so both ports keep one between them."""
        return self.services.put_buffer


KV_CACHE_HEADER = "X-Hydra-KV-Cache"


def kv_cache_header(eng: Any) -> dict[str, str]:
    """``X-Hydra-KV-Cache``: this engine's declared kv_cache (attention rotation, RoPE) as compact
    JSON, on a state GET; empty when the model has no KV cache description."""
    kv = eng.kv_cache
    if kv is None or not hasattr(kv, "as_dict"):
        return {}
    return {KV_CACHE_HEADER: json.dumps(declared_kv_cache(kv), separators=(",", ":"))}


def declared_from(request: Request) -> Any:
    """The sender's kv_cache from ``X-Hydra-KV-Cache`` (None: not sent). 400 when it is not a
    JSON object."""
    text = request.headers.get(KV_CACHE_HEADER)
    if text is None:
        return None
    try:
        declared = json.loads(text)
    except ValueError:
        declared = None
    if not isinstance(declared, dict):
        raise ApiError(400, f"{KV_CACHE_HEADER} must be a JSON object (the sender's INFO kv_cache)",
                       extra={"restored": False})
    return declared


async def _receive(request: Request, buf: memoryview) -> None:
    """Fill ``buf`` with exactly the body (its Content-Length), as it arrives."""
    pos = 0
    async for chunk in request.content.iter_any():
        end = pos + len(chunk)
        if end > len(buf):  # the body is framed by its Content-Length: not reached
            raise ApiError(400, "the body is longer than its Content-Length")
        buf[pos:end] = chunk
        pos = end
    if pos != len(buf):
        raise ApiError(400, f"the body ended after {pos} of {len(buf)} bytes")
