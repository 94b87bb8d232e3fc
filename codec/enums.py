"""Opcode and status numbers of the Hydra protocol (docs/protocol.md §4, §6, §13)."""
from __future__ import annotations

import enum


class Op(enum.IntEnum):
    # Store (C# StoreServer, port 9500)
    PUT = 0x01
    GET = 0x02
    DEL = 0x03
    STAT = 0x04
    LIST = 0x05
    PUT_CHUNKED = 0x10
    GET_CHUNKED = 0x11
    SYNC_MISSING = 0x12
    PUSH_CHUNKS = 0x13
    PUT_META = 0x14
    PUT_MANIFEST = 0x15
    # Retired agent ops (spec only; every server answers ERROR)
    AGENT_20 = 0x20
    AGENT_21 = 0x21
    AGENT_22 = 0x22
    SLOT_ERASE = 0x23
    AGENT_24 = 0x24
    AGENT_25 = 0x25
    AGENT_26 = 0x26
    AGENT_27 = 0x27
    # Engine
    STATE_GET = 0x30
    STATE_PUT = 0x31
    STATE_META = 0x32
    GET_MANIFEST = 0x33  # Store only
    CONFIGURE = 0x40
    INFO = 0x41
    PREFILL = 0x42
    DECODE = 0x43
    SET_EXPERT_MODE = 0x44
    SWAP_QUANT = 0x45
    PIPELINE_ATTACH = 0x46


ENGINE_OPS = frozenset(
    {
        Op.STATE_GET,
        Op.STATE_PUT,
        Op.STATE_META,
        Op.CONFIGURE,
        Op.INFO,
        Op.PREFILL,
        Op.DECODE,
        Op.SET_EXPERT_MODE,
        Op.SWAP_QUANT,
        Op.PIPELINE_ATTACH,
    }
)
STORE_OPS = frozenset(
    {
        Op.PUT, Op.GET, Op.DEL, Op.STAT, Op.LIST, Op.PUT_CHUNKED, Op.GET_CHUNKED,
        Op.SYNC_MISSING, Op.PUSH_CHUNKS, Op.PUT_META, Op.PUT_MANIFEST, Op.GET_MANIFEST,
    }
)
# Engine ops whose empty key means slot 0 (NEW/WS); every other slot op needs a number.
EMPTY_KEY_MEANS_SLOT0 = frozenset({Op.CONFIGURE, Op.INFO, Op.SET_EXPERT_MODE, Op.SWAP_QUANT})


class Status(enum.IntEnum):
    OK = 0x00
    NOT_FOUND = 0x01
    ERROR = 0x02
    PARTIAL = 0x03
    BUSY = 0x04
    BAD_REQUEST = 0x05
    NOT_IMPLEMENTED = 0x06


_OP_NAMES = {int(o): o.name for o in Op}
_STATUS_NAMES = {int(s): s.name for s in Status}


def op_name(op: int) -> str:
    """Name of an opcode byte, or ``0xNN`` for a value the protocol never defined."""
    return _OP_NAMES.get(op) or f"0x{op:02X}"


def status_name(status: int) -> str:
    return _STATUS_NAMES.get(status) or f"0x{status:02X}"
