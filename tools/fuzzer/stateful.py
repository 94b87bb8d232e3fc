"""Stateful sequences: seeded step programs over a model of the slots, with invariants.

A program is a list of symbolic steps (JSON-able dicts), e.g.::

    {"op": "prefill", "slot": 0, "text": "hi", "as": "b0"}
    {"op": "get", "slot": 0, "as": "b1"}
    {"op": "put", "slot": 1, "blob": "b1"}       # a blob produced by an earlier step
    {"op": "decode", "slot": 1, "mode": "frames", "n_predict": 2}

Generated from a seed only (never from what the target answered), so it is addressable by
(seed, index) like every other case; blobs are referred to by name and resolved at run
time. Running it keeps a model — the n_past each slot must have — and checks invariants:

* ``meta.answers``   STATE_META always answers OK (also while another connection decodes);
* ``meta.n_past``    META's n_past equals what the last PREFILL / STATE_PUT / DECODE said;
* ``prefill.*``      PREFILL's meta, blob header, sizes and kv_hash_str agree;
* ``get.*``          STATE_GET's meta and blob agree, and with the model;
* ``put.n_past``     STATE_PUT of a STATE_GET/PREFILL blob restores that blob's n_past;
* ``decode.n_past``  a continuing DECODE never moves n_past backwards;
* ``v3.restore``     a DECODE v3 with a kv segment restores the blob's n_past;
* ``info.answers``   INFO answers as it did at the start.

``put_mutated`` restores a real blob with one field *inside* its KV state region changed — a
cell position, a cell or stream count, a layer's row size (located with ``codec.seqstate``):
a size or a position inside a payload is a claim the server must check before it allocates
or loops by it. Its reply may be anything defined; the target must live, answer and not bloat.
"""
from __future__ import annotations

import asyncio
import json
import random
import struct
from typing import Any

from codec import decode_v3 as V3
from codec import payloads as P
from codec.enums import Op, Status, status_name
from codec.errors import CodecError
from codec.framing import encode_request
from codec.hashing import kv_hash_str
from codec.kvblob import parse_kv_blob_header
from codec.seqstate import SeqField, parse_seq_state

from .cases import Outcome
from .oracles import Baseline, Hang, SentFrame, Slow, await_reply, judge
from .responses import Closed, Conn, Malformed, Resp, Stalled, read_response
from .target import Target

TEXTS = ("hi", "tell me a story", "1 2 3 4", "ünïcödé ✓", "x" * 40)
T1_BODIES = ({"n_predict": 4}, {"sampling": {"temp": 0.7, "top_k": 20}}, {"seed": 7}, {"state_chunk_size": 65536})
KINDS = ("prefill", "meta", "get", "put", "decode", "decode_v3", "configure", "info", "meta_during_decode",
         "prefill_e1", "put_mutated")
WEIGHTS = (4, 3, 3, 4, 3, 1, 1, 1, 1, 1, 2)
# Fields of a sequence state a mutation may change (codec.seqstate names), and values to put
# there; a value is wrapped to the field's width.
STATE_FIELDS = ("cell -1 pos", "cell 0 pos", "cell_count", "n_stream", "cell 0 n_seq_id", "cell 0 seq_id",
                "n_layer", "v_trans", "layer 0 K row_size", "layer 0 V row_size", "layer 0 K type", "magic")
STATE_VALUES = (-1, 0, 1, 2**20, 2**26, 2**31 - 1, 2**32 - 1, 2**40, 2**63)


class _Stop(Exception):
    """End the program here (the failure is already recorded)."""


