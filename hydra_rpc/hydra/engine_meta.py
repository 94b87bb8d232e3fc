"""The engine's typed data as the wire's JSON: INFO, STATE_META, CONFIGURE replies, identity keys.

One place, shared by the Hydra handlers and the HTTP side, so ``/slots`` and STATE_META
(and INFO and ``/health``) cannot drift apart. Key names and order follow docs/protocol.md.
"""
from __future__ import annotations

import functools
import time
from typing import Any

from engine.slots import SlotSnapshot
from engine.status import ConfigureOutcome, EngineInfo, ModelIdentity, ReloadStatus, flat_fields

ENGINE_NAME = "llama-server-hydra"
ENGINE_VERSION = "E1"
CAPABILITIES = ("prefill", "decode", "state_transfer", "expert_mode", "quant_swap", "preset", "tokenizer",
                "model_name", "model_quant", "model_capabilities", "merged_decode", "model_hash")

# the identity keys the C++ puts into STATE_*/PREFILL meta (when non-empty), in its order, plus
# model_hash where the spec (and PIN's coordinator) put it
_WIRE_IDENTITY = ("model_alias", "model_hash", "model_path", "tokenizer", "model_name", "model_quant",
                  "model_capabilities")


def _present(v: Any) -> bool:
    return v not in (None, "", 0)


def identity_meta(ident: ModelIdentity) -> dict[str, Any]:
    return {k: getattr(ident, k) for k in _WIRE_IDENTITY if _present(getattr(ident, k))}


@functools.lru_cache(maxsize=8)
def _identity_fields(ident: ModelIdentity) -> tuple[tuple[str, Any], ...]:
    """Every present field of the identity, in declaration order (STATE_META's keys). Cached: an
    identity is frozen and changes only with a load, and STATE_META is polled."""
    return tuple((k, v) for k, v in flat_fields(ident).items() if _present(v))


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def slot_meta(snap: SlotSnapshot, requested_id: int | None = None, kv_cache: Any = None) -> dict[str, Any]:
    """STATE_META: the C++ keys, then the progress fields, config_generation, what tells a stuck
    slot from a slow one (docs/protocol.md §6.2; times are taken now, not at publication) and
    ``kv_cache`` (the live model's KvCacheInfo: what a restore into this slot must match)."""
    now = time.monotonic()
    rate = snap.tokens_per_s(now)
    out: dict[str, Any] = {
        "slot_id": snap.slot_id if requested_id is None else requested_id,
        "n_past": snap.n_past,
        "state_size": snap.state_size,
        "is_processing": snap.is_processing,
        "is_transferring": snap.is_transferring,
    }
    out.update(_identity_fields(snap.identity))
    out.update({
        "operation": snap.operation,
        "tokens_processed": snap.tokens_processed,
        "tokens_total": snap.tokens_total,
        "progress": round(snap.progress, 6),
        "elapsed_ms": round(snap.elapsed_ms(now), 3),
        "config_generation": snap.config_generation,
        "ms_since_progress": _ms(snap.ms_since_progress(now)),
        "tokens_per_s": round(rate, 3),
        "prefill_tokens_per_s": round(rate, 3) if snap.operation == "prefill" else None,
        "eta_ms": _ms(snap.eta_ms(now)),
        "waiting_on": snap.waiting_on,
        "queue_position": snap.queue_position,
        "kv_cache": kv_cache_meta(kv_cache),
    })
    return out


def slot_entry(snap: SlotSnapshot, n_ctx: int) -> dict[str, Any]:
    """A ``GET /slots`` entry: llama-server's slot object, with ``n_past``, ``n_remain`` and
    ``n_decoded`` also at the top level (where Hydra Core reads them), then ``queued`` and the
    STATE_META fields (docs/http.md)."""
    next_token = {"has_next_token": snap.is_processing, "has_new_line": snap.has_new_line,
                  "n_remain": snap.n_remain, "n_decoded": snap.n_decoded}
    entry: dict[str, Any] = {
        "id": snap.slot_id, "id_task": snap.job_id if snap.job_id is not None else -1, "n_ctx": n_ctx,
        "speculative": False, "is_processing": snap.is_processing, "n_past": snap.n_past,
        "n_remain": snap.n_remain, "n_decoded": snap.n_decoded, "params": _params(snap),
        "next_token": [next_token], "queued": snap.queued,
    }
    entry.update(slot_meta(snap))
    return entry


