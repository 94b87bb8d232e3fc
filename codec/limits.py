"""Size limits checked before anything is allocated.

Defaults follow the C++ engine's caps where it has them (server-rpc.h:
4 GiB state, 32 KiB DECODE v3 header, 64 MiB prompt) and are tighter where it has
none (CONFIGURE/PREFILL JSON: the C++ allocates whatever payload_len says).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .enums import Op

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# The C++ caps themselves live with the payload codecs that enforce them.
from .payloads import HYDRA_MAX_JSON_HEADER, HYDRA_MAX_PROMPT_BYTES, HYDRA_MAX_STATE_BYTES  # noqa: E402

# Ops whose handlers read no payload: anything sent is drained and ignored.
NO_PAYLOAD_OPS = frozenset({Op.STATE_GET, Op.STATE_META, Op.INFO})


def _default_payload_caps() -> dict[int, int]:
    return {
        Op.STATE_GET: 0,
        Op.STATE_META: 0,
        Op.INFO: 0,
        Op.STATE_PUT: HYDRA_MAX_STATE_BYTES + 64 * MiB,  # state + header + logits tail
        Op.CONFIGURE: 1 * MiB,
        Op.PREFILL: HYDRA_MAX_PROMPT_BYTES,
        Op.DECODE: 12 + HYDRA_MAX_JSON_HEADER + HYDRA_MAX_PROMPT_BYTES + HYDRA_MAX_STATE_BYTES,
        Op.SET_EXPERT_MODE: 64 * KiB,
        Op.SWAP_QUANT: 64 * KiB,
        Op.PIPELINE_ATTACH: 64 * KiB,
    }


@dataclass
class Limits:
    max_key_len: int = 1 * KiB
    max_trace_len: int = 1 * KiB
    # Per-op payload caps; ops not listed (unknown, Store) get ``default_max_payload``.
    max_payload: dict[int, int] = field(default_factory=_default_payload_caps)
    default_max_payload: int = 0
    # Ops whose payload is skipped (up to ``max_drain``) and never handed out.
    ignore_payload_ops: frozenset[int] = NO_PAYLOAD_OPS
    # Unread payload of a refused request is drained (so the connection stays in
    # sync) up to this many bytes; beyond it the stream is given up (closed).
    max_drain: int = 64 * MiB
    # Payloads up to this size are handed to handlers whole; larger ones stream.
    buffer_threshold: int = 1 * MiB
    max_meta_len: int = 16 * MiB - 1

    def payload_cap(self, op: int) -> int:
        return self.max_payload.get(op, self.default_max_payload)
