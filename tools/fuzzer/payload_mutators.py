"""Payload-aware mutations: JSON structure, DECODE v3 validation rules, KV blobs, SWAP_QUANT,
dialect boundaries.

These break one thing and keep the rest valid — lengths and hashes are recomputed unless
they are what is being broken — so the server's deeper checks are reached, not just its
first length test.
"""
from __future__ import annotations

import json
import random
import struct
from typing import Any, Callable

from codec import decode_v3 as V3
from codec.enums import Op
from codec.hashing import kv_hash_str, xxh3_64
from codec.kvblob import KvCheckpoint, encode_kv_blob_header

from .mutators import Family, Mutation, burst, frame
from .templates import FAKE_STATE, USER_MSG, Template, kv_blob

# ---------------------------------------------------------------------------------- JSON

# Values as raw JSON text, so literals Python would never write (1e400, lone surrogates,
# 5000-digit integers) reach the server exactly as a hostile client would send them.
JSON_VALUES = ("null", "true", "-1", "0", "2147483647", "2147483648", "9223372036854775808", "1e400", "1.5",
               '""', '"x"', "[]", "{}", '"\\u0000"', '"\\ud800"', "1" * 5000, '"' + "A" * 65536 + '"',
               "[" * 64 + "]" * 64)
# The type swaps the sweep takes for every key (the random phase draws from all of them).
SWEEP_VALUES = ("null", '"x"', "-1", "2147483647", "1e400", "[]", "{}")
DEEP = 100_000


