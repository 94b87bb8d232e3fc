"""What a case is, what running it produced, and the self-contained case-file format.

A ``Case`` is pure data: the bytes of each message to send (and how: at once, dribbled,
followed by an abrupt close), or a stateful step program, or a decoder input. It is made
by ``schedule.case_at(seed, index)`` and never depends on what the target answered, so the
same seed always yields the same cases.

A case file (``--out DIR/<class>-....json``) holds everything needed to reproduce a finding
without the fuzzer's state: the hex of every message, what came back, the oracle that
failed, the target and spawn command, and a one-line replay command.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

CASE_FORMAT = "hydra-rpc-fuzz-case/1"

# Finding classes, most severe first; an outcome's primary class is the first that failed.
CLASSES = (
    "crash",  # the target process died, or its port refuses connections
    "liveness",  # a fresh connection's INFO was not answered (as at the start) within the deadline
    "hang",  # the fuzzed connection neither answered nor closed within the deadline
    "resource",  # (spawn) the target's peak RSS jumped during one case: it allocated what a length claimed
    "desync",  # extra / missing / mismatched responses, or the follow-up INFO on it failed
    "bad-status",  # a response carried a status the protocol does not define
    "malformed",  # a response broke the framing (truncated, meta not a JSON object, …)
    "traceback",  # (spawn) the target logged a Python traceback while it handled this case
    "invariant",  # a stateful invariant (n_past bookkeeping, META always answers) failed
    "codec-error",  # a decoder raised something other than a CodecError on garbage
    "codec-diff",  # two decoder paths (construct/struct, whole/split) disagreed
)
SEVERITY = {c: i for i, c in enumerate(CLASSES)}
# Classes that are one symptom seen at different moments: an engine busy for seconds is a
# hang on the fuzzed connection or a liveness failure on the next one, depending on timing.
SAME_SYMPTOM = {"hang": {"hang", "liveness"}, "liveness": {"hang", "liveness"}}
# Rules that are one symptom seen at different moments: replies out of step with the requests.
# Which one a run sees depends on timing — whether the unasked-for reply arrived before the
# follow-up INFO was sent ("extra") or after it ("followup") — so a re-run on a loaded host may
# see the other; it still reproduces the desync.
SAME_RULE = {r: {"extra", "followup"} for r in ("extra", "followup")}


@dataclass
class Message:
    """One write (or a slow series of writes) on the fuzzed connection."""

    data: bytes
    mode: str = "burst"  # burst | dribble
    chunk: int = 1  # dribble: bytes per write
    delay_ms: float = 0.0  # dribble: pause between writes
    then: str = "none"  # none | fin (close) | rst (close with RST) — what to do afterwards

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"hex": self.data.hex(), "len": len(self.data)}
        if self.mode != "burst":
            out.update(mode=self.mode, chunk=self.chunk, delay_ms=self.delay_ms)
        if self.then != "none":
            out["then"] = self.then
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Message":
        return cls(bytes.fromhex(d["hex"]), d.get("mode", "burst"), d.get("chunk", 1), d.get("delay_ms", 0.0),
                   d.get("then", "none"))


@dataclass
class Case:
    seed: int
    index: int
    phase: str  # smoke | sweep | random | stateful | codec | ggml
    generator: str  # which generator/mutator made it, e.g. "op.sweep" — part of a finding's signature
    note: str  # human description
    protocol: str = "hydra"  # hydra | ggml | codec
    messages: list[Message] = field(default_factory=list)
    program: list[dict[str, Any]] | None = None  # stateful step program (symbolic)
    decoder: str | None = None  # codec mode: which decoder gets messages[0].data
    mutated: dict[str, str] | None = None  # {"field": ..., "value": ...}: what the generator changed

    @property
    def size(self) -> int:
        return sum(len(m.data) for m in self.messages)

    def digest(self) -> str:
        """A short content hash: equal digests ⇔ identical bytes, program and decoder."""
        h = hashlib.sha256()
        h.update(json.dumps([self.phase, self.generator, self.protocol, self.decoder, self.program],
                            sort_keys=True, default=str).encode())
        for m in self.messages:
            h.update(json.dumps(m.to_json(), sort_keys=True).encode())
        return h.hexdigest()[:16]

    def with_messages(self, messages: list[Message]) -> "Case":
        return Case(self.seed, self.index, self.phase, self.generator, self.note, self.protocol, messages,
                    self.program, self.decoder, self.mutated)

    def with_program(self, program: list[dict[str, Any]]) -> "Case":
        return Case(self.seed, self.index, self.phase, self.generator, self.note, self.protocol,
                    list(self.messages), program, self.decoder, self.mutated)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "seed": self.seed, "index": self.index, "phase": self.phase, "generator": self.generator,
            "note": self.note, "protocol": self.protocol, "messages": [m.to_json() for m in self.messages],
        }
        if self.program is not None:
            out["program"] = self.program
        if self.decoder is not None:
            out["decoder"] = self.decoder
        if self.mutated:
            out["mutated"] = self.mutated
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Case":
        return cls(d["seed"], d["index"], d["phase"], d["generator"], d.get("note", ""), d.get("protocol", "hydra"),
                   [Message.from_json(m) for m in d.get("messages", [])], d.get("program"), d.get("decoder"),
                   d.get("mutated"))


@dataclass
class Failure:
    oracle: str  # one of CLASSES
    detail: str
    rule: str = ""  # finer identity (e.g. the invariant's name), part of the signature for invariants

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v}


@dataclass
class Outcome:
    """What running one case produced."""

    failures: list[Failure] = field(default_factory=list)
    responses: list[dict[str, Any]] = field(default_factory=list)  # summaries, in order
    received: bytes = b""  # raw bytes from the fuzzed connection (capped)
    sent: list[bytes] = field(default_factory=list)  # concrete messages (stateful: resolved steps)
    exit: dict[str, Any] | None = None  # spawn mode: how the target died
    notes: list[str] = field(default_factory=list)  # non-findings worth knowing ("slow", "closed")
    expected: list[str] = field(default_factory=list)  # would-be findings the request asked for (explain.py)
    traceback: str = ""  # spawn mode: the traceback(s) the target logged during the case
    elapsed: float = 0.0

    def fail(self, oracle: str, detail: str, rule: str = "") -> None:
        self.failures.append(Failure(oracle, detail[:500], rule))

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def primary(self) -> Failure | None:
        if not self.failures:
            return None
        return min(self.failures, key=lambda f: SEVERITY.get(f.oracle, len(CLASSES)))

    def same_failure(self, other: Failure) -> bool:
        """Does this outcome reproduce ``other`` (same class; same rule when it has one)?"""
        classes = SAME_SYMPTOM.get(other.oracle, {other.oracle})
        rules = SAME_RULE.get(other.rule, {other.rule})
        return any(f.oracle in classes and (not other.rule or f.rule in rules or f.oracle != other.oracle)
                   for f in self.failures)


def signature(case: Case, failure: Failure) -> str:
    """Findings with one signature are one bug: only the first is minimized and saved."""
    sig = f"{failure.oracle}:{case.generator}"
    return f"{sig}:{failure.rule}" if failure.rule else sig


def safe_name(s: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in s)[:80]
