"""The engine's typed data as the wire's JSON: INFO, STATE_META, CONFIGURE replies, identity keys.

One place, shared by the Hydra handlers and the HTTP side, so ``/slots`` and STATE_META
(and INFO and ``/health``) cannot drift apart. Key names and order follow docs/protocol.md.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from engine.slots import SlotSnapshot
from engine.status import ConfigureOutcome, EngineInfo, ModelIdentity, ReloadStatus

ENGINE_NAME = "llama-server-hydra"
ENGINE_VERSION = "E1"
CAPABILITIES = ("prefill", "decode", "state_transfer", "expert_mode", "quant_swap", "preset", "tokenizer",
                "model_name", "model_quant", "model_capabilities", "merged_decode")

# the identity keys the C++ puts into STATE_*/PREFILL meta (when non-empty), in its order
_WIRE_IDENTITY = ("model_alias", "model_path", "tokenizer", "model_name", "model_quant", "model_capabilities")


def _present(v: Any) -> bool:
    return v not in (None, "", 0)


def identity_meta(ident: ModelIdentity) -> dict[str, Any]:
    return {k: getattr(ident, k) for k in _WIRE_IDENTITY if _present(getattr(ident, k))}


def slot_meta(snap: SlotSnapshot, requested_id: int | None = None) -> dict[str, Any]:
    """STATE_META: the C++ keys, then the progress fields and config_generation."""
    out: dict[str, Any] = {
        "slot_id": snap.slot_id if requested_id is None else requested_id,
        "n_past": snap.n_past,
        "state_size": snap.state_size,
        "is_processing": snap.is_processing,
        "is_transferring": snap.is_transferring,
    }
    out.update({k: v for k, v in dataclasses.asdict(snap.identity).items() if _present(v)})
    out.update({
        "operation": snap.operation,
        "tokens_processed": snap.tokens_processed,
        "tokens_total": snap.tokens_total,
        "progress": round(snap.progress, 6),
        "elapsed_ms": round(snap.elapsed_ms, 3),
        "config_generation": snap.config_generation,
    })
    return out


def reload_meta(r: ReloadStatus) -> dict[str, Any]:
    return {"state": r.state.value, "generation": r.generation, "target": r.target, "tier": r.tier,
            "error": r.error, "started_at": r.started_at, "load_ms": round(r.load_ms, 3),
            "swap_ms": round(r.swap_ms, 3), "keys": list(r.keys),
            "pending_for_ms": round((time.time() - r.started_at) * 1000, 1) if r.pending else 0}


def info_meta(info: EngineInfo) -> dict[str, Any]:
    return {
        "engine": ENGINE_NAME,
        "version": ENGINE_VERSION,
        "capabilities": list(CAPABILITIES),
        "preset_aliases": list(info.aliases),
        "solo_active": info.expert_mode == "solo",
        "rpc_backend_active": bool(info.rpc_servers),
        "mode": info.expert_mode,
        "split_mode": "layer" if info.rpc_servers else "none",
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
        "startup_stage": info.startup_stage,
        "rpc_servers": list(info.rpc_servers),
        "devices": list(info.devices),
        **dataclasses.asdict(info.identity),
        "prompt_cache": dataclasses.asdict(info.prompt_cache),
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
