"""One valid request for every opcode and dialect, built with the codec's own encoders.

These are the seeds every mutator starts from. Each ``Template`` keeps the pieces it was
made of (JSON body, DECODE v3 header/prompt/kv, KV blob parts) so that structure-aware
mutators can break one thing and re-encode the rest correctly (lengths and hashes stay
valid unless they are the thing being broken — boofuzz's ``Size``/``Checksum`` idea).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

from codec import decode_v3 as V3
from codec import payloads as P
from codec import store as S
from codec.enums import Op
from codec.framing import encode_request
from codec.kvblob import KvCheckpoint, encode_kv_blob_header

# Chat bodies are short on purpose: the cases must stay cheap for any model.
USER_MSG = [{"role": "user", "content": "hi"}]
SMALL_N_PREDICT = 3
# A KV blob whose state region is 8 bytes of [io_magic][seq_id] plus filler: well-framed,
# but not a state any model can load (the server must say so, not fall over).
FAKE_STATE = b"GGSQ\x00\x00\x00\x00" + bytes(24)


@dataclass
class Template:
    name: str  # "<OP>.<dialect>", e.g. "DECODE.v3"
    op: int
    key: bytes = b""
    payload: bytes = b""
    trace: bytes = b""
    kind: str = "raw"  # raw | json | v3 | kvblob | e1 | swap_quant | none
    parts: dict[str, Any] = field(default_factory=dict)  # what the payload was built from
    generation: bool = False  # PREFILL/DECODE: the engine works on it (may take a while)

    def encode(self) -> bytes:
        return encode_request(self.op, self.key, self.payload, self.trace)


def kv_blob(version: int = 3, n_past: int = 3, tokens: tuple[int, ...] = (1, 2, 3), state: bytes = FAKE_STATE,
            checkpoint: KvCheckpoint | None = None) -> bytes:
    return encode_kv_blob_header(version, n_past, list(tokens), checkpoint) + state


def v3_payload(prompt: bytes, kv: bytes = b"", generation: dict[str, Any] | None = None) -> tuple[bytes, dict]:
    gen = generation or {"n_predict": SMALL_N_PREDICT, "sampling": {}, "stop": [], "stream": False,
                         "chat_syntax": "", "oaicompat_model": ""}
    hdr = V3.build_control_header(prompt, kv, generation=gen)
    return V3.encode_decode_v3(hdr, prompt, kv), hdr


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def build_templates(slots: int = 2) -> list[Template]:
    """Every opcode (engine, Store, retired agent ops) in every dialect the reference names."""
    s0 = b"0"
    s1 = str(min(1, slots - 1)).encode()
    t: list[Template] = []

    def add(name: str, op: int, key: bytes, payload: bytes = b"", kind: str = "raw", **kw: Any) -> None:
        t.append(Template(name, op, key, payload, b"fuzz", kind, **kw))

    _control_templates(add, s0, s1)
    _generation_templates(add, s0, s1)
    _state_and_store_templates(add, s0, s1)
    return t


_Add = Callable[..., None]  # build_templates' add(name, op, key, payload=b"", kind="raw", **Template fields)


def _control_templates(add: _Add, s0: bytes, s1: bytes) -> None:
    """Snapshot reads and configuration."""
    # -- snapshot reads
    add("INFO.empty_key", Op.INFO, b"", kind="none")
    add("INFO.slot_key", Op.INFO, s0, kind="none")
    add("STATE_META", Op.STATE_META, s0, kind="none")
    add("STATE_GET", Op.STATE_GET, s1, kind="none")
    # -- configuration
    for name, body in (("empty", {}), ("t1", {"n_predict": 8, "sampling": {"temp": 0.5, "seed": 1}}),
                       ("chunk", {"state_chunk_size": 1048576}), ("unknown_key", {"test": "value"})):
        add(f"CONFIGURE.{name}", Op.CONFIGURE, b"", _json(body), "json", parts={"obj": body})
    add("CONFIGURE.no_payload", Op.CONFIGURE, s0, kind="none")
    add("SET_EXPERT_MODE.raw", Op.SET_EXPERT_MODE, b"", b"solo")
    add("SET_EXPERT_MODE.combined", Op.SET_EXPERT_MODE, b"", b"combined")
    body = {"mode": "solo"}
    add("SET_EXPERT_MODE.json", Op.SET_EXPERT_MODE, b"", _json(body), "json", parts={"obj": body})
    add("SWAP_QUANT", Op.SWAP_QUANT, b"", P.encode_swap_quant("q4_k_m", ".*"), "swap_quant")
    body = {"peer": "127.0.0.1:1", "ot_split": ""}
    add("PIPELINE_ATTACH", Op.PIPELINE_ATTACH, s0, _json(body), "json", parts={"obj": body})


def _generation_templates(add: _Add, s0: bytes, s1: bytes) -> None:
    """PREFILL and DECODE in every dialect."""
    # -- prefill: NEW JSON chat body, plain prompt, unknown model alias, E1 raw tokens
    for name, body in (("json", {"messages": USER_MSG}), ("prompt", {"prompt": "hello"}),
                       ("model_alias", {"model": "no-such-alias", "messages": USER_MSG, "stream": False,
                                        "n_predict": 0})):
        add(f"PREFILL.{name}", Op.PREFILL, s0, _json(body), "json", parts={"obj": body}, generation=True)
    add("PREFILL.e1", Op.PREFILL, s1, P.encode_e1_tokens([1, 2, 3, 4, 5]), "e1", generation=True)
    # -- decode: J17 text, PIN stream, spec 9-byte frames, E1 tokens, merged v3 (with and without kv)
    add("DECODE.pin", Op.DECODE, s0, P.encode_json_decode(SMALL_N_PREDICT, USER_MSG), "json",
        parts={"obj": {"n_predict": SMALL_N_PREDICT, "messages": USER_MSG}}, generation=True)
    body = {"n_predict": SMALL_N_PREDICT, "messages": USER_MSG, "stream": False}
    add("DECODE.frames", Op.DECODE, s0, _json(body), "json", parts={"obj": body}, generation=True)
    add("DECODE.e1", Op.DECODE, s1, P.encode_e1_decode(SMALL_N_PREDICT, [1, 2, 3]), "e1", generation=True)
    prompt = _json(USER_MSG)
    payload, hdr = v3_payload(prompt)
    add("DECODE.v3", Op.DECODE, s1, payload, "v3", parts={"hdr": hdr, "prompt": prompt, "kv": b""},
        generation=True)
    kv = kv_blob()
    payload, hdr = v3_payload(prompt, kv)
    add("DECODE.v3_kv", Op.DECODE, s1, payload, "v3", parts={"hdr": hdr, "prompt": prompt, "kv": kv},
        generation=True)


def _state_and_store_templates(add: _Add, s0: bytes, s1: bytes) -> None:
    """STATE_PUT blobs, the Store ops and the retired agent ops."""
    # -- state transfer: v3, v2 (with checkpoint), legacy v1 blobs
    for version, ck in ((3, None), (2, KvCheckpoint(0, 2, 3, b"t" * 4, b"d" * 2)), (1, None)):
        # v1 with n_past 4: a legacy n_past whose low byte is 2 or 3 reads as a v2/v3 blob
        blob = kv_blob(version, checkpoint=ck) if version != 1 else kv_blob(1, 4, (1, 2, 3, 4))
        add(f"STATE_PUT.v{version}", Op.STATE_PUT, s1, blob, "kvblob",
            parts={"version": version, "checkpoint": ck})
    # -- Store ops (the C# StoreServer; an engine answers them with an error)
    add("STORE.PUT", Op.PUT, b"fuzz/obj", b"object bytes")
    add("STORE.GET", Op.GET, b"fuzz/obj", kind="none")
    add("STORE.STAT", Op.STAT, b"fuzz/obj", kind="none")
    add("STORE.LIST", Op.LIST, b"fuzz/", kind="none")
    add("STORE.DEL", Op.DEL, b"fuzz/obj", kind="none")
    add("STORE.PUT_CHUNKED", Op.PUT_CHUNKED, b"fuzz/obj", S.encode_sized_chunk(b"abc") * 2)
    add("STORE.GET_CHUNKED", Op.GET_CHUNKED, b"fuzz/obj", _json(["xxh3:0000000000000001"]), "json",
        parts={"obj": ["xxh3:0000000000000001"]})
    add("STORE.SYNC_MISSING", Op.SYNC_MISSING, b"fuzz/obj", _json(["xxh3:0000000000000001"]), "json",
        parts={"obj": ["xxh3:0000000000000001"]})
    add("STORE.PUSH_CHUNKS", Op.PUSH_CHUNKS, b"fuzz/obj", S.encode_sized_chunk(b"abc"))
    add("STORE.PUT_META", Op.PUT_META, b"fuzz/obj", _json({"n_past": 3}), "json", parts={"obj": {"n_past": 3}})
    m = {"n_past": 3, "total_size": 3, "chunks": [{"index": 0, "hash": "xxh3:0000000000000001", "size": 3}]}
    add("STORE.PUT_MANIFEST", Op.PUT_MANIFEST, b"fuzz/obj", _json(m), "json", parts={"obj": m})
    add("STORE.GET_MANIFEST", Op.GET_MANIFEST, b"fuzz/obj", kind="none")
    # -- retired agent ops (spec only; every engine answers them with an error)
    for op in (o for o in Op if 0x20 <= o <= 0x27):
        add(f"AGENT.{op.name}", op, s0, b"x")


def by_name(templates: list[Template]) -> dict[str, Template]:
    return {tp.name: tp for tp in templates}
