"""Mutations of the framing and the transport: header fields, keys, lengths, truncation,
pipelining, slow-loris dribbling, abrupt closes, random havoc.

Every family has a finite list of *variants* per template (enumerated in the sweep phase,
in order) and a random form (the random phase). ``make(tp, variant, rng)`` is pure given
its arguments, so a case is a function of (seed, index). Payload-aware families (JSON,
DECODE v3, KV blobs, …) are in ``payload_mutators``.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from construct import Struct

from codec.decode_v3 import DECODE_V3_PREFIX
from codec.enums import ENGINE_OPS, Op
from codec.framing import REQUEST_HEADER, REQUEST_HEADER_SIZE, pack_request_header_unchecked
from codec.framing import encode_request as _encode_request
from codec.kvblob import KV_V23_HEAD

from .cases import Message
from .templates import Template

U64_MAX = (1 << 64) - 1
HUGE_PAYLOAD_LENS = (1 << 40, U64_MAX, 1 << 63, 1 << 32, (1 << 31) + 1)
# Bytes below 0x14 open a ggml-RPC session on a shared port: a Hydra-mode case never starts
# with one, so it can never reach (and crash) an upstream rpc-server through the passthrough.
GGML_FIRST_BYTES = range(0x14)
# The smuggled canary: a complete request hidden in a payload. A server that does not consume
# the payload answers it as a second request — the desync becomes visible as an extra reply.
CANARY = _encode_request(Op.INFO, b"", b"", b"smuggled")


def encode_request(op: int, key: bytes = b"", payload: bytes = b"", trace: bytes = b"") -> bytes:
    return _encode_request(op, key, payload, trace)


def frame(op: int, key: bytes = b"", payload: bytes = b"", trace: bytes = b"", *, flags: int = 0,
          magic: bytes | None = None, key_len: int | None = None, trace_len: int | None = None,
          payload_len: int | None = None) -> bytes:
    """A request whose header fields may lie about what follows."""
    head = pack_request_header_unchecked(op, len(key) if key_len is None else key_len,
                                         len(payload) if payload_len is None else payload_len,
                                         len(trace) if trace_len is None else trace_len, flags)
    if magic is not None:
        head = magic + head[2:]
    return head + key + trace + payload


def guard_first_byte(messages: list[Message]) -> list[Message]:
    """Keep a Hydra case out of the ggml-RPC first-byte range (see GGML_FIRST_BYTES)."""
    if messages and messages[0].data and messages[0].data[0] in GGML_FIRST_BYTES:
        m = messages[0]
        messages[0] = Message(b"\x5a" + m.data[1:], m.mode, m.chunk, m.delay_ms, m.then)
    return messages


@dataclass
class Mutation:
    generator: str
    note: str
    messages: list[Message]
    field: str = ""  # the header field / key / rule the generator changed (summary: "mutated FIELD = VALUE")
    value: str = ""


def burst(data: bytes, then: str = "none") -> list[Message]:
    return [Message(data, then=then)]


class Family:
    """A mutation family: ``variants(tp)`` deterministic variants for the sweep, ``random`` for the rest."""

    name = "family"
    # Sweep only the first template of each opcode: for families whose effect does not depend
    # on the payload (flags, key, lengths, …) one carrier per opcode is enough.
    per_op = False

    def applies(self, tp: Template) -> bool:
        return True

    def variants(self, tp: Template) -> int:
        return 0

    def make(self, tp: Template, variant: int, rng: random.Random) -> Mutation:
        raise NotImplementedError

    def random(self, tp: Template, rng: random.Random) -> Mutation:
        return self.make(tp, rng.randrange(max(1, self.variants(tp))), rng)


# ---------------------------------------------------------------------------------- header fields


class OpSweep(Family):
    """All 256 opcode values, each carrying a smuggled INFO as its payload."""

    name = "op.sweep"

    def applies(self, tp: Template) -> bool:
        return tp.name == "INFO.empty_key"  # one carrier is enough: the op byte is what varies

    def variants(self, tp: Template) -> int:
        return 256

    def make(self, tp: Template, variant: int, rng: random.Random) -> Mutation:
        return Mutation(self.name, f"op 0x{variant:02x} with a smuggled INFO as payload",
                        burst(frame(variant, b"0", CANARY, b"fuzz")), "op", f"0x{variant:02x}")

    def random(self, tp: Template, rng: random.Random) -> Mutation:
        op = rng.randrange(256)
        pad = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 9)))
        return Mutation(self.name, f"op 0x{op:02x}, payload {len(pad)} junk bytes + smuggled INFO",
                        burst(frame(op, str(rng.randrange(4)).encode(), pad + CANARY)), "op", f"0x{op:02x}")


MAGICS = (b"\x48\x59", b"\x59\x59", b"\x59\x00", b"\x59\x49", b"\xff\xff", b"\x58\x48", b"\x59\xc8", b"YHYH")


class Magic(Family):
    """Wrong magic: at the start of a connection, and on the second request of a connection."""

    name = "magic"

    def applies(self, tp: Template) -> bool:
        return tp.name in ("INFO.empty_key", "PREFILL.json")  # the magic is checked before the op matters

    def variants(self, tp: Template) -> int:
        return 2 * len(MAGICS)

    def make(self, tp: Template, variant: int, rng: random.Random) -> Mutation:
        magic = MAGICS[variant % len(MAGICS)][:2]
        bad = frame(tp.op, tp.key, tp.payload, tp.trace, magic=magic)
        if variant < len(MAGICS):
            return Mutation(self.name, f"{tp.name} with magic {magic.hex(' ')}", burst(bad), "magic", magic.hex(" "))
        good = encode_request(Op.INFO)
        return Mutation(self.name, f"INFO, then {tp.name} with magic {magic.hex(' ')}", burst(good + bad),
                        "magic (2nd request)", magic.hex(" "))


class Flags(Family):
    name = "flags"
    per_op = True
    VALUES = (0x01, 0x02, 0x80, 0xFF)

    def variants(self, tp: Template) -> int:
        return len(self.VALUES)

    def make(self, tp: Template, variant: int, rng: random.Random) -> Mutation:
        f = self.VALUES[variant]
        return Mutation(self.name, f"{tp.name} with flags 0x{f:02x}",
                        burst(frame(tp.op, tp.key, tp.payload, tp.trace, flags=f)), "flags", f"0x{f:02x}")


KEYS = (b"", b"-1", b"+1", b" \t1", b"1abc", b"\xff\xfe", b"\x00", b"0\x00", b"99999999999999999999",
        b"2147483648", b"-2147483649", b"0x1", b"\xc0\x80", b"1e3", b"9" * 1024, b"7" * 1025, b"1" * 65535)


class Key(Family):
    """Keys a slot-id parser (stoi) must survive: signs, junk, overflow, non-UTF-8, 64 KiB."""

    name = "key"
    per_op = True

    def applies(self, tp: Template) -> bool:
        return tp.op in ENGINE_OPS  # Store keys are object names: any bytes go

    def variants(self, tp: Template) -> int:
        return len(KEYS)

    def make(self, tp: Template, variant: int, rng: random.Random) -> Mutation:
        k = KEYS[variant]
        return Mutation(self.name, f"{tp.name} with key {k[:16]!r} ({len(k)} bytes)",
                        burst(frame(tp.op, k, tp.payload, tp.trace)), "key", f"{k[:16]!r} ({len(k)} bytes)")


TRACES = (b"\xff\xfe\xfd", b"\x00\x00\x00\x00", "é".encode("utf-16"), b"t" * 1024, b"t" * 1025, b"t" * 65535)


class Trace(Family):
    name = "trace"
    per_op = True

    def variants(self, tp: Template) -> int:
        return len(TRACES)

    def make(self, tp: Template, variant: int, rng: random.Random) -> Mutation:
        tr = TRACES[variant]
        return Mutation(self.name, f"{tp.name} with trace {tr[:12]!r} ({len(tr)} bytes)",
                        burst(frame(tp.op, tp.key, tp.payload, tr)), "trace", f"{tr[:12]!r} ({len(tr)} bytes)")


class LengthLie(Family):
    """key_len / trace_len / payload_len that do not match the bytes that follow."""

    per_op = True

    def __init__(self, field: str, huge: bool = False):
        self.field = field
        self.huge = huge
        self.name = f"{field}.{'huge' if huge else 'lie'}"

    def _deltas(self, tp: Template) -> list[str]:
        actual = {"key_len": len(tp.key), "trace_len": len(tp.trace), "payload_len": len(tp.payload)}[self.field]
        if self.huge:
            return [f"={v}" for v in HUGE_PAYLOAD_LENS]
        out = ["+1", "+7", "=0"]
        if actual:
            out[1:1] = ["-1", f"-{max(1, actual // 2)}"]
        out.append("=65535" if self.field != "payload_len" else f"+{1 << 16}")
        return out

    def variants(self, tp: Template) -> int:
        return len(self._deltas(tp))

    def make(self, tp: Template, variant: int, rng: random.Random) -> Mutation:
        d = self._deltas(tp)[variant]
        actual = {"key_len": len(tp.key), "trace_len": len(tp.trace), "payload_len": len(tp.payload)}[self.field]
        value = int(d[1:]) if d[0] == "=" else actual + int(d)
        payload = tp.payload[:4096] if self.huge else tp.payload
        data = frame(tp.op, tp.key, payload, tp.trace, **{self.field: value})
        return Mutation(self.name, f"{tp.name}: {self.field} {value} (actual {actual})", burst(data), self.field,
                        f"{value} (actual {actual})")

    def random(self, tp: Template, rng: random.Random) -> Mutation:
        if self.huge:
            return self.make(tp, rng.randrange(self.variants(tp)), rng)
        actual = {"key_len": len(tp.key), "trace_len": len(tp.trace), "payload_len": len(tp.payload)}[self.field]
        limit = 0xFFFF if self.field != "payload_len" else 1 << 20
        value = min(limit, max(0, actual + rng.choice((-1, 1)) * rng.choice((1, 2, 3, 8, 64, 4096))))
        data = frame(tp.op, tp.key, tp.payload, tp.trace, **{self.field: value})
        return Mutation(self.name, f"{tp.name}: {self.field} {value} (actual {actual})", burst(data), self.field,
                        f"{value} (actual {actual})")


# ---------------------------------------------------------------------------------- transport


def field_ends(layout: Struct) -> list[int]:
    """Offsets where each member of a fixed-size codec layout ends."""
    ends, pos = [], 0
    for sc in layout.subcons:
        pos += sc.sizeof()
        ends.append(pos)
    return ends


def boundaries(tp: Template) -> list[int]:
    """Every offset where a field of the request ends (truncation points), without the full length."""
    k, t = len(tp.key), len(tp.trace)
    hs = REQUEST_HEADER_SIZE
    out = [1, hs - 1, *field_ends(REQUEST_HEADER), hs + k, hs + k + t]  # inside the magic and trace_len too
    base = hs + k + t
    p = tp.parts
    if tp.kind == "v3":
        prefix = DECODE_V3_PREFIX.sizeof()
        hdr_len = DECODE_V3_PREFIX.parse(tp.payload[:prefix]).hdr_len
        body = base + prefix + hdr_len
        prompt_len = len(p.get("prompt", b""))
        out += [*(base + e for e in field_ends(DECODE_V3_PREFIX)), base + prefix + hdr_len // 2, body,
                body + prompt_len, body + prompt_len + 1]
    elif tp.kind == "kvblob":  # the v2/v3 head's fields, then the first token
        out += [*(base + e for e in field_ends(KV_V23_HEAD)), base + KV_V23_HEAD.sizeof() + 4]
    elif tp.payload:
        out += [base + 1, base + len(tp.payload) // 2]
    total = base + len(tp.payload)
    out.append(total - 1)
    return sorted({b for b in out if 0 < b < total})


class Truncate(Family):
    """The request cut at every field boundary (the peer then half-closes: a close must follow)."""

    name = "truncate"

    def variants(self, tp: Template) -> int:
        return len(boundaries(tp))

    def make(self, tp: Template, variant: int, rng: random.Random) -> Mutation:
        cut = boundaries(tp)[variant]
        data = tp.encode()
        return Mutation(self.name, f"{tp.name} cut after {cut} of {len(data)} bytes", burst(data[:cut]),
                        "length", f"cut after {cut} of {len(data)} bytes")

    def random(self, tp: Template, rng: random.Random) -> Mutation:
        data = tp.encode()
        cut = rng.randrange(1, len(data))
        return Mutation(self.name, f"{tp.name} cut after {cut} of {len(data)} bytes", burst(data[:cut]),
                        "length", f"cut after {cut} of {len(data)} bytes")


class Abrupt(Family):
    """Close (FIN) or reset (RST) the connection mid-request, or right after a whole request."""

    name = "abrupt"
    per_op = True
    KINDS = (("mid", "rst"), ("mid", "fin"), ("whole", "rst"), ("whole", "fin"), ("header", "rst"))

    def variants(self, tp: Template) -> int:
        return len(self.KINDS)

    def make(self, tp: Template, variant: int, rng: random.Random) -> Mutation:
        where, how = self.KINDS[variant]
        data = tp.encode()
        head = 16 + len(tp.key) + len(tp.trace)
        if where == "mid" and len(data) > head + 1:
            data = data[: head + max(1, (len(data) - head) // 2)]
        elif where == "header":
            data = data[:9]
        return Mutation(self.name, f"{tp.name}: {where} request then {how.upper()}", burst(data, then=how))


class Dribble(Family):
    """Slow-loris: the request in 1–3 byte writes with small pauses (must still be served)."""

    name = "dribble"

    def applies(self, tp: Template) -> bool:
        return len(tp.encode()) <= 400

    def variants(self, tp: Template) -> int:
        return 2

    def make(self, tp: Template, variant: int, rng: random.Random) -> Mutation:
        chunk, delay = ((1, 0.5), (3, 2.0))[variant]
        return Mutation(self.name, f"{tp.name} in {chunk}-byte writes every {delay} ms",
                        [Message(tp.encode(), "dribble", chunk, delay)])

    def random(self, tp: Template, rng: random.Random) -> Mutation:
        chunk, delay = rng.choice((1, 2, 3, 5)), rng.choice((0.0, 0.3, 1.0, 3.0))
        return Mutation(self.name, f"{tp.name} in {chunk}-byte writes every {delay} ms",
                        [Message(tp.encode(), "dribble", chunk, delay)])


class Pipeline(Family):
    """Several requests in one write; errors in the middle must not shift the answers after them."""

    name = "pipeline"

    def __init__(self, templates: list[Template]):
        self.simple = [t for t in templates if not t.generation and t.kind != "kvblob"]

    def variants(self, tp: Template) -> int:
        return 3

    def make(self, tp: Template, variant: int, rng: random.Random) -> Mutation:
        meta = encode_request(Op.STATE_META, b"0")
        bad = frame(0x99, b"0", CANARY)
        if variant == 0:
            parts, note = [tp.encode()] * 3, f"3 × {tp.name}"
        elif variant == 1:
            parts, note = [meta, bad, tp.encode(), meta], f"META, op 0x99 + canary, {tp.name}, META"
        else:
            parts = [tp.encode(), frame(Op.STATE_META, b"abc"), tp.encode()]
            note = f"{tp.name}, bad-key META, {tp.name}"
        return Mutation(self.name, note, burst(b"".join(parts)))

    def random(self, tp: Template, rng: random.Random) -> Mutation:
        chosen = [tp] + rng.sample(self.simple, k=min(len(self.simple), rng.randrange(1, 6)))
        rng.shuffle(chosen)
        return Mutation(self.name, " + ".join(t.name for t in chosen), burst(b"".join(t.encode() for t in chosen)))


INTERESTING = (0x00, 0x01, 0x7F, 0x80, 0xFF, 0x59, 0x48, 0x7B, 0x22)


class Havoc(Family):
    """Random byte edits of an encoded request (no length fix-ups): flips, overwrites, inserts, deletes."""

    name = "havoc"

    def make(self, tp: Template, variant: int, rng: random.Random) -> Mutation:
        data = bytearray(tp.encode())
        edits = []
        for _ in range(rng.randrange(1, 5)):
            if len(data) < 3:
                break
            pos = rng.randrange(2, len(data))  # keep the magic: havoc explores what follows it
            how = rng.randrange(5)
            if how == 0:
                data[pos] ^= 1 << rng.randrange(8)
                edits.append(f"flip@{pos}")
            elif how == 1:
                data[pos] = rng.choice(INTERESTING)
                edits.append(f"set@{pos}")
            elif how == 2:
                ins = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
                data[pos:pos] = ins
                edits.append(f"ins{len(ins)}@{pos}")
            elif how == 3:
                n = rng.randrange(1, 9)
                del data[pos:pos + n]
                edits.append(f"del{n}@{pos}")
            else:
                n = rng.randrange(1, 17)
                data[pos:pos] = data[pos:pos + n]
                edits.append(f"dup{n}@{pos}")
        return Mutation(self.name, f"{tp.name} havoc {','.join(edits)}", burst(bytes(data)))


class RandomPayload(Family):
    """A well-framed request of any known opcode with random payload bytes."""

    name = "payload.random"

    def make(self, tp: Template, variant: int, rng: random.Random) -> Mutation:
        n = rng.choice((0, 1, 4, 12, 13, 64, 512))
        payload = bytes(rng.randrange(256) for _ in range(n))
        return Mutation(self.name, f"{tp.name} with {n} random payload bytes",
                        burst(frame(tp.op, tp.key, payload, tp.trace)))
