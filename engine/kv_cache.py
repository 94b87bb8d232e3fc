"""The KV cache of a built context: what INFO/STATE_META report, and what a restore must match.

llama.cpp checks little of a sequence state on restore and only logs what it refuses (the
seq-state format is in codec/seqstate.py); a state from a context with other rope settings
or attention rotation "restores" and gives wrong output. So a context describes itself here,
and every restore (:func:`restore_state`) is compared with it first:
:meth:`KvCacheInfo.check_state` parses the header bounded by the slot's context — positions,
cell counts and sizes in a blob are claims — and names the first field that differs.

The layout is not computed from the model's hyper-parameters: the backend writes one cell
of its own context and reads the layout from that (``KvLayout``), so it is what this
llama.cpp writes and accepts, flash-attention "auto" resolved.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Protocol

from codec.errors import LocalProtocolError
from codec.kvmeta import (
    DECLARED_FIELDS,
    DeclarationShapeError,
    compare_declared,
    declaration,
    kv_cache_object,
    mismatch_meta,
)
from codec.seqstate import (
    KV_TYPE_BLOCKS,
    KvCacheSummary,
    KvExpected,
    Mismatch,
    SeqStateSummary,
    compare,
    ggml_type_name,
    kv_row_size,
    parse_seq_state,
)

from .jobs import BadInput
from .kv_layout import slot_context
from .model_params import ModelParams

# DECLARED_FIELDS belongs to the wire (codec.kvmeta); it is exported here too, beside the check
__all__ = [
    "DECLARED_FIELDS", "KV_SHAPE_KEYS", "BadDeclaration", "KvCacheInfo", "KvLayout", "KvStateMismatch",
    "build_problem", "check_declared", "declared_kv_cache", "restore_state",
]


class KvStateMismatch(BadInput):
    """A state this context cannot take: ``field``, what the blob has (``got``), what this
    engine has (``want``)."""

    def __init__(self, field_name: str, got: Any, want: Any) -> None:
        super().__init__(f"KV state {field_name} is {got}, this engine's KV cache has {want}")
        self.field, self.got, self.want = field_name, got, want

    def as_meta(self) -> dict[str, Any]:
        return mismatch_meta(self.field, self.got, self.want)


@dataclass(frozen=True)
class KvLayout:
    """How this context's sequence states are laid out: per KV cache (2 for iSWA models) what
    a restore must carry, and how to parse one (``cell_ext``)."""

    caches: tuple[KvExpected, ...]
    cell_ext: bool = False

    @classmethod
    def from_probe(cls, summary: SeqStateSummary, cell_ext: bool, max_cells: int) -> "KvLayout":
        return cls(tuple(_expected(c, max_cells) for c in summary.caches), cell_ext)

    def bytes_per_cell(self, type_k: str | None = None, type_v: str | None = None) -> int:
        """KV bytes one cell (token) takes in every layer, with these cache types (default:
        this context's). ValueError when a type does not fit the model's rows."""
        total = 0
        for c in self.caches:
            tk, tv = type_k or c.type_k, type_v or c.type_v
            try:
                total += sum(kv_row_size(tk, n) for n in c.n_embd_k) + sum(kv_row_size(tv, n) for n in c.n_embd_v)
            except LocalProtocolError as e:  # a row is not whole blocks of the type
                raise ValueError(str(e)) from None
        return total


def _expected(cache: KvCacheSummary, max_cells: int) -> KvExpected:
    s = cache.filled[0]
    type_k, type_v = ggml_type_name(s.layers[0].k_type), ggml_type_name(s.layers[0].v_type)

    def elements(type_name: str, row: int) -> int:
        blck, size = KV_TYPE_BLOCKS[type_name]
        return row // size * blck

    n_embd_k = tuple(elements(type_k, ly.k_row_size) for ly in s.layers)
    n_embd_v = tuple(ly.v_n_embd if s.v_trans else elements(type_v, ly.v_row_size) for ly in s.layers)
    return KvExpected(cache.n_stream, bool(s.v_trans), type_k, type_v, n_embd_k, n_embd_v, max_cells)


@dataclass(frozen=True)
class KvCacheInfo:
    """One built context's KV cache (INFO / STATE_META ``kv_cache``)."""

    type_k: str
    type_v: str
    flash_attn: str  # the setting: on | off | auto
    kv_unified: bool
    n_ctx: int  # cells of the context
    n_ctx_slot: int  # tokens one slot may hold (llama-server's rule)
    rope: dict[str, Any] = field(default_factory=dict)
    rotation: tuple[bool, bool] = (False, False)  # K, V rotated before they are stored
    build: str = ""
    layout: KvLayout | None = None  # None: a memory llama.cpp lays out otherwise (recurrent)
    n_ctx_train: int = 0
    head_dim: tuple[int, int] = (0, 0)  # K, V elements per attention head (0: unknown)
    # (bytes of a one-token sequence state, bytes each further token adds), measured at load
    state_growth: tuple[int, int] = (0, 0)
    # LLAMA_ATTN_ROT_DISABLE set (to anything) in the environment the context was built with
    rotation_disabled: bool = False

    @property
    def max_state_size(self) -> int:
        """The largest sequence state one slot can hold, in bytes (an upper bound: a
        sliding-window cache stops growing at its window); 0 when not measured."""
        one, per_token = self.state_growth
        return one + per_token * max(0, self.n_ctx_slot - 1) if one else 0

    def fit_problem(self, type_k: str, type_v: str, n_cells: int, available: int) -> str | None:
        """Why a context of this model with these cache types and ``n_cells`` cells cannot be
        built (checked before anything is allocated), or None."""
        for name, t, n in (("cache_type_k", type_k, self.head_dim[0]), ("cache_type_v", type_v, self.head_dim[1])):
            blck = KV_TYPE_BLOCKS[t][0]
            if n and n % blck:
                return f"{name} {t} needs attention heads of a multiple of {blck} elements; this model's have {n}"
        if self.layout is None:
            return None
        need = self.layout.bytes_per_cell(type_k, type_v) * n_cells
        if need > available:
            return (f"a KV cache of {n_cells} cells ({type_k}/{type_v}) needs {need >> 20} MiB; "
                    f"{available >> 20} MiB of memory is available")
        return None

    @property
    def v_trans(self) -> bool | None:
        return self.layout.caches[0].v_trans if self.layout else None

    @functools.cached_property
    def as_dict(self) -> dict[str, Any]:
        """The wire's ``kv_cache`` (codec.kvmeta), JSON-able (computed once: STATE_META is polled)."""
        return kv_cache_object(
            type_k=self.type_k, type_v=self.type_v, flash_attn=self.flash_attn, v_trans=self.v_trans,
            kv_unified=self.kv_unified, n_ctx=self.n_ctx, n_ctx_slot=self.n_ctx_slot,
            n_stream=self.layout.caches[0].n_stream if self.layout else None, rope=self.rope,
            rotation=self.rotation, rotation_disabled=self.rotation_disabled, build=self.build)

    def check_state(self, buf: Any) -> SeqStateSummary | None:
        """Parse the header of the sequence state at the start of ``buf`` and compare it with
        this cache. Raises codec errors (MalformedPayload / Truncated: a broken or oversized
        blob) or :class:`KvStateMismatch`; returns the summary (None: no layout to check)."""
        if self.layout is None:
            return None
        # streams and layers keep the codec's bounds, so that a blob with other counts is a
        # mismatch that names the field, not a parse error
        summary = parse_seq_state(buf, max_cells=self.n_ctx_slot, max_pos=self.n_ctx_slot,
                                  cell_ext=self.layout.cell_ext, n_caches=len(self.layout.caches))
        for cache, want in zip(summary.caches, self.layout.caches):
            m: Mismatch | None = compare(SeqStateSummary(summary.seq_id, (cache,), summary.size), want)
            if m is not None:
                raise KvStateMismatch(*m)
        return summary


class BadDeclaration(BadInput):
    """A declared ``kv_cache`` that is not an object of the published shape."""


def declared_kv_cache(info: "KvCacheInfo") -> dict[str, Any]:
    """What a sender declares about its states: the ``DECLARED_FIELDS`` of its ``kv_cache``."""
    return declaration(info.as_dict)


def check_declared(info: "KvCacheInfo", declared: Any) -> None:
    """Compare a sender's declared ``kv_cache`` (INFO's shape; only the ``DECLARED_FIELDS`` it
    has are compared, so a sender that declares nothing is not checked) with this context.
    Raises :class:`KvStateMismatch` naming the first field that differs (``kv_cache.<path>``),
    :class:`BadDeclaration` for a declaration of the wrong shape."""
    if declared is None or info is None:
        return
    try:
        m = compare_declared(info.as_dict, declared)
    except DeclarationShapeError as e:
        raise BadDeclaration(str(e)) from None
    if m is not None:
        raise KvStateMismatch(*m)


class Restorable(Protocol):
    """What :func:`restore_state` needs of a model (``engine.backend.ModelBackend`` has it): a
    protocol of its own, so that the backend protocol may name ``KvCacheInfo`` without a cycle."""

    @property
    def kv_cache(self) -> KvCacheInfo: ...
    def state_seq_set(self, seq: int, data: Any) -> int: ...


def restore_state(model: Restorable, seq: int, state: Any, declared: Any = None) -> int:
    """Load a sequence state into ``seq``: the one way a state reaches llama.cpp (STATE_PUT,
    the DECODE v3 kv segment, slot files, the prompt cache's RAM and disk tiers). Its header is
    parsed and compared with the model's KV cache first (:meth:`KvCacheInfo.check_state`), so
    a blob that does not fit never gets to ``llama_state_seq_set_data``. Raises what
    ``check_state`` raises, or the backend's error; returns the bytes llama.cpp read.
    ``declared``: what the sender says about the bytes beyond the header (:func:`check_declared`),
    compared first."""
    check_declared(model.kv_cache, declared)
    model.kv_cache.check_state(state)
    return model.state_seq_set(seq, state)


#: staged CONFIGURE keys that shape the KV cache
KV_SHAPE_KEYS = {"n_ctx", "cache_type_k", "cache_type_v", "kv_unified", "flash_attn"}


def build_problem(p: ModelParams, live: KvCacheInfo | None, available: int) -> str | None:
    """Why llama.cpp could not build a context of ``p`` (checked before a reload starts): a
    quantized V cache without flash attention; and, given the ``live`` model's cache (the
    same model), a cache type its heads do not divide or a KV cache over ``available`` bytes.
    Another model's sizes are checked when it is built."""
    why = p.conflict()
    if why is None and live is not None:
        try:
            cells = slot_context(p.n_ctx, p.n_slots, p.kv_unified, n_ctx_train=live.n_ctx_train,
                                 kv_unified_per_slot=p.n_ctx_slot_cap).n_ctx
        except ValueError as e:
            return str(e)
        why = live.fit_problem(p.cache_type_k, p.cache_type_v, cells, available)
    return why
