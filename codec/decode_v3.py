"""Merged DECODE v3 frames (docs/protocol.md §8): encoder as C# clients send them, validator as NEW checks them.

Payload, little-endian::

    [u32 hdr_len ≤ 32768][u64 XXH3-64(hdr)][hdr: JSON control header][prompt segment][kv segment]

Built for a server that streams, so every limit is enforced before the bytes it guards are
read or allocated:

1. read 12 bytes → :func:`parse_decode_v3_prefix` (hdr_len, hash; needs payload_len);
2. read hdr_len bytes → :func:`validate_decode_v3` → :class:`DecodeV3Header` with the
   segment lengths, all caps checked;
3. read the prompt (≤ 64 MiB) → :func:`parse_prompt_segment`;
4. read the kv blob header → :func:`kv_segment_need` / :func:`validate_kv_segment`, stream the
   state through :class:`~codec.hashing.Xxh3Stream`, then :func:`verify_segment_hash`.

Each failed rule raises MalformedPayload with its own ``rule`` id, in the order the C++ checks
them. The C++ answers all of them BAD_REQUEST(0,0) without draining; a drop-in drains.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from construct import ConstructError, Int32ul, Int64ul, Struct

from .errors import CodecError, LocalProtocolError, MalformedPayload, Truncated
from .hashing import Xxh3Stream, kv_hash_str, parse_hash_str, xxh3_64
from .json_text import dumps_compact, loads_json
from .kvblob import STATE_STREAM_PREFIX_LEN, KvBlobHeader, blob_version, kv_header_need, parse_kv_blob_header
from .payloads import HYDRA_MAX_JSON_HEADER, HYDRA_MAX_PROMPT_BYTES, HYDRA_MAX_STATE_BYTES

__all__ = [
    "HYDRA_MAX_JSON_HEADER", "HYDRA_MAX_PROMPT_BYTES", "HYDRA_MAX_STATE_BYTES", "DECODE_V3_PREFIX",
    "PREFIX_LEN", "Segment", "DecodeV3Header", "parse_decode_v3_prefix", "parse_decode_v3_prefix_construct",
    "validate_decode_v3", "kv_segment_need", "validate_kv_segment", "verify_segment_hash",
    "parse_prompt_segment", "parse_decode_v3", "build_control_header", "encode_decode_v3",
    "encode_decode_v3_frame",
]

DECODE_V3_PREFIX = Struct("hdr_len" / Int32ul, "hdr_hash" / Int64ul)
_PREFIX = struct.Struct("<IQ")
PREFIX_LEN = _PREFIX.size  # 12
DECODE_HDR_VERSION = 3
MAX_SEGMENTS = 3
SEGMENT_IDS = ("prompt", "kv")
_SEGMENT_FIELDS = ("id", "offset", "len", "hash")

Buffer = bytes | bytearray | memoryview


def _bad(rule: str, message: str) -> MalformedPayload:
    return MalformedPayload(message, rule=rule)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True, slots=True)
class Segment:
    id: str
    offset: int  # relative to the end of the control header
    len: int
    hash: str  # "xxh3:…" or "" (kv only: no hash)


@dataclass(frozen=True, slots=True)
class DecodeV3Header:
    hdr_len: int
    hdr_hash: int
    payload_len: int
    header: dict[str, Any]  # the parsed control header, as sent
    segments: tuple[Segment, ...]  # wire order

    @property
    def version(self) -> int:
        return self.header["v"]

    @property
    def model(self) -> str:
        model = self.header.get("model")
        return model if isinstance(model, str) else ""

    @property
    def kv_metadata(self) -> dict[str, Any]:
        return self.header["kv_metadata"]

    @property
    def model_metadata(self) -> dict[str, Any] | None:
        md = self.header.get("model_metadata")
        return md if isinstance(md, dict) else None

    @property
    def generation(self) -> Any:
        return self.header.get("generation")

    @property
    def body_offset(self) -> int:
        """Where the segments start in the payload (12 + hdr_len)."""
        return PREFIX_LEN + self.hdr_len

    def _segment(self, seg_id: str) -> Segment | None:
        return next((s for s in self.segments if s.id == seg_id), None)

    @property
    def prompt_len(self) -> int:
        seg = self._segment("prompt")
        return seg.len if seg else 0

    @property
    def kv_len(self) -> int:
        seg = self._segment("kv")
        return seg.len if seg else 0

    @property
    def prompt_offset(self) -> int:
        """Absolute offset of the prompt segment in the payload."""
        seg = self._segment("prompt")
        return self.body_offset + (seg.offset if seg else 0)

    @property
    def kv_offset(self) -> int:
        seg = self._segment("kv")
        return self.body_offset + (seg.offset if seg else self.payload_len - self.body_offset)

    @property
    def kv_hash(self) -> str:
        seg = self._segment("kv")
        return seg.hash if seg else ""


# ---- validation ------------------------------------------------------------------------------


def _check_prefix(hdr_len: int, payload_len: int) -> None:
    if payload_len < PREFIX_LEN:
        raise _bad("v3.short_payload", f"payload_len {payload_len} < {PREFIX_LEN}")
    if hdr_len > HYDRA_MAX_JSON_HEADER:
        raise _bad("v3.hdr_len", f"hdr_len {hdr_len} > {HYDRA_MAX_JSON_HEADER}")
    # The C++ would just read past the payload here (a short read → ERROR, or a desync). We
    # know payload_len, so we can refuse before reading.
    if PREFIX_LEN + hdr_len > payload_len:
        raise _bad("v3.hdr_overrun", f"hdr_len {hdr_len} runs past payload_len {payload_len}")


def parse_decode_v3_prefix(first_bytes: Buffer, payload_len: int | None = None) -> tuple[int, int]:
    """``(hdr_len, hdr_hash)`` from the first 12 bytes; payload_len defaults to len(first_bytes)."""
    if payload_len is None:
        payload_len = len(first_bytes)
    if payload_len < PREFIX_LEN:
        raise _bad("v3.short_payload", f"payload_len {payload_len} < {PREFIX_LEN}")
    if len(first_bytes) < PREFIX_LEN:
        raise Truncated(f"need {PREFIX_LEN} bytes, have {len(first_bytes)}", rule="v3.prefix_short")
    hdr_len, hdr_hash = _PREFIX.unpack_from(first_bytes, 0)
    _check_prefix(hdr_len, payload_len)
    return hdr_len, hdr_hash


def parse_decode_v3_prefix_construct(first_bytes: Buffer, payload_len: int | None = None) -> tuple[int, int]:
    """:func:`parse_decode_v3_prefix` through the construct layout (differential twin)."""
    if payload_len is None:
        payload_len = len(first_bytes)
    if payload_len < PREFIX_LEN:
        raise _bad("v3.short_payload", f"payload_len {payload_len} < {PREFIX_LEN}")
    try:
        c = DECODE_V3_PREFIX.parse(bytes(first_bytes))
    except ConstructError as e:
        raise Truncated(f"prefix: {e}", rule="v3.prefix_short") from None
    _check_prefix(c.hdr_len, payload_len)
    return c.hdr_len, c.hdr_hash


def _parse_segments(raw: list[Any]) -> tuple[Segment, ...]:
    segments: list[Segment] = []
    running = 0
    for i, seg in enumerate(raw):
        if not isinstance(seg, dict) or any(k not in seg for k in _SEGMENT_FIELDS):
            raise _bad("v3.segment_fields", f"segment {i} lacks one of {_SEGMENT_FIELDS}")
        sid, off, ln, h = seg["id"], seg["offset"], seg["len"], seg["hash"]
        if not (isinstance(sid, str) and _is_int(off) and _is_int(ln) and ln >= 0 and isinstance(h, str)):
            raise _bad("v3.segment_fields", f"segment {i} has a field of the wrong type")
        if off != running:
            raise _bad("v3.segment_offset", f"segment {i} offset {off} != running sum {running}")
        # Duplicates: the C++ lets the last one win; we refuse them (no client sends them and
        # the skipped bytes would be ambiguous).
        if sid not in SEGMENT_IDS or any(s.id == sid for s in segments):
            raise _bad("v3.segment_id", f"segment {i} id {sid[:40]!r} is not a new 'prompt'/'kv'")
        segments.append(Segment(sid, off, ln, h))
        running += ln
    return tuple(segments)


def validate_decode_v3(hdr_len: int, hdr_hash: int, hdr_bytes: Buffer, payload_len: int) -> DecodeV3Header:
    """Apply every docs/protocol.md §8 rule that needs only the control header, in the C++ order."""
    _check_prefix(hdr_len, payload_len)
    if len(hdr_bytes) != hdr_len:
        raise Truncated(f"control header: got {len(hdr_bytes)} of {hdr_len} bytes", rule="v3.hdr_short")
    if xxh3_64(hdr_bytes) != hdr_hash:
        raise _bad("v3.hdr_hash", "control header hash mismatch")
    header = loads_json(hdr_bytes, "v3.hdr_json")
    if not isinstance(header, dict):
        raise _bad("v3.hdr_json", "control header is not a JSON object")
    v = header.get("v", 0)  # missing counts as 0
    if not _is_int(v) or v < DECODE_HDR_VERSION:
        raise _bad("v3.version", f"v {v!r} < {DECODE_HDR_VERSION}"[:100])
    if not isinstance(header.get("kv_metadata"), dict):
        raise _bad("v3.kv_metadata", "kv_metadata missing or not an object")
    raw_segments = header.get("segments")
    if not isinstance(raw_segments, list):
        raise _bad("v3.segments_type", "segments missing or not an array")
    if len(raw_segments) > MAX_SEGMENTS:
        raise _bad("v3.segments_count", f"{len(raw_segments)} segments > {MAX_SEGMENTS}")
    segments = _parse_segments(raw_segments)
    body = payload_len - PREFIX_LEN - hdr_len
    total = sum(s.len for s in segments)
    if total != body:
        raise _bad("v3.segment_sum", f"segments sum to {total}, payload has {body}")
    out = DecodeV3Header(hdr_len, hdr_hash, payload_len, header, segments)
    if out.prompt_len > HYDRA_MAX_PROMPT_BYTES:
        raise _bad("v3.prompt_len", f"prompt_len {out.prompt_len} > {HYDRA_MAX_PROMPT_BYTES}")
    if out.kv_len > HYDRA_MAX_STATE_BYTES:
        raise _bad("v3.kv_len", f"kv_len {out.kv_len} > {HYDRA_MAX_STATE_BYTES}")
    if out.kv_hash:
        parse_hash_str(out.kv_hash, rule="v3.kv_hash_format")
    return out


# ---- kv segment (NEW's checks on the blob header, before the state is streamed) --------------

_KV_RULES = {
    "kv.short": "v3.kv_short",
    "kv.tokens": "v3.kv_tokens",
    "kv.checkpoint": "v3.kv_checkpoint",
    "kv.stream": "v3.kv_stream",
}


def _remap(e: CodecError) -> CodecError:
    rule = _KV_RULES.get(e.rule)
    return MalformedPayload(str(e), rule=rule) if rule else e


def kv_segment_need(kv_prefix: Buffer, kv_len: int) -> int:
    """Bytes of the kv segment to buffer before :func:`validate_kv_segment` can decide.

    0 for an empty segment; 1 until the version byte is known; for a legacy (v1) blob just 1
    (NEW checks only v2/v3 headers); for v2/v3 the header length (see ``kv_header_need``).
    Raises the v3.kv_* rules as soon as a claim exceeds kv_len.
    """
    if kv_len == 0:
        return 0
    if len(kv_prefix) < 1 or blob_version(kv_prefix[0]) == 1:
        return 1
    try:
        return kv_header_need(kv_prefix, kv_len)
    except CodecError as e:
        raise _remap(e) from None


def validate_kv_segment(kv_prefix: Buffer, kv_len: int) -> tuple[KvBlobHeader, int] | None:
    """NEW's kv-blob checks: v2/v3 blob with kv_len < 9 (v3.kv_short), token list beyond kv_len
    (v3.kv_tokens), checkpoint beyond kv_len (v3.kv_checkpoint), < 8 bytes left for the
    ``[magic][seq_id]`` stream (v3.kv_stream). Returns ``(header, header_len)`` for v2/v3, None
    for an empty or legacy segment. ``kv_prefix`` must hold :func:`kv_segment_need` bytes.
    """
    need = kv_segment_need(kv_prefix, kv_len)
    if need > len(kv_prefix):
        raise Truncated(f"kv check needs {need} bytes, have {len(kv_prefix)}", rule="v3.kv_incomplete")
    if need == 0 or blob_version(kv_prefix[0]) == 1:
        return None
    try:
        header, header_len = parse_kv_blob_header(kv_prefix, total_len=kv_len)
    except CodecError as e:
        raise _remap(e) from None
    if kv_len - header_len < STATE_STREAM_PREFIX_LEN:
        raise _bad("v3.kv_stream", f"{kv_len - header_len} bytes left for the state stream < 8")
    return header, header_len


def verify_segment_hash(expected: str, data: Buffer | int | Xxh3Stream, *, rule: str = "v3.kv_hash") -> bool:
    """Check a segment's ``"xxh3:…"`` hash against its bytes, a digest, or a finished stream.

    ``""`` means "no hash sent" → returns False (nothing checked). Mismatch → MalformedPayload.
    """
    if expected == "":
        return False
    want = parse_hash_str(expected, rule="v3.kv_hash_format")
    if isinstance(data, Xxh3Stream):
        got = data.intdigest()
    elif _is_int(data):
        got = data
    else:
        got = xxh3_64(data)
    if got != want:
        raise _bad(rule, f"segment hash {kv_hash_str(got)} != {expected}")
    return True


def parse_prompt_segment(data: Buffer, generation: Any = None) -> dict[str, Any]:
    """Prompt segment → completion request object.

    A bare array (what C# sends) becomes ``{"messages": [...]}``; ``generation`` keys are merged
    where absent. Parse failure → "v3.prompt_json". A scalar prompt or a non-object generation
    cannot be merged → "v3.prompt_build" (the C++ answers BAD_REQUEST with meta
    ``{"error":"prompt build failed: …","decode_request_id":-1}``).
    """
    obj = loads_json(data, "v3.prompt_json")
    if isinstance(obj, list):
        obj = {"messages": obj}
    elif not isinstance(obj, dict):
        raise _bad("v3.prompt_build", f"prompt is a JSON {type(obj).__name__}, not an object or array")
    if generation is not None:
        if not isinstance(generation, dict):
            raise _bad("v3.prompt_build", "generation is not an object")
        for key, value in generation.items():
            obj.setdefault(key, value)
    return obj


def parse_decode_v3(payload: Buffer, *, verify_kv_hash: bool = True) -> tuple[DecodeV3Header, memoryview, memoryview]:
    """Whole-buffer convenience (inspector, tests): header + prompt and kv views, all checks."""
    hdr_len, hdr_hash = parse_decode_v3_prefix(payload)
    mv = memoryview(payload)
    hdr = validate_decode_v3(hdr_len, hdr_hash, mv[PREFIX_LEN : PREFIX_LEN + hdr_len], len(payload))
    prompt = mv[hdr.prompt_offset : hdr.prompt_offset + hdr.prompt_len]
    kv = mv[hdr.kv_offset : hdr.kv_offset + hdr.kv_len]
    validate_kv_segment(kv, hdr.kv_len)
    if verify_kv_hash:
        verify_segment_hash(hdr.kv_hash, kv)
    return hdr, prompt, kv


# ---- encoder (as HV-IDX RpcClient.EngineMergedDecodeAsync builds it) -------------------------

def _identity(n_past: int | None = None) -> dict[str, Any]:
    md: dict[str, Any] = {} if n_past is None else {"n_past": n_past}
    md.update(tokenizer="", model_name="", model_quant="", model_capabilities=0)
    return md


def build_control_header(
    prompt: Buffer,
    kv: Buffer | int = b"",
    *,
    model: str = "",
    kv_metadata: dict[str, Any] | None = None,
    model_metadata: dict[str, Any] | None = None,
    generation: dict[str, Any] | None = None,
    kv_hash: str | None = None,
) -> dict[str, Any]:
    """The control header dict, keys in the C# order (v, model, kv_metadata, model_metadata,
    generation, segments). ``kv`` may be the length of a kv segment streamed later, with its
    ``kv_hash`` (e.g. PREFILL's ``kv_hash_str``) or ``""``. Defaults are empty values of the
    C# shape, not meaningful settings.
    """
    kv_len = kv if _is_int(kv) else len(kv)
    if kv_hash is None:
        kv_hash = "" if kv_len == 0 or _is_int(kv) else kv_hash_str(kv)
    if generation is None:
        generation = {"n_predict": -1, "sampling": {}, "stop": [], "stream": False, "chat_syntax": "", "oaicompat_model": model}
    return {
        "v": DECODE_HDR_VERSION,
        "model": model,
        "kv_metadata": _identity(0) if kv_metadata is None else kv_metadata,
        "model_metadata": _identity() if model_metadata is None else model_metadata,
        "generation": generation,
        "segments": [
            {"id": "prompt", "offset": 0, "len": len(prompt), "hash": kv_hash_str(prompt)},
            {"id": "kv", "offset": len(prompt), "len": kv_len, "hash": kv_hash},
        ],
    }


def encode_decode_v3_frame(hdr_bytes: Buffer, *segments: Buffer, hdr_hash: int | None = None) -> bytes:
    """Raw framing: prefix + header bytes + segments (a wrong ``hdr_hash`` is for fuzzing).

    With no segments this is the head a streaming client sends before prompt and kv.
    """
    if len(hdr_bytes) > 0xFFFFFFFF:
        raise LocalProtocolError("control header longer than u32", rule="v3.hdr_len")
    digest = xxh3_64(hdr_bytes) if hdr_hash is None else hdr_hash
    return b"".join((_PREFIX.pack(len(hdr_bytes), digest), bytes(hdr_bytes), *map(bytes, segments)))


def encode_decode_v3(hdr: dict[str, Any], prompt: Buffer, kv: Buffer = b"") -> bytes:
    """A complete DECODE v3 payload.

    ``hdr`` with ``segments`` is sent verbatim (lets a fuzzer lie); otherwise it holds any of
    model / kv_metadata / model_metadata / generation (and extra keys, kept) and the header is
    completed by :func:`build_control_header`.
    """
    if "segments" not in hdr:
        known = ("model", "kv_metadata", "model_metadata", "generation", "kv_hash")
        full = build_control_header(prompt, kv, **{k: hdr[k] for k in known if k in hdr})
        for key, value in hdr.items():
            if key != "kv_hash":
                full[key] = value
        hdr = full
    return encode_decode_v3_frame(dumps_compact(hdr, rule="v3.encode"), prompt, kv)