def _whole_body_variants(obj: Any) -> list[tuple[str, bytes]]:
    """The body broken as a whole: not an object, nesting a recursive parser dies on, invalid
    text of every common kind, and (objects) duplicate / NaN / deeply nested extra members."""
    base = json.dumps(obj, separators=(",", ":"))
    inner = base[1:-1] if isinstance(obj, dict) else ""  # the members, without the braces

    def with_member(member: str) -> str:
        return "{" + (inner + "," if inner else "") + member + "}"

    texts = [
        ("not_object.array", "[1,2,3]"), ("not_object.string", '"x"'), ("not_object.null", "null"),
        ("deep_nesting", "[" * DEEP + "]" * DEEP), ("deep_object", '{"a":' * 20_000 + "1" + "}" * 20_000),
        ("truncated", base[: max(1, len(base) // 2)]), ("trailing_garbage", base + "}}"),
        ("whitespace_only", " \n\t "), ("empty", ""), ("bom", "\ufeff" + base),
        ("single_quotes", base.replace('"', "'")), ("comment", "/*c*/" + base),
        ("huge_object", "{" + ",".join(f'"k{i}":{i}' for i in range(20000)) + "}"),
    ]
    if isinstance(obj, dict):
        texts += [("duplicate_key", with_member(inner) if inner else '{"k":1,"k":2}'),
                  ("nan", with_member('"x":NaN')),
                  ("extra_key_deep", with_member('"__fuzz__":' + "[" * 500 + "]" * 500))]
    out = [(name, text.encode()) for name, text in texts]
    out.append(("utf16", base.encode("utf-16")))
    bad = b'"\xff\xfe":1'
    out.append(("invalid_utf8", with_member("\x00").encode().replace(b"\x00", bad) if isinstance(obj, dict)
                else b"\xff" + base.encode()))
    return out


_SENTINEL = "\u0000fuzz-value\u0000"
_SENTINEL_JSON = json.dumps(_SENTINEL)


def _paths(node: Any, prefix: tuple = (), depth: int = 3):
    """Every member down to ``depth`` levels (the first two items of arrays), as key/index paths."""
    if depth == 0:
        return
    items = node.items() if isinstance(node, dict) else enumerate(node[:2]) if isinstance(node, list) else ()
    for k, v in items:
        yield prefix + (k,)
        yield from _paths(v, prefix + (k,), depth - 1)


def _edit(obj: Any, path: tuple, value_text: str | None) -> str:
    """JSON text of ``obj`` with the member at ``path`` replaced by raw text (None: removed)."""
    clone = json.loads(json.dumps(obj))
    node = clone
    for k in path[:-1]:
        node = node[k]
    if value_text is None:
        del node[path[-1]]
        return json.dumps(clone, separators=(",", ":"))
    node[path[-1]] = _SENTINEL
    return json.dumps(clone, separators=(",", ":")).replace(_SENTINEL_JSON, value_text, 1)


def json_variants(obj: Any, values: tuple[str, ...] = JSON_VALUES) -> list[tuple[str, bytes]]:
    """(note, body bytes) for one JSON body: whole-body breakage, then per member a drop and
    every value of ``values`` in its place (members of nested objects and arrays too)."""
    out = _whole_body_variants(obj)
    for path in _paths(obj):
        name = ".".join(map(str, path))
        out.append((f"drop.{name}", _edit(obj, path, None).encode()))
        for v in values:
            out.append((f"{name}={v[:12]}", _edit(obj, path, v).encode("utf-8", "surrogatepass")))
    return out


def _v3_with(tp: Template, hdr: dict | None = None, prompt: bytes | None = None, kv: bytes | None = None,
             hdr_bytes: bytes | None = None, fix_segments: bool = True) -> bytes:
    """Re-encode a v3 template with one part replaced; segment lengths/hashes recomputed."""
    p = tp.parts
    prompt = p["prompt"] if prompt is None else prompt
    kv = p["kv"] if kv is None else kv
    if hdr_bytes is None:
        h = json.loads(json.dumps(p["hdr"] if hdr is None else hdr))
        if fix_segments and isinstance(h, dict) and "segments" in h and hdr is None:
            h = V3.build_control_header(prompt, kv, generation=p["hdr"]["generation"])
        hdr_bytes = json.dumps(h, separators=(",", ":")).encode()
    return V3.encode_decode_v3_frame(hdr_bytes, prompt, kv)


class JsonStructure(Family):
    """JSON bodies (CONFIGURE, PREFILL, DECODE, PIPELINE_ATTACH, Store) and the v3 control header
    and prompt segment: wrong types, missing/extra keys, deep nesting, huge numbers, bad text."""

    name = "json"

    def __init__(self) -> None:
        self._cache: dict[str, list[tuple[str, bytes]]] = {}

    def applies(self, tp: Template) -> bool:
        return tp.kind in ("json", "v3")

    def _variants(self, tp: Template) -> list[tuple[str, bytes]]:
        if tp.name not in self._cache:
            self._cache[tp.name] = self._build(tp)
        return self._cache[tp.name]

    def _build(self, tp: Template) -> list[tuple[str, bytes]]:
        if tp.kind == "json":
            return json_variants(tp.parts["obj"])
        out = []
        for note, body in json_variants(tp.parts["hdr"]):
            out.append((f"v3.hdr.{note}", V3.encode_decode_v3_frame(body, tp.parts["prompt"], tp.parts["kv"])))
        for note, body in json_variants(USER_MSG)[:12]:
            out.append((f"v3.prompt.{note}", _v3_with(tp, prompt=body)))
        return out

    def sweep_variants(self, tp: Template) -> list[int]:
        """The sweep takes whole-body breakage and, per member, a drop and a few type swaps
        (one v3 template is enough: the kv variant differs only in its segment)."""
        if tp.name == "DECODE.v3_kv":
            return []
        keep = []
        for i, (note, _) in enumerate(self._variants(tp)):
            tail = note.split(".", 2)[-1] if tp.kind == "v3" else note
            if "=" not in tail or tail.split("=", 1)[1] in SWEEP_VALUES:
                keep.append(i)
        return keep

    def variants(self, tp: Template) -> int:
        return len(self._variants(tp))

    def make(self, tp: Template, variant: int, rng: random.Random) -> Mutation:
        note, payload = self._variants(tp)[variant]
        return Mutation(self.name, f"{tp.name}: {note} ({len(payload)} bytes)",
                        burst(frame(tp.op, tp.key, payload, tp.trace)), "JSON payload", note)


# ---------------------------------------------------------------------------------- DECODE v3 rules


def _seg_hdr(tp: Template, edit: Callable[[dict], None]) -> dict:
    h = V3.build_control_header(tp.parts["prompt"], tp.parts["kv"], generation=tp.parts["hdr"]["generation"])
    edit(h)
    return h


def _set(path: str, value: Any) -> Callable[[dict], None]:
    def edit(h: dict) -> None:
        *parents, last = path.split(".")
        node: Any = h
        for k in parents:
            node = node[int(k)] if isinstance(node, list) else node[k]
        if value is _DELETE:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return edit


_DELETE = object()
BIG_PROMPT = 64 * 1024 * 1024 + 1
BIG_KV = 4 * 1024**3 + 1


def v3_rules(tp: Template) -> list[tuple[str, bytes, int | None]]:
    """(rule, payload bytes, declared payload_len or None) — one per DECODE v3 validation rule (docs/protocol.md §8), in the
    C++ order, the header-hash rule first (the cheapest decisive one)."""
    p = tp.parts
    prompt, kv = p["prompt"], p["kv"]
    good = _v3_with(tp)
    hdr_bytes = json.dumps(p["hdr"], separators=(",", ":")).encode()
    h = xxh3_64(hdr_bytes)
    out: list[tuple[str, bytes, int | None]] = [
        ("hdr_hash", V3.encode_decode_v3_frame(hdr_bytes, prompt, kv, hdr_hash=h ^ 1), None),
        ("short_payload", good[:11], None),
        ("hdr_len_cap", V3.encode_decode_v3_frame(hdr_bytes + b" " * (32769 - len(hdr_bytes)), prompt, kv), None),
        ("hdr_overrun", struct.pack("<IQ", len(hdr_bytes) + len(prompt) + len(kv) + 100, h) + good[12:], None),
        ("hdr_json", V3.encode_decode_v3_frame(b"{not json", prompt, kv), None),
        ("hdr_not_object", V3.encode_decode_v3_frame(b"[3]", prompt, kv), None),
    ]
    edits: list[tuple[str, Callable[[dict], None]]] = [
        ("v_missing", _set("v", _DELETE)), ("v_2", _set("v", 2)), ("v_string", _set("v", "3")),
        ("v_huge", _set("v", 1 << 70)), ("kv_metadata_missing", _set("kv_metadata", _DELETE)),
        ("kv_metadata_array", _set("kv_metadata", [])), ("segments_missing", _set("segments", _DELETE)),
        ("segments_object", _set("segments", {})),
        ("segments_4", lambda d: d["segments"].extend([{"id": "kv", "offset": 0, "len": 0, "hash": ""}] * 2)),
        ("segment_no_hash", _set("segments.0.hash", _DELETE)), ("segment_len_negative", _set("segments.0.len", -1)),
        ("segment_len_string", _set("segments.0.len", "3")), ("segment_offset", _set("segments.1.offset", 0)),
        ("segment_id", _set("segments.1.id", "bogus")), ("segment_dup_id", _set("segments.1.id", "prompt")),
        ("segment_sum_over", lambda d: (_set("segments.0.len", len(prompt) + 1)(d),
                                        _set("segments.1.offset", len(prompt) + 1)(d))),
        ("kv_hash_prefix", _set("segments.1.hash", "md5:0000")), ("kv_hash_hex", _set("segments.1.hash", "xxh3:zz")),
        ("kv_hash_long", _set("segments.1.hash", "xxh3:" + "f" * 17)),
        ("kv_hash_mismatch", _set("segments.1.hash", kv_hash_str(xxh3_64(kv) ^ 1))),
        ("prompt_hash_wrong", _set("segments.0.hash", "xxh3:0000000000000000")),  # not verified: must pass
        ("generation_array", _set("generation", [1])),
    ]
    for rule, edit in edits:
        hb = json.dumps(_seg_hdr(tp, edit), separators=(",", ":")).encode()
        out.append((rule, V3.encode_decode_v3_frame(hb, prompt, kv), None))
    hb = json.dumps(_seg_hdr(tp, lambda d: None), separators=(",", ":")).encode()
    out.append(("segment_sum_under", V3.encode_decode_v3_frame(hb, prompt, kv) + b"!", None))
    # Caps declared, bytes not sent: the server must refuse from the header alone.
    for rule, seg, size in (("prompt_len_cap", 0, BIG_PROMPT), ("kv_len_cap", 1, BIG_KV)):
        h2 = _seg_hdr(tp, lambda d: None)
        h2["segments"][seg]["len"] = size
        if seg == 0:
            h2["segments"][1]["offset"] = size
        hb = json.dumps(h2, separators=(",", ":")).encode()
        head = V3.encode_decode_v3_frame(hb)
        total = len(head) + sum(s["len"] for s in h2["segments"])
        out.append((rule, head, total))
    for rule, bad_kv in (("kv_short", b"\x03\x00\x00"), ("kv_tokens", b"\x03" + struct.pack("<II", 3, 0xFFFFFFFF)),
                         # flags says "checkpoint follows", then the segment ends
                         ("kv_checkpoint", encode_kv_blob_header(3, 3, [1, 2, 3])[:-1] + b"\x01"),
                         ("kv_stream", encode_kv_blob_header(3, 3, [1, 2, 3]) + b"GGSQ")):
        out.append((rule, _v3_with(tp, kv=bad_kv), None))
    out += [("prompt_json", _v3_with(tp, prompt=b"{oops"), None), ("prompt_scalar", _v3_with(tp, prompt=b"42"), None),
            ("prompt_object", _v3_with(tp, prompt=json.dumps({"messages": USER_MSG}).encode()), None)]
    return out


class V3Rules(Family):
    """Merged DECODE v3 frames breaking each validation rule in turn."""

    name = "v3.rules"

    def applies(self, tp: Template) -> bool:
        return tp.kind == "v3"

    def variants(self, tp: Template) -> int:
        return len(v3_rules(tp))

    def make(self, tp: Template, variant: int, rng: random.Random) -> Mutation:
        rule, payload, declared = v3_rules(tp)[variant]
        data = frame(Op.DECODE, tp.key, payload, tp.trace, payload_len=declared)
        return Mutation(self.name, f"{tp.name}: breaks rule {rule}", burst(data), "DECODE v3 rule", rule)


# ---------------------------------------------------------------------------------- KV blobs


def blob_variants() -> list[tuple[str, bytes]]:
    """Corrupt KV blobs: version byte, n_tok, flags, checkpoint sizes, tokens, state and tails."""
    head3 = encode_kv_blob_header(3, 3, [1, 2, 3])
    ck = KvCheckpoint(0, 2, 3, b"t" * 4, b"d" * 2)
    head_ck = encode_kv_blob_header(2, 3, [1, 2, 3], ck)
    i_tgt = len(encode_kv_blob_header(2, 3, [1, 2, 3])) + 16  # offset of tgt_sz
    out = [
        ("version_00", b"\x00" + head3[1:] + FAKE_STATE), ("version_04", b"\x04" + head3[1:] + FAKE_STATE),
        ("version_ff", b"\xff" + head3[1:] + FAKE_STATE),
        ("n_tok_max", head3[:5] + struct.pack("<I", 0xFFFFFFFF) + head3[9:] + FAKE_STATE),
        ("n_tok_plus1", head3[:5] + struct.pack("<I", 4) + head3[9:] + FAKE_STATE),
        ("n_tok_zero", head3[:5] + struct.pack("<I", 0) + head3[9:] + FAKE_STATE),
        ("flags_checkpoint_missing", head3[:-1] + b"\x01" + FAKE_STATE[:4]),
        ("flags_all", head3[:-1] + b"\xfe" + FAKE_STATE),
        ("tgt_sz_huge", head_ck[:i_tgt] + struct.pack("<Q", 1 << 63) + head_ck[i_tgt + 8:] + FAKE_STATE),
        ("dft_sz_huge", head_ck[:-10] + struct.pack("<Q", 1 << 62) + head_ck[-2:] + FAKE_STATE),
        ("token_negative", kv_blob(3, 3, (1, -1, 3))), ("token_i32_max", kv_blob(3, 3, (1, 2**31 - 1, 3))),
        ("token_vocab_edge", kv_blob(3, 3, (1, 512, 3))), ("tokens_many", kv_blob(3, 5000, tuple(range(1, 5001)))),
        ("n_past_mismatch", kv_blob(3, 999, (1, 2, 3))), ("state_empty", head3), ("state_short", head3 + b"GGSQ"),
        ("state_big", head3 + bytes(256 * 1024)), ("logits_tail", head3 + FAKE_STATE + bytes(2048)),
        ("v1_reads_as_v2", kv_blob(1, 2, (1, 2))),
        ("v1_tokens_over", struct.pack("<II", 5, 1000) + b"\x01\x00\x00\x00"),
    ]
    out += [(f"cut_{n}", head3[:n]) for n in (1, 5, 8, 9)]
    return out


class KvBlobCorruption(Family):
    """STATE_PUT payloads and DECODE v3 kv segments (re-hashed, so the blob checks are reached)."""

    name = "kvblob"

    def applies(self, tp: Template) -> bool:
        return tp.kind == "kvblob" or tp.name == "DECODE.v3_kv"

    def variants(self, tp: Template) -> int:
        return len(blob_variants())

    def make(self, tp: Template, variant: int, rng: random.Random) -> Mutation:
        note, blob = blob_variants()[variant]
        payload = blob if tp.kind == "kvblob" else _v3_with(tp, kv=blob)
        return Mutation(self.name, f"{tp.name}: blob {note} ({len(blob)} bytes)",
                        burst(frame(tp.op, tp.key, payload, tp.trace)), "KV blob", note)


# ---------------------------------------------------------------------------------- small payload families

SWAP_QUANT_PAYLOADS = (
    ("empty", b""), ("one_byte", b"\x05"), ("qk_len_over", struct.pack("<H", 9) + b"q4"),
    ("qk_len_max", struct.pack("<H", 0xFFFF) + b"q4_k_m"), ("qk_not_utf8", struct.pack("<H", 2) + b"\xff\xfe.*"),
    ("pattern_not_utf8", struct.pack("<H", 2) + b"q4\xc0"), ("zero_qk", struct.pack("<H", 0) + b".*"),
)


class SwapQuant(Family):
    """``[u16 qk_len][qk][pattern]`` with qk_len past the payload (the C++ underflows here)."""

    name = "swap_quant"

    def applies(self, tp: Template) -> bool:
        return tp.op == Op.SWAP_QUANT

    def variants(self, tp: Template) -> int:
        return len(SWAP_QUANT_PAYLOADS)

    def make(self, tp: Template, variant: int, rng: random.Random) -> Mutation:
        note, payload = SWAP_QUANT_PAYLOADS[variant]
        return Mutation(self.name, f"SWAP_QUANT {note}", burst(frame(tp.op, tp.key, payload, tp.trace)))


DIALECT_PAYLOADS = {
    Op.PREFILL: (
        ("brace_nul", b"{\x00\x00\x00"), ("token_123", b"\x7b\x00\x00\x00"), ("ws_json", b' \t\n{"prompt":"x"}'),
        ("e1_high_byte", b"\x01\x00\x00\x01"), ("e1_len_mod4", b"\x01\x00\x00"), ("json_array", b"[1,2,3]"),
        ("no_input", b"{}"), ("messages_empty", b'{"messages":[]}'), ("messages_string", b'{"messages":"x"}'),
        ("prompt_empty", b'{"prompt":""}'), ("message_no_content", b'{"messages":[{"role":"user"}]}'),
        ("long_prompt", json.dumps({"prompt": "word " * 6000}).encode()),
        ("e1_token_negative", struct.pack("<3i", 1, -1, 2)),
        ("hydra_config_bad", b'{"messages":[],"hydra_config":[1]}'), ("model_number", b'{"model":5,"prompt":"x"}'),
    ),
    Op.DECODE: (
        ("e1_n_predict_only", struct.pack("<i", 2)), ("e1_n_predict_negative", struct.pack("<3i", -5, 1, 2)),
        ("v3_lookalike_short", struct.pack("<IQ", 4, 0) + b"{}"), ("json_n_predict_negative", b'{"n_predict":-1}'),
        ("json_continue", b'{"n_predict":2,"messages":null,"stream":false}'), ("json_pin_zero", b'{"n_predict":0}'),
        ("json_stream_true", b'{"n_predict":2,"stream":true,"messages":[]}'),
        ("json_stream_string", b'{"n_predict":2,"stream":"no"}'),
        ("json_messages_object", b'{"n_predict":2,"messages":{}}'), ("brace_nul", b"{\x00\x00\x00\x00\x00\x00\x00"),
        ("twelve_zero", bytes(12)), ("thirteen_zero_brace", bytes(12) + b"{"),
    ),
}


class Dialect(Family):
    """Payloads on the boundaries between dialects (E1 tokens / JSON / v3) for PREFILL and DECODE."""

    name = "dialect"

    def applies(self, tp: Template) -> bool:
        return tp.op in DIALECT_PAYLOADS and tp.name in ("PREFILL.json", "DECODE.frames")

    def variants(self, tp: Template) -> int:
        return len(DIALECT_PAYLOADS[tp.op])

    def make(self, tp: Template, variant: int, rng: random.Random) -> Mutation:
        note, payload = DIALECT_PAYLOADS[tp.op][variant]
        return Mutation(self.name, f"{tp.name.split('.')[0]} {note}", burst(frame(tp.op, tp.key, payload, tp.trace)))