def generate_program(rng: random.Random, slots: int) -> list[dict[str, Any]]:
    slots = max(1, slots)
    steps: list[dict[str, Any]] = []
    blobs: list[str] = []

    def name() -> str:
        return f"b{len(steps)}"

    if rng.random() < 0.85:
        steps.append({"op": "prefill", "slot": rng.randrange(slots), "text": rng.choice(TEXTS), "as": name()})
        blobs.append(steps[-1]["as"])
    for _ in range(rng.randint(3, 9)):
        kind = rng.choices(KINDS, WEIGHTS)[0]
        s = rng.randrange(slots)
        if kind == "prefill":
            steps.append({"op": kind, "slot": s, "text": rng.choice(TEXTS), "as": name()})
            blobs.append(steps[-1]["as"])
        elif kind == "prefill_e1":
            steps.append({"op": kind, "slot": s, "tokens": [rng.randrange(1, 200) for _ in range(rng.randint(1, 6))]})
        elif kind == "get":
            steps.append({"op": kind, "slot": s, "as": name()})
            blobs.append(steps[-1]["as"])
        elif kind == "put":
            if not blobs:
                continue
            steps.append({"op": kind, "slot": s, "blob": rng.choice(blobs)})
        elif kind == "put_mutated":
            if not blobs:
                continue
            steps.append({"op": kind, "slot": s, "blob": rng.choice(blobs), "field": rng.choice(STATE_FIELDS),
                          "value": rng.choice(STATE_VALUES)})
        elif kind == "decode":
            steps.append({"op": kind, "slot": s, "mode": rng.choice(("frames", "e1", "pin")),
                          "n_predict": rng.randint(1, 3)})
        elif kind == "decode_v3":
            steps.append({"op": kind, "slot": s, "blob": rng.choice(blobs) if blobs and rng.random() < 0.6 else None,
                          "text": rng.choice(TEXTS), "n_predict": rng.randint(1, 3)})
        elif kind == "configure":
            steps.append({"op": kind, "body": rng.choice(T1_BODIES)})
        elif kind == "meta_during_decode":
            steps.append({"op": kind, "slot": s, "other": rng.randrange(slots), "n_predict": rng.randint(4, 12)})
        else:
            steps.append({"op": kind} if kind == "info" else {"op": kind, "slot": s})
    steps += [{"op": "meta", "slot": s} for s in sorted({st["slot"] for st in steps if "slot" in st})]
    return steps


def valid_program(program: list[dict[str, Any]]) -> bool:
    """Every blob a step uses is produced by an earlier step (the minimizer drops steps)."""
    made: set[str] = set()
    for st in program:
        ref = st.get("blob")
        if ref is not None and ref not in made:
            return False
        if "as" in st:
            made.add(st["as"])
    return True


def describe(program: list[dict[str, Any]]) -> str:
    parts = []
    for st in program:
        s = f"{st['op'].upper()}"
        if "slot" in st:
            s += f" s{st['slot']}"
        if st.get("blob"):
            s += f"←{st['blob']}"
        if st.get("mode"):
            s += f"/{st['mode']}"
        parts.append(s)
    return " → ".join(parts)


