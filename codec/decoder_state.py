"""The phases a Hydra stream decoder walks through, and which moves between them are legal.

Like h11's ``_state.py``: the table below is the whole state machine, so a reader sees every
path a frame can take without tracing ``decoder.py``, and a move the table does not list
raises instead of leaving the decoder somewhere no code expects it to be.

    HEAD      → PREAMBLE  a whole header arrived
              → BROKEN    bad magic
    PREAMBLE  → PAYLOAD   key + trace (meta) arrived: the start event
              → SKIP      refused by the limits, or an op that ignores its payload
              → BROKEN    refused with more than ``max_drain`` to skip
    PAYLOAD   → HEAD      the end event
              → SKIP      ``skip_payload``
              → BROKEN    ``skip_payload`` with more than ``max_drain`` left
    SKIP      → HEAD      the end event (``skipped=True``)
    BROKEN    (final: every call raises the error that broke it)
"""
from __future__ import annotations

import enum


class Phase(enum.Enum):
    # Enum's own __hash__ is Python code: the identity hash makes the per-frame table lookup a
    # C call (members are singletons compared by identity, so the two agree).
    __hash__ = object.__hash__

    HEAD = "head"  # between frames: waiting for the next header
    PREAMBLE = "preamble"  # header parsed: waiting for key + trace (request) or meta (response)
    PAYLOAD = "payload"  # handing out the payload
    SKIP = "skip"  # discarding the rest of a refused (or payload-ignoring) frame
    BROKEN = "broken"  # the stream cannot be re-synchronised: every call re-raises the error


TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.HEAD: frozenset({Phase.PREAMBLE, Phase.BROKEN}),
    # Limits are checked once the header is in: a refused frame leaves PREAMBLE too.
    Phase.PREAMBLE: frozenset({Phase.PAYLOAD, Phase.SKIP, Phase.BROKEN}),
    Phase.PAYLOAD: frozenset({Phase.HEAD, Phase.SKIP, Phase.BROKEN}),
    Phase.SKIP: frozenset({Phase.HEAD}),
    Phase.BROKEN: frozenset(),
}


class IllegalTransition(RuntimeError):
    """The decoder tried a move its transition table forbids: a bug in the codec, never the
    peer's fault. Deliberately not a ``CodecError``: the fuzzers treat those as the expected
    answer to garbage, and a codec bug must not hide among them."""


def advance(current: Phase, new: Phase, who: str = "decoder") -> Phase:
    """``new`` if the table allows ``current`` → ``new``; raises ``IllegalTransition`` otherwise."""
    if new not in TRANSITIONS[current]:
        raise IllegalTransition(f"codec bug: the {who} moved from {current.name} to {new.name}, which its "
                                f"transition table does not allow (allowed from {current.name}: "
                                f"{', '.join(sorted(p.name for p in TRANSITIONS[current])) or 'nothing'})")
    return new
