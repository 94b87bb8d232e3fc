"""The ``kv_cache`` object of INFO / STATE_META, and what a sender declares of it.

docs/protocol.md: ``kv_cache`` is what a coordinator compares before it moves KV state between
engines. Its keys are the wire's, so they are defined here once: the engine fills them from its
context (``engine.kv_cache.KvCacheInfo``), the wire layers only pass the object on. A sender
declares the part that llama.cpp's sequence-state header does not carry (DECODE v3
``kv_metadata.kv_cache``, HTTP ``X-Hydra-KV-Cache``); :func:`compare_declared` names the first
declared field that differs. Sans-IO: plain values in, JSON-able dicts out.
"""
from __future__ import annotations

from typing import Any, Mapping

from .seqstate import Mismatch

#: ``error`` of the meta that refuses a state this engine's KV cache cannot take
KV_STATE_MISMATCH = "kv_state_mismatch"

#: What changes the meaning of a sequence state's bytes yet is not in llama.cpp's header (which
#: carries the layout: streams, cells, layers, v_trans, types, row sizes): K and V rotated before
#: they were stored, and the RoPE applied to K. A sender declares them (its INFO / STATE_META
#: ``kv_cache``; DECODE v3 ``kv_metadata.kv_cache``, HTTP ``X-Hydra-KV-Cache``); a binary
#: STATE_PUT has no place for them and cannot be checked.
DECLARED_FIELDS = ("attn_rotation.k", "attn_rotation.v", "rope.scaling", "rope.freq_base", "rope.freq_scale",
                   "rope.yarn_ext_factor", "rope.yarn_attn_factor", "rope.yarn_beta_fast", "rope.yarn_beta_slow",
                   "rope.yarn_orig_ctx")


class DeclarationShapeError(ValueError):
    """A declared ``kv_cache`` that is not an object of the published shape."""


def kv_cache_object(*, type_k: str, type_v: str, flash_attn: str, v_trans: bool | None, kv_unified: bool,
                    n_ctx: int, n_ctx_slot: int, n_stream: int | None, rope: Mapping[str, Any],
                    rotation: tuple[bool, bool], rotation_disabled: bool, build: str) -> dict[str, Any]:
    """INFO's / STATE_META's ``kv_cache``, keys in the documented order. ``flash_attn`` is the
    setting (on | off | auto); what is in effect follows from ``v_trans`` when it is known
    (None: a memory without a parsed layout)."""
    return {
        "type_k": type_k, "type_v": type_v,
        "flash_attn": flash_attn if v_trans is None else ("on" if not v_trans else "off"),
        "flash_attn_setting": flash_attn, "kv_unified": kv_unified, "v_trans": v_trans,
        "n_ctx": n_ctx, "n_ctx_slot": n_ctx_slot, "n_stream": n_stream,
        "rope": dict(rope), "attn_rotation": {"k": rotation[0], "v": rotation[1]},
        "attn_rotation_disabled": rotation_disabled, "llama_cpp": build,
    }


def declaration(kv_cache: Mapping[str, Any]) -> dict[str, Any]:
    """What a sender declares about its states: the groups of ``DECLARED_FIELDS`` of its
    ``kv_cache`` (:func:`kv_cache_object`)."""
    return {"attn_rotation": dict(kv_cache["attn_rotation"]), "rope": dict(kv_cache["rope"])}


def compare_declared(ours: Mapping[str, Any], declared: Any) -> Mismatch | None:
    """The first of ``DECLARED_FIELDS`` where a sender's ``declared`` kv_cache differs from
    ``ours``, as ``("kv_cache.<path>", got, want)``; None when they agree. Only the fields the
    sender declares are compared, so one that declares nothing (None) is not checked. Raises
    :class:`DeclarationShapeError` for a declaration of the wrong shape."""
    if declared is None:
        return None
    if not isinstance(declared, dict):
        raise DeclarationShapeError("the declared kv_cache must be a JSON object (INFO's kv_cache)")
    for path in DECLARED_FIELDS:
        group, key = path.split(".")
        theirs = declared.get(group)
        if theirs is None:
            continue
        if not isinstance(theirs, dict):
            raise DeclarationShapeError(f"the declared kv_cache.{group} must be an object")
        if key not in theirs:
            continue
        got, want = theirs[key], ours[group].get(key)
        if not _same(got, want):
            return (f"kv_cache.{path}", got, want)
    return None


def _same(got: Any, want: Any) -> bool:
    # JSON has one number type (0 and 0.0 agree), but a flag must be a flag: 1 is not True
    if isinstance(want, bool) or isinstance(got, bool):
        return got is want
    if isinstance(want, (int, float)) and isinstance(got, (int, float)):
        return float(got) == float(want)
    return got == want


def mismatch_meta(field: str, got: Any, want: Any) -> dict[str, Any]:
    """The error meta of a refused state: the first field that differs, what the state (or its
    sender) has, what this engine has."""
    return {"error": KV_STATE_MISMATCH, "field": field, "got": got, "want": want}