class _Run:
    def __init__(self, target: Target, baseline: Baseline, cfg, out: Outcome):
        self.target, self.baseline, self.cfg, self.out = target, baseline, cfg, out
        self.n_past: dict[int, int | None] = {}  # slot → n_past the model expects (None: unknown)
        self.why: dict[int, str] = {}  # slot → which step set it (for the report)
        self.blobs: dict[str, tuple[bytes, int]] = {}  # name → (blob bytes, its n_past)
        self.conn: Conn | None = None
        self.step = 0
        self.program_step: dict[str, Any] = {}

    def invariant(self, rule: str, detail: str) -> None:
        self.out.fail("invariant", f"step {self.step}: {detail}", rule=rule)

    def learn(self, slot: int, n_past: int | None, why: str) -> None:
        self.n_past[slot] = n_past
        self.why[slot] = f"step {self.step} ({why})"

    async def request(self, op: int, key: bytes, payload: bytes = b"") -> Resp | None:
        """One request on the program's connection. None: closed instead (reconnect next time)."""
        data = encode_request(op, key, payload, b"stateful")
        self.out.sent.append(data)
        loop = asyncio.get_running_loop()
        frame = SentFrame(op, key, payload)
        try:
            if self.conn is None:
                self.conn = await Conn.open(self.target.host, self.target.port, self.cfg.deadline)
            self.conn.writer.write(data)
            await asyncio.wait_for(self.conn.writer.drain(), self.cfg.deadline)
            r = await await_reply(self.conn.inbox, frame, self.target, self.cfg.deadline, self.cfg.max_wait,
                                  until=loop.time() + self.cfg.max_stream)
        except (Closed, ConnectionError, OSError):
            await self._drop()
            return None
        except Malformed as e:
            self.out.fail("malformed", f"step {self.step}: {e}")
            raise _Stop from None
        except (Hang, TimeoutError) as e:
            self.out.fail("hang", f"step {self.step} ({describe([self.program_step])}): {e or 'send stalled'}")
            raise _Stop from None
        except Slow as e:
            self.out.notes.append(f"step {self.step}: {e}; program stopped")
            raise _Stop from None
        self.out.responses.append(r.summary())
        judge(r, SentFrame(op, key, payload), self.baseline, self.out)
        if r.pieces is not None:  # PIN stream: the server closes after it
            await self._drop()
        return r

    async def _drop(self) -> None:
        if self.conn is not None:
            await self.conn.close()
            self.conn = None

    # ---------------------------------------------------------------- steps
    async def prefill(self, st: dict[str, Any]) -> None:
        s = st["slot"]
        body = json.dumps({"messages": [{"role": "user", "content": st["text"]}]}).encode()
        r = await self.request(Op.PREFILL, str(s).encode(), body)
        if r is None or r.status != Status.OK or r.meta is None or r.payload is None:
            self.learn(s, None, f"PREFILL got {status_name(r.status) if r else 'a close'}")
            return
        n = r.meta.get("n_past")
        try:
            hdr, hlen = parse_kv_blob_header(r.payload)
        except CodecError as e:
            self.invariant("prefill.blob", f"PREFILL payload is not a KV blob: {e}")
            self.learn(s, None, "PREFILL")
            return
        if hdr.n_past != n:
            self.invariant("prefill.n_past", f"PREFILL meta n_past {n} != blob header n_past {hdr.n_past}")
        sizes = (r.meta.get("state_size"), r.meta.get("logits_size"))
        if all(isinstance(x, int) for x in sizes) and hlen + sizes[0] + sizes[1] != len(r.payload):
            self.invariant("prefill.sizes", f"blob header {hlen} + state_size {sizes[0]} + logits_size {sizes[1]} "
                                            f"!= payload_len {len(r.payload)}")
        if "kv_hash_str" in r.meta and r.meta["kv_hash_str"] != kv_hash_str(r.payload):
            self.invariant("prefill.kv_hash", f"kv_hash_str {r.meta['kv_hash_str']} != XXH3 of the payload "
                                              f"{kv_hash_str(r.payload)}")
        self.blobs[st["as"]] = (r.payload, hdr.n_past)
        self.learn(s, n if isinstance(n, int) else None, "PREFILL")

    async def prefill_e1(self, st: dict[str, Any]) -> None:
        s = st["slot"]
        r = await self.request(Op.PREFILL, str(s).encode(), P.encode_e1_tokens(st["tokens"]))
        n = r.meta.get("n_past") if r is not None and r.status == Status.OK and r.meta else None
        self.learn(s, n if isinstance(n, int) else None, "E1 PREFILL")

    async def meta(self, st: dict[str, Any]) -> None:
        s = st["slot"]
        r = await self.request(Op.STATE_META, str(s).encode())
        if r is None or r.status != Status.OK or r.meta is None:
            self.invariant("meta.answers", f"STATE_META s{s} got {status_name(r.status) if r else 'a close'}")
            return
        want, got = self.n_past.get(s), r.meta.get("n_past")
        if want is not None and got != want:
            self.invariant("meta.n_past", f"STATE_META s{s} n_past {got}, expected {want} from "
                                          f"{self.why.get(s, '?')}")

    async def get(self, st: dict[str, Any]) -> None:
        s = st["slot"]
        r = await self.request(Op.STATE_GET, str(s).encode())
        if r is None or r.status != Status.OK or r.meta is None or r.payload is None:
            return  # BUSY/NOT_FOUND are legal answers; STATE_GET changes nothing
        n = r.meta.get("n_past")
        try:
            hdr, hlen = parse_kv_blob_header(r.payload)
        except CodecError as e:
            self.invariant("get.blob", f"STATE_GET payload is not a KV blob: {e}")
            return
        if hdr.n_past != n:
            self.invariant("get.n_past", f"STATE_GET meta n_past {n} != blob header n_past {hdr.n_past}")
        want = self.n_past.get(s)
        if want is not None and n != want:
            self.invariant("get.n_past", f"STATE_GET s{s} n_past {n}, expected {want} from {self.why.get(s, '?')}")
        size = r.meta.get("state_size")
        if isinstance(size, int) and hlen + size != len(r.payload):
            self.invariant("get.sizes", f"blob header {hlen} + state_size {size} != payload_len {len(r.payload)}")
        self.blobs[st["as"]] = (r.payload, hdr.n_past)
        self.learn(s, n if isinstance(n, int) else None, "STATE_GET")

    async def put(self, st: dict[str, Any]) -> None:
        s = st["slot"]
        blob, n = self.blobs.get(st["blob"], (None, None))
        if blob is None:
            return  # the step that makes it failed: nothing to restore
        r = await self.request(Op.STATE_PUT, str(s).encode(), blob)
        if r is None or r.status != Status.OK:
            self.learn(s, None, "STATE_PUT refused")
            return
        got = r.meta.get("n_past") if r.meta else None
        if got is not None and got != n:
            self.invariant("put.n_past", f"STATE_PUT of blob {st['blob']} (n_past {n}) answered n_past {got}")
        self.learn(s, n, f"STATE_PUT of {st['blob']}")

    async def put_mutated(self, st: dict[str, Any]) -> None:
        s = st["slot"]
        blob, _ = self.blobs.get(st["blob"], (None, None))
        mutated = mutate_state_field(blob, st["field"], st["value"]) if blob is not None else None
        if mutated is None:
            return  # no such field in this blob (no cells, another layout): nothing to send
        await self.request(Op.STATE_PUT, str(s).encode(), mutated)
        self.learn(s, None, f"STATE_PUT of {st['blob']} with {st['field']} = {st['value']}")

    async def decode(self, st: dict[str, Any]) -> None:
        s, k = st["slot"], st["n_predict"]
        if st["mode"] == "e1":
            payload = P.encode_e1_decode(k, [])
        else:
            payload = P.encode_json_decode(k, None, stream=False if st["mode"] == "frames" else None)
        r = await self.request(Op.DECODE, str(s).encode(), payload)
        n = r.meta.get("n_past") if r is not None and r.status == Status.OK and r.meta else None
        before = self.n_past.get(s)
        if isinstance(n, int) and before is not None and n < before:
            self.invariant("decode.n_past", f"DECODE continuing s{s} moved n_past back from {before} to {n}")
        self.learn(s, n if isinstance(n, int) else None, f"DECODE/{st['mode']}")

    async def decode_v3(self, st: dict[str, Any]) -> None:
        s = st["slot"]
        blob, n = self.blobs.get(st["blob"], (b"", None)) if st.get("blob") else (b"", None)
        prompt = json.dumps([{"role": "user", "content": st["text"]}]).encode()
        gen = {"n_predict": st["n_predict"], "sampling": {}, "stop": [], "stream": False}
        payload = V3.encode_decode_v3({"generation": gen}, prompt, blob)
        r = await self.request(Op.DECODE, str(s).encode(), payload)
        if r is not None and r.status == Status.OK and r.meta and n is not None:
            got = r.meta.get("n_past_after_restore")
            if got is not None and got != n:
                self.invariant("v3.restore", f"DECODE v3 with blob {st['blob']} (n_past {n}) restored n_past {got}")
        self.learn(s, None, "DECODE v3 (generates in the background)")

    async def configure(self, st: dict[str, Any]) -> None:
        await self.request(Op.CONFIGURE, b"", json.dumps(st["body"]).encode())

    async def info(self, st: dict[str, Any]) -> None:
        r = await self.request(Op.INFO, b"")
        if r is None or not self.baseline.matches(r):
            self.invariant("info.answers", f"INFO got {status_name(r.status) if r else 'a close'}, "
                                           f"expected {self.baseline.describe()}")

    async def meta_during_decode(self, st: dict[str, Any]) -> None:
        """META must answer while another connection's DECODE runs (the C++ queues it behind)."""
        s, other = st["slot"], st["other"]
        side = await Conn.open(self.target.host, self.target.port, self.cfg.deadline)
        try:
            data = encode_request(Op.DECODE, str(s).encode(),
                                  P.encode_json_decode(st["n_predict"], None, stream=False), b"stateful-side")
            self.out.sent.append(data)
            side.writer.write(data)
            await side.writer.drain()
            await asyncio.sleep(0.005)  # let the engine admit it
            self.learn(s, None, "side DECODE running")  # its n_past moves while we look
            await self.meta({"slot": other})
            if other != s:
                await self.meta({"slot": s})
            try:
                r = await read_response(side.inbox, max(self.cfg.deadline, self.cfg.max_stream))
                n = r.meta.get("n_past") if r.status == Status.OK and r.meta else None
                self.learn(s, n if isinstance(n, int) else None, "side DECODE")
            except (Closed, Stalled, Malformed):
                self.learn(s, None, "side DECODE (no reply)")
        finally:
            await side.close()