def _params(snap: SlotSnapshot) -> dict[str, Any]:
    p = snap.sampling
    if p is None:
        return {}
    return {"n_predict": snap.n_predict, "max_tokens": snap.n_predict, "seed": -1 if p.seed is None else p.seed,
            "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p,
            "repeat_last_n": p.penalty_last_n, "repeat_penalty": p.penalty_repeat,
            "presence_penalty": p.penalty_present, "frequency_penalty": p.penalty_freq, "stop": list(snap.stop)}


def reload_meta(r: ReloadStatus) -> dict[str, Any]:
    return {"state": r.state.value, "generation": r.generation, "target": r.target, "tier": r.tier,
            "error": r.error, "started_at": r.started_at, "load_ms": round(r.load_ms, 3),
            "swap_ms": round(r.swap_ms, 3), "keys": list(r.keys),
            "progress": {"share": round(r.progress, 4), "stage": r.load_stage, "model_bytes": r.model_bytes,
                         "bytes_loaded": int(r.progress * r.model_bytes)},
            "pending_for_ms": round((time.time() - r.started_at) * 1000, 1) if r.pending else 0}


def kv_cache_meta(kv: Any) -> dict[str, Any] | None:
    """``kv_cache`` of INFO / STATE_META: what a coordinator compares before moving KV state."""
    return kv.as_dict if kv is not None else None


def info_meta(info: EngineInfo) -> dict[str, Any]:
    # quant_swap only when a SWAP_QUANT could name something: a configured model alias
    caps = [c for c in CAPABILITIES if c != "quant_swap" or info.aliases]
    return {
        "engine": ENGINE_NAME,
        "version": ENGINE_VERSION,
        "capabilities": caps,
        "preset_aliases": list(info.aliases),
        "solo_active": info.expert_mode == "solo",
        "rpc_backend_active": bool(info.rpc_servers),
        "mode": info.expert_mode,
        "split_mode": "layer" if info.rpc_servers or (info.gpu_offload or {}).get("n_layers_offloaded") else "none",
        "peer_addr": "",
        "peer_reachable": False,
        "layer_split": "",
        "combined_head_attached": False,
        "pipeline_capable": False,
        "reload": reload_meta(info.reload),
        "reload_policy": info.reload_policy,
        "reload_mode": info.reload_mode,
        "config_generation": info.config_generation,
        "slots_total": info.slots_total,
        "slots_busy": info.slots_busy,
        "n_ctx_slot": info.n_ctx_slot,
        "slot_states": list(info.slot_states),
        "steps_per_s": round(info.steps_per_s, 3),
        "tokens_per_s": round(info.tokens_per_s, 3),
        "startup_stage": info.startup_stage,
        "rpc_servers": list(info.rpc_servers),
        "devices": list(info.devices),
        "backend_devices": [dict(d) for d in info.backend_devices],
        "gpu_offload": dict(info.gpu_offload) if info.gpu_offload is not None else None,
        "thread_priorities": dict(info.priorities),
        **flat_fields(info.identity),
        "kv_cache": kv_cache_meta(info.kv_cache),
        "params": info.params.as_dict() if info.params is not None else None,
        "prompt_cache": flat_fields(info.prompt_cache),
        "tensor_overrides": [dict(o) for o in info.tensor_overrides],
    }


def configure_meta(out: ConfigureOutcome) -> dict[str, Any]:
    """The CONFIGURE reply: the C++ keys, plus the keys it computes and hides, plus the reload."""
    meta: dict[str, Any] = {
        "success": True, "tier": out.tier, "params_applied": dict(out.params_applied),
        "deferred_keys": list(out.deferred_keys), "unrecognized_keys": list(out.unrecognized_keys),
        "rejected_keys": dict(out.rejected_keys),
    }
    if out.state_chunk_size_applied is not None:
        meta["state_chunk_size_applied"] = out.state_chunk_size_applied
    meta["config_generation"] = out.config_generation
    if out.reload is not None:
        meta["reload"] = out.reload.value
    if out.unchanged_keys is not None:
        meta["unchanged_keys"] = list(out.unchanged_keys)
    return meta
