"""Slot keys: ASCII decimal, parsed the way the C++ engine's ``std::stoi`` does.

``stoi`` skips leading whitespace, takes an optional sign and digits, and ignores
trailing garbage ("3abc" → 3). An id at or past the slot count maps onto the slots modulo
their count, as the C++ engine maps it (key 7 with 4 slots is slot 3): a coordinator whose
worker file names more slots than this engine has must reach the same slot here as there,
and over HTTP (``/slots/{id}…``, hydra_rpc/http/state.py) too. A negative id is NOT_FOUND;
a key that is not a number stays an error.
"""
from __future__ import annotations

import re

from codec.enums import EMPTY_KEY_MEANS_SLOT0, Status
from codec.errors import RemoteProtocolError

_STOI = re.compile(rb"[ \t\n\v\f\r]*([+-]?[0-9]+)")
_INT_MAX = 2**31 - 1


class BadKey(RemoteProtocolError):
    status = Status.ERROR


class NoSuchSlot(RemoteProtocolError):
    status = Status.NOT_FOUND


def parse_slot_key(key: bytes, op: int, n_slots: int) -> int:
    if not key:
        if op in EMPTY_KEY_MEANS_SLOT0:
            return 0
        raise BadKey("empty key: this opcode needs a numeric slot id", rule="key.empty")
    m = _STOI.match(key)
    if not m:
        raise BadKey(f"key {key[:32].decode('utf-8', 'replace')!r} is not a slot number", rule="key.not_numeric")
    slot = int(m.group(1))
    if not -_INT_MAX - 1 <= slot <= _INT_MAX:
        raise BadKey(f"slot id {m.group(1)[:20].decode()} out of int range", rule="key.range")
    if slot < 0 or n_slots <= 0:
        raise NoSuchSlot(f"invalid slot ID {slot} (this engine has {n_slots} slots)", rule="key.slot")
    return slot % n_slots