def mutate_state_field(blob: bytes, field: str, value: int) -> bytes | None:
    """``blob`` (a KV blob) with one header field of its state region set to ``value`` (wrapped to
    the field's width); ``cell -1`` is the last cell. None when the state has no such field."""
    try:
        _, state_at = parse_kv_blob_header(blob)
    except CodecError:
        return None
    fields: list[SeqField] = []
    try:
        parse_seq_state(memoryview(blob)[state_at:], max_cells=1 << 31, max_pos=1 << 31, fields=fields)
    except CodecError:
        pass  # the fields read before the error are located all the same
    if field.startswith("cell -1 "):
        cells = [f for f in fields if f.name.startswith("cell ") and f.name.endswith(field[8:])]
        found = cells[-1] if cells else None
    else:
        found = next((f for f in fields if f.name == field), None)
    if found is None:
        return None
    width = struct.calcsize(found.fmt)
    at = state_at + found.offset
    return blob[:at] + (value % (1 << 8 * width)).to_bytes(width, "little") + blob[at + width:]


async def run_program(program: list[dict[str, Any]], target: Target, baseline: Baseline, cfg) -> Outcome:
    out = Outcome()
    run = _Run(target, baseline, cfg, out)
    try:
        for i, st in enumerate(program):
            run.step, run.program_step = i, st
            await getattr(run, st["op"])(st)
    except _Stop:
        pass
    finally:
        await run._drop()
    return out
