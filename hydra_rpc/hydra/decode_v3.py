"""Merged DECODE v3 (docs/protocol.md): validate every rule, read the whole payload,
restore the KV segment into the slot, reply, then generate in the background; the
result is fetched over HTTP ``GET /v1/decode/{decode_request_id}``.

The payload is consumed in the order the frame declares, and every size is checked
before the bytes it guards are read (the C++ answers BAD_REQUEST without draining and
desyncs; the connection loop here drains whatever a failed rule left unread).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from codec import decode_v3 as V3
from codec.enums import Status
from codec.errors import MalformedPayload
from codec.hashing import Xxh3Stream
from engine.buffers import lazy_buffer
from engine.jobs import EngineBusy, GenRequest, stops_refused
from engine.kv_cache import BadDeclaration, KvStateMismatch
from engine.model_params import ModelParams

from hydra_rpc.hydra.decode_results import DecodeEntry
from hydra_rpc.hydra.engine_meta import identity_meta
from hydra_rpc.hydra.handlers import BlobRejected, chat_input, check_kv_blob_size, restore_kv_blob, select_model
from hydra_rpc.hydra.wire import PeerGone, Request, ResponseWriter
from hydra_rpc.services import Services

log = logging.getLogger("hydra_rpc.decode_v3")

CAP_NAMES = ["MTP", "VISION", "REASONING", "TOOL_USE", "CODE"]


def gate_a(kv_md: dict[str, Any], ident: dict[str, Any]) -> tuple[dict[str, Any], bool, str]:
    """Compare the KV's identity with the resident model. Empty fields are not compared
    (a client that does not know them sends ""). ``model_hash_match`` is reported but does not
    decide ``valid``: a KV from another quantisation of the same model is a fleet's deliberate
    cross-quant restore, and the C++ Gate A accepts it."""

    def same(key: str) -> bool:
        a, b = kv_md.get(key), ident.get(key)
        return not a or not b or a == b

    caps_a = kv_md.get("model_capabilities") or 0
    caps_b = ident.get("model_capabilities") or 0
    xor = (caps_a ^ caps_b) if isinstance(caps_a, int) and isinstance(caps_b, int) else 0
    name_ok = same("model_name") or (bool(kv_md.get("model_alias")) and kv_md.get("model_alias") == ident.get("model_alias"))
    match = {"tokenizer_match": same("tokenizer"), "model_name_match": name_ok, "capabilities_xor": xor,
             "capabilities_diff_bits": [n for i, n in enumerate(CAP_NAMES) if xor >> i & 1],
             "model_quant_match": same("model_quant"), "model_alias_match": True,
             "model_hash_match": same("model_hash")}
    valid = match["tokenizer_match"] and name_ok and not (xor & 0b11)
    reason = "" if valid else ("tokenizer mismatch" if not match["tokenizer_match"] else
                               "model name mismatch" if not name_ok else "MTP/VISION capability mismatch")
    return match, valid, reason


class DecodeV3:
    def __init__(self, services: Services):
        self.engine = services.engine
        self.results = services.decode_results
        self._tasks: set[asyncio.Task] = set()

    async def handle(self, req: Request, resp: ResponseWriter, slot: int, first: bytes) -> None:
        hdr, prompt, kv = await self._read_frame(req, first)
        try:
            prompt_obj = V3.parse_prompt_segment(prompt, hdr.generation)
        except MalformedPayload as e:
            if e.rule == "v3.prompt_build":
                await resp.send(Status.BAD_REQUEST, {"error": f"prompt build failed: {e}", "decode_request_id": -1})
                return
            raise
        decode_id = self.results.next_id()
        choice = await select_model(self.engine, hdr.model, None)
        request = self._request(slot, prompt_obj, choice.params)  # every field checked before the KV changes
        match, valid, reason = gate_a(hdr.kv_metadata, identity_meta(self.engine.identity))
        if not valid:
            await resp.send(Status.ERROR, {"valid": False, "decode_request_id": decode_id, "match": match,
                                           "reason": reason, "error_code": "CAP_MISMATCH"})
            return
        t0 = time.perf_counter()
        if kv and not await self._restore(resp, slot, kv, hdr, decode_id):
            return
        restore_ms = (time.perf_counter() - t0) * 1000
        await self._start(req, resp, slot, request, hdr, decode_id, match, restore_ms)

    async def _read_frame(self, req: Request, first: bytes) -> tuple[Any, bytes, bytearray]:
        """The whole frame, every rule checked: the header, the prompt, the KV segment and its hash."""
        body = req.body
        total = body.length
        hdr_len, hdr_hash = V3.parse_decode_v3_prefix(first[:V3.PREFIX_LEN], total)
        have = first[V3.PREFIX_LEN:]
        if len(have) > hdr_len:  # only possible for hdr_len 0, which validation rejects next
            have = have[:hdr_len]
        hdr_bytes = have + await body.read_exactly(hdr_len - len(have))
        hdr = V3.validate_decode_v3(hdr_len, hdr_hash, hdr_bytes, total)
        prompt = b""
        kv = bytearray()
        for seg in sorted(hdr.segments, key=lambda s: s.offset):
            if seg.id == "prompt":
                prompt = await body.read_exactly(seg.len)
            else:
                check_kv_blob_size(self.engine, seg.len, "kv segment", "v3.kv_len")
                kv = lazy_buffer(seg.len)  # memory follows what arrives
                await body.read_into(kv)
        await body.drain(5.0)  # nothing should be left; sums were validated
        V3.validate_kv_segment(kv, len(kv))
        if kv:
            h = Xxh3Stream(kv)
            V3.verify_segment_hash(hdr.kv_hash, h)
        return hdr, prompt, kv

    async def _restore(self, resp: ResponseWriter, slot: int, kv: bytearray, hdr: Any, decode_id: int) -> bool:
        """The KV segment into the slot; False when refused (the refusal is sent)."""
        try:
            # the sender's kv_cache: the rotation and RoPE its state's header does not carry
            await restore_kv_blob(self.engine, slot, memoryview(kv), hdr.kv_metadata.get("kv_cache"))
        except KvStateMismatch as e:
            await resp.send(Status.BAD_REQUEST, {**e.as_meta(), "valid": False, "decode_request_id": decode_id})
            return False
        except BadDeclaration as e:
            await resp.send(Status.BAD_REQUEST, {"error": str(e), "valid": False, "decode_request_id": decode_id})
            return False
        except EngineBusy as e:
            await resp.send(Status.BUSY, {"valid": False, "decode_request_id": decode_id, "reason": str(e),
                                          "error_code": "BUSY"})
            return False
        except BlobRejected as e:
            await resp.send(Status.ERROR, {"valid": False, "decode_request_id": decode_id,
                                           "reason": f"KV restore failed: {e}", "error_code": "KV_RESTORE"})
            return False
        return True

    async def _start(self, req: Request, resp: ResponseWriter, slot: int, request: GenRequest, hdr: Any,
                     decode_id: int, match: dict[str, Any], restore_ms: float) -> None:
        """Submit the generation (never queued) and answer; the result is collected detached."""
        n_past = self.engine.snapshot(slot).n_past
        try:  # never queued: a busy slot answers BUSY, as the C++ does
            job = await self.engine.submit_admitted(request)
        except EngineBusy as e:
            await resp.send(Status.BUSY, {"valid": False, "decode_request_id": decode_id, "reason": str(e),
                                          "error_code": "BUSY", "retry_after_ms": e.retry_after_ms})
            return
        entry = DecodeEntry(decode_id, slot, job, n_past_after_restore=n_past, model=hdr.model)
        self.results.add(entry)
        task = asyncio.create_task(self._collect(entry))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        # Nobody can fetch a result whose decode_request_id never reached its client: stop the job
        # when the client left before the reply, or reset the connection with the reply unread.
        if req.peer_gone.is_set():
            self._orphaned(entry, "the client closed the connection before the reply")
            raise PeerGone("client went away before its merged DECODE was answered")
        await resp.send(Status.OK, {"valid": True, "match": match, "decode_request_id": decode_id,
                                    "n_past_after_restore": n_past, "restore_slot_ms": round(restore_ms, 3),
                                    "config_generation": self.engine.generation})
        if req.closed is not None:
            req.closed.add_done_callback(
                lambda f: f.result() and self._orphaned(entry, "the client reset the connection with the reply unread"))

    def _request(self, slot: int, p: dict[str, Any], params: ModelParams | None) -> GenRequest:
        # the prompt's own sampling object wins over the generation keys merged into the prompt
        fields = {k: p[k] for k in ("temperature", "top_k", "top_p", "min_p", "seed") if k in p}
        if isinstance(p.get("sampling"), dict):
            fields.update(p["sampling"])
        n_predict = p.get("n_predict", p.get("max_tokens", -1))
        if not isinstance(n_predict, int) or isinstance(n_predict, bool) or n_predict < 0:
            n_predict = self.engine.default_n_predict
        stop = p.get("stop") or []
        if not isinstance(stop, list):
            stop = [stop] if isinstance(stop, str) else []  # lenient as the C++: other types are ignored
        stop = [s for s in stop if isinstance(s, str)]
        if (why := stops_refused(stop)) is not None:
            raise MalformedPayload(why, rule="v3.stop")
        messages = p.get("messages")
        prompt = p.get("prompt") if isinstance(p.get("prompt"), str) else None
        if not isinstance(messages, list):
            messages = None
        chat = chat_input(self.engine, p, messages)
        sampling = self.engine.sampling_for(fields, grammar=chat.grammar)
        return GenRequest(slot, messages=chat.messages, prompt=prompt, n_predict=n_predict, sampling=sampling,
                          stop=stop, params=params, wait=False, template_vars=chat.template_vars,
                          reasoning_budget=chat.reasoning_budget)

    def _orphaned(self, entry: DecodeEntry, why: str) -> None:
        if entry.stop(f"stopped: {why}"):
            log.info("merged DECODE %d stopped: %s", entry.id, why)

    async def _collect(self, entry: DecodeEntry) -> None:
        budget = asyncio.get_running_loop().call_later(
            self.results.budget, entry.stop, f"stopped: its time budget of {self.results.budget:g} s was spent")
        try:
            entry.result = await entry.job.result()
            entry.state = "cancelled" if entry.result.stop_reason == "cancelled" else "done"
        except asyncio.CancelledError:
            entry.state, entry.error = "cancelled", entry.error or "cancelled"
        except Exception as e:
            entry.state, entry.error = "failed", str(e)
        finally:
            budget.cancel()
