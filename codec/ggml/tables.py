"""ggml's own enums as an ``rpc_tensor`` carries them: tensor types and graph ops, per version.

An rpc-server trusts these numbers: an op past the end of ``enum ggml_op`` indexes the CPU
backend's dispatch tables out of bounds, and the custom ops carry a host *function pointer* in
``op_params`` that the server would call. Since 3.6.1 upstream ties the protocol's patch number
to ``GGML_OP_COUNT`` (a static_assert in ggml-rpc.h), so a version names exactly one op enum.
Only versions whose enums were read from a real build are listed; tests compare them with the
installed libggml.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .commands import normalize_version


@dataclass(frozen=True, slots=True)
class TypeTraits:
    name: str
    block_size: int  # elements per block
    type_size: int  # bytes per block


@dataclass(frozen=True, slots=True)
class GgmlEnums:
    types: tuple[TypeTraits | None, ...]  # index = ggml_type; None = removed (block size 0)
    ops: tuple[str, ...]  # index = ggml_op

    @property
    def custom_ops(self) -> frozenset[int]:
        """Ops whose op_params hold a function pointer of the *client's* address space."""
        return frozenset(i for i, name in enumerate(self.ops) if name.startswith(("MAP_CUSTOM", "CUSTOM")))


# llama.cpp as vendored by llama-cpp-python 0.3.36: RPC protocol 7.0.0, GGML_OP_COUNT 101.
_TYPES_7 = (
    TypeTraits("f32", 1, 4), TypeTraits("f16", 1, 2), TypeTraits("q4_0", 32, 18), TypeTraits("q4_1", 32, 20),
    None, None,  # Q4_2, Q4_3: removed
    TypeTraits("q5_0", 32, 22), TypeTraits("q5_1", 32, 24), TypeTraits("q8_0", 32, 34), TypeTraits("q8_1", 32, 36),
    TypeTraits("q2_K", 256, 84), TypeTraits("q3_K", 256, 110), TypeTraits("q4_K", 256, 144),
    TypeTraits("q5_K", 256, 176), TypeTraits("q6_K", 256, 210), TypeTraits("q8_K", 256, 292),
    TypeTraits("iq2_xxs", 256, 66), TypeTraits("iq2_xs", 256, 74), TypeTraits("iq3_xxs", 256, 98),
    TypeTraits("iq1_s", 256, 50), TypeTraits("iq4_nl", 32, 18), TypeTraits("iq3_s", 256, 110),
    TypeTraits("iq2_s", 256, 82), TypeTraits("iq4_xs", 256, 136), TypeTraits("i8", 1, 1), TypeTraits("i16", 1, 2),
    TypeTraits("i32", 1, 4), TypeTraits("i64", 1, 8), TypeTraits("f64", 1, 8), TypeTraits("iq1_m", 256, 56),
    TypeTraits("bf16", 1, 2),
    None, None, None,  # Q4_0_4_4, Q4_0_4_8, Q4_0_8_8: removed
    TypeTraits("tq1_0", 256, 54), TypeTraits("tq2_0", 256, 66),
    None, None, None,  # IQ4_NL_4_4, IQ4_NL_4_8, IQ4_NL_8_8: removed
    TypeTraits("mxfp4", 32, 17), TypeTraits("nvfp4", 64, 36), TypeTraits("q1_0", 128, 18),
    TypeTraits("q2_0", 64, 18),
)
_OPS_7 = (
    "NONE", "DUP", "ADD", "ADD_ID", "ADD1", "ACC", "SUB", "MUL", "DIV", "SQR", "SQRT", "LOG", "SIN", "COS", "SUM",
    "SUM_ROWS", "CUMSUM", "MEAN", "ARGMAX", "COUNT_EQUAL", "REPEAT", "REPEAT_BACK", "CONCAT", "SILU_BACK", "NORM",
    "RMS_NORM", "RMS_NORM_BACK", "GROUP_NORM", "L2_NORM", "MUL_MAT", "MUL_MAT_ID", "OUT_PROD", "SCALE", "SET",
    "CPY", "CONT", "RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE", "GET_ROWS", "GET_ROWS_BACK", "SET_ROWS", "DIAG",
    "DIAG_MASK_INF", "DIAG_MASK_ZERO", "SOFT_MAX", "SOFT_MAX_BACK", "ROPE", "ROPE_BACK", "CLAMP",
    "CONV_TRANSPOSE_1D", "IM2COL", "IM2COL_BACK", "IM2COL_3D", "COL2IM_1D", "CONV_2D", "CONV_3D", "CONV_2D_DW",
    "CONV_TRANSPOSE_2D", "POOL_1D", "POOL_2D", "POOL_2D_BACK", "UPSCALE", "PAD", "PAD_REFLECT_1D", "ROLL",
    "ARANGE", "TIMESTEP_EMBEDDING", "ARGSORT", "TOP_K", "LEAKY_RELU", "TRI", "FILL", "FLASH_ATTN_EXT",
    "FLASH_ATTN_BACK", "SSM_CONV", "SSM_SCAN", "WIN_PART", "WIN_UNPART", "GET_REL_POS", "ADD_REL_POS",
    "RWKV_WKV6", "GATED_LINEAR_ATTN", "RWKV_WKV7", "SOLVE_TRI", "GATED_DELTA_NET", "LIGHTNING_INDEXER",
    "DSV4_HC_COMB", "DSV4_HC_PRE", "DSV4_HC_POST", "UNARY", "MAP_CUSTOM1", "MAP_CUSTOM2", "MAP_CUSTOM3", "CUSTOM",
    "CROSS_ENTROPY_LOSS", "CROSS_ENTROPY_LOSS_BACK", "OPT_STEP_ADAMW", "OPT_STEP_SGD", "GLU",
)
_KNOWN = {(7, 0, 0): GgmlEnums(_TYPES_7, _OPS_7)}
assert len(_TYPES_7) == 43 and len(_OPS_7) == 101


def enums_for(version: Iterable[int] | None) -> GgmlEnums | None:
    """The type and op enums of ``version``; None when this codec has not seen that build."""
    return _KNOWN.get(normalize_version(version))  # type: ignore[arg-type]


def type_name(t: int, version: Iterable[int] | None = None) -> str:
    """``q8_0``; for an unknown version the newest table we have names the type."""
    enums = enums_for(version) or _KNOWN[max(_KNOWN)]
    traits = enums.types[t] if 0 <= t < len(enums.types) else None
    return traits.name if traits else f"type {t}"


def op_name(op: int, version: Iterable[int] | None = None) -> str:
    enums = enums_for(version) or _KNOWN[max(_KNOWN)]
    return enums.ops[op] if 0 <= op < len(enums.ops) else f"op {op}"
