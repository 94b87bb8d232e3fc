"""A context describes its own KV cache: one cell written and read back as a sequence state
gives the layout llama.cpp writes and accepts (flash attention "auto" resolved, per-layer
rows, iSWA caches), so it is never re-derived from hyper-parameters (engine/kv_cache.py)."""
from __future__ import annotations

from importlib import metadata
from typing import Any, Mapping, Protocol

import llama_cpp.llama_cpp as L

from codec.errors import CodecError
from codec.seqstate import ggml_type_name, parse_seq_state

from ..backend import BatchItem, ModelBackend
from ..kv_cache import KvCacheInfo, KvLayout
from ..kv_layout import attention_rotation

_FLASH_ATTN = {int(L.LLAMA_FLASH_ATTN_TYPE_ENABLED): "on", int(L.LLAMA_FLASH_ATTN_TYPE_DISABLED): "off",
               int(L.LLAMA_FLASH_ATTN_TYPE_AUTO): "auto"}
_ROPE_SCALING = {int(L.LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED): "model", int(L.LLAMA_ROPE_SCALING_TYPE_NONE): "none",
                 int(L.LLAMA_ROPE_SCALING_TYPE_LINEAR): "linear", int(L.LLAMA_ROPE_SCALING_TYPE_YARN): "yarn",
                 int(L.LLAMA_ROPE_SCALING_TYPE_LONGROPE): "longrope"}


class Probed(ModelBackend, Protocol):
    """What is read of a :class:`LoadedModel` here: named as a protocol, so that the model
    may describe itself with this module."""

    cparams: Any

    @property
    def model_handle(self) -> Any: ...
    @property
    def n_ctx(self) -> int: ...
    @property
    def n_ctx_slot(self) -> int: ...


def llama_cpp_build() -> str:
    try:
        return f"llama-cpp-python {metadata.version('llama-cpp-python')}"
    except metadata.PackageNotFoundError:  # pragma: no cover - always installed here
        return "llama-cpp-python"


def probe(m: Probed) -> tuple[KvLayout | None, tuple[int, int]]:
    """Seq 0 written with one token, then two (and left empty): the layout of ``m``'s sequence
    states (None for a memory the seq-state parser does not know: recurrent and hybrid models),
    and how they grow — (bytes of a one-token state, bytes each further token adds). Sizes are
    measured, not computed, so they hold for any memory (a recurrent state does not grow)."""
    tok = m.bos if m.bos >= 0 else 0
    m.seq_clear(0)
    try:
        m.decode([BatchItem(0, [tok], 0, logits_last=False)])
        blob = bytes(m.state_seq_get(0))
        m.decode([BatchItem(0, [tok], 1, logits_last=False)])
        growth = (len(blob), max(0, m.state_seq_size(0) - len(blob)))
    finally:
        m.seq_clear(0)
    return _layout(blob, m.n_ctx_slot), growth


def _layout(blob: bytes, n_ctx_slot: int) -> KvLayout | None:
    for cell_ext in (False, True):
        for n_caches in (1, 2):
            try:
                summary = parse_seq_state(blob, max_cells=1, cell_ext=cell_ext, n_caches=n_caches)
            except CodecError:
                continue
            if summary.size == len(blob) and all(c.filled for c in summary.caches):
                return KvLayout.from_probe(summary, cell_ext, n_ctx_slot)
    return None


def describe(m: Probed, environ: Mapping[str, str]) -> KvCacheInfo:
    """``m``'s KV cache for INFO / STATE_META and restores. ``environ``: what llama.cpp read
    from the environment when it built the context (``LLAMA_ATTN_ROT_DISABLE``)."""
    c = m.cparams
    type_k, type_v = ggml_type_name(int(c.type_k)), ggml_type_name(int(c.type_v))
    layout, growth = probe(m)
    rotation, heads = (False, False), (0, 0)
    n_head_kv = int(L.llama_model_n_head_kv(m.model_handle))
    if layout is not None and n_head_kv > 0:
        full = layout.caches[0]
        heads = (full.n_embd_k[0] // n_head_kv, full.n_embd_v[0] // n_head_kv)
        rotation = attention_rotation(type_k, type_v, *heads, environ)
    rope = {"scaling": _ROPE_SCALING.get(int(c.rope_scaling_type), str(c.rope_scaling_type)),
            "freq_base": float(c.rope_freq_base), "freq_scale": float(c.rope_freq_scale),
            "yarn_ext_factor": float(c.yarn_ext_factor), "yarn_attn_factor": float(c.yarn_attn_factor),
            "yarn_beta_fast": float(c.yarn_beta_fast), "yarn_beta_slow": float(c.yarn_beta_slow),
            "yarn_orig_ctx": int(c.yarn_orig_ctx)}
    return KvCacheInfo(type_k=type_k, type_v=type_v, flash_attn=_FLASH_ATTN.get(int(c.flash_attn_type), "auto"),
                       kv_unified=bool(c.kv_unified), n_ctx=m.n_ctx, n_ctx_slot=m.n_ctx_slot, rope=rope,
                       rotation=rotation, build=llama_cpp_build(), layout=layout,
                       n_ctx_train=int(L.llama_model_n_ctx_train(m.model_handle)), head_dim=heads,
                       state_growth=growth, rotation_disabled=bool(environ.get("LLAMA_ATTN_ROT_DISABLE")))
