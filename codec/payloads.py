"""Engine request/response payloads of every dialect, except DECODE v3 and KV blobs.

docs/protocol.md §6 (opcodes), §9–§10 (DECODE streaming). Dialects: E1 raw-token PREFILL/DECODE, J17/PIN
JSON DECODE with PIN's ``[u32 len][piece]`` stream, the spec's 9-byte token frames (only ever in
the spec and C# fakes), and the NEW JSON bodies. Also the strict JSON helpers every codec
module shares, and the engine's size caps from ``server-rpc.h``. Which dialect a payload
speaks is decided in :mod:`codec.dialects`.
"""
from __future__ import annotations

import re
import struct
import sys
from array import array
from dataclasses import dataclass
from typing import Any

from construct import (
    Bytes,
    ConstructError,
    Float32l,
    GreedyBytes,
    GreedyRange,
    Int8ul,
    Int16ul,
    Int32sl,
    Int32ul,
    Struct,
    Terminated,
    this,
)

from .errors import FrameTooLarge, LocalProtocolError, MalformedPayload, Truncated
from .json_text import Buffer, dumps_compact, loads_json, parse_json_object

# ---- engine caps (tools/server/server-rpc.h) -------------------------------------------------
HYDRA_MAX_STATE_BYTES = 4 * 1024**3  # STATE_PUT payload, DECODE kv segment
HYDRA_MAX_JSON_HEADER = 32 * 1024  # DECODE v3 control header
HYDRA_MAX_PROMPT_BYTES = 64 * 1024**2  # DECODE v3 prompt segment
MAX_META_LEN = 0xFFFFFF  # u24 meta_len in the response header


# ---- meta ----------------------------------------------------------------------------------


def encode_meta(meta: dict[str, Any] | None) -> bytes:
    """Response meta bytes; ``None`` → ``b""`` (meta_len 0 = no meta)."""
    if meta is None:
        return b""
    if not isinstance(meta, dict):
        raise LocalProtocolError("meta must be a dict", rule="meta.type")
    data = dumps_compact(meta, rule="meta.encode")
    if len(data) > MAX_META_LEN:
        raise LocalProtocolError(f"meta of {len(data)} bytes exceeds u24", rule="meta.too_long")
    return data


def decode_meta(data: Buffer) -> dict[str, Any] | None:
    """Response meta → dict; empty → None (what every client does with meta_len 0)."""
    if len(data) == 0:
        return None
    obj = loads_json(data, "meta.json")
    if not isinstance(obj, dict):
        raise MalformedPayload("meta is not a JSON object", rule="meta.not_object")
    return obj


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ---- E1 raw tokens (PREFILL: [i32…], DECODE: [i32 n_predict][i32…]) ------------------------

E1_TOKENS = Struct("tokens" / GreedyRange(Int32sl), Terminated)
E1_DECODE = Struct("n_predict" / Int32sl, "tokens" / GreedyRange(Int32sl), Terminated)
_I32 = struct.Struct("<i")
_BIG_ENDIAN = sys.byteorder == "big"


def _pack_i32s(values: Any, rule: str) -> bytes:
    try:
        arr = array("i", values)
    except (OverflowError, TypeError) as e:
        raise LocalProtocolError(f"not an i32: {e}", rule=rule) from None
    if _BIG_ENDIAN:  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def _unpack_i32s(data: Buffer) -> list[int]:
    arr = array("i")
    arr.frombytes(data)
    if _BIG_ENDIAN:  # pragma: no cover
        arr.byteswap()
    return arr.tolist()


def encode_e1_tokens(tokens: Any) -> bytes:
    """E1 PREFILL payload: little-endian i32 token ids."""
    return _pack_i32s(tokens, "e1.tokens")


def decode_e1_tokens(payload: Buffer) -> list[int]:
    """E1 PREFILL payload → token ids; ``len % 4 != 0`` → MalformedPayload (E1 answered ERROR)."""
    if len(payload) % 4:
        raise MalformedPayload(f"{len(payload)} bytes is not a whole number of i32 tokens", rule="e1.tokens_len")
    return _unpack_i32s(payload)


def encode_e1_decode(n_predict: int, tokens: Any = ()) -> bytes:
    return _pack_i32s([n_predict], "e1.n_predict") + _pack_i32s(tokens, "e1.tokens")


def decode_e1_decode(payload: Buffer) -> tuple[int, list[int]]:
    """E1/A5 DECODE payload ``[i32 n_predict][i32 tokens…]`` → (n_predict, tokens)."""
    if len(payload) < 4:
        raise Truncated("E1 DECODE needs at least n_predict", rule="e1.decode_short")
    if len(payload) % 4:
        raise MalformedPayload(f"{len(payload)} bytes is not a whole number of i32", rule="e1.tokens_len")
    return _I32.unpack_from(payload, 0)[0], _unpack_i32s(memoryview(payload)[4:])


def decode_e1_tokens_construct(payload: Buffer) -> list[int]:
    try:
        return list(E1_TOKENS.parse(bytes(payload)).tokens)
    except ConstructError as e:
        raise MalformedPayload(f"E1 tokens: {e}", rule="e1.construct") from None


def decode_e1_decode_construct(payload: Buffer) -> tuple[int, list[int]]:
    try:
        c = E1_DECODE.parse(bytes(payload))
    except ConstructError as e:
        raise MalformedPayload(f"E1 DECODE: {e}", rule="e1.construct") from None
    return c.n_predict, list(c.tokens)


# ---- J17 / PIN JSON DECODE body --------------------------------------------------------------

_I32_MAX = 2**31 - 1


@dataclass(frozen=True, slots=True)
class JsonDecodeRequest:
    n_predict: int
    messages: list[Any] | None
    stream: bool | None
    body: dict[str, Any]  # the whole object, for fields this codec does not interpret


def parse_json_decode(payload: Buffer) -> JsonDecodeRequest:
    """J17/PIN DECODE ``{"n_predict":N,"messages":[…]|null,"stream"?}``.

    n_predict is required, an integer in [0, 2**31-1] (PIN: missing → -1 → ERROR). We refuse
    floats and bools although nlohmann would coerce them: no real client sends them.
    """
    body = parse_json_object(payload, "decode.json")
    n_predict = body.get("n_predict")
    if not _is_int(n_predict) or not 0 <= n_predict <= _I32_MAX:
        raise MalformedPayload(f"n_predict must be an int >= 0, got {n_predict!r}"[:200], rule="decode.n_predict")
    messages = body.get("messages")
    if messages is not None and not isinstance(messages, list):
        raise MalformedPayload("messages must be an array or null", rule="decode.messages")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise MalformedPayload("stream must be a bool", rule="decode.stream")
    return JsonDecodeRequest(n_predict, messages, stream, body)


def encode_json_decode(n_predict: int, messages: list[Any] | None = None, *, stream: bool | None = None, **extra: Any) -> bytes:
    body: dict[str, Any] = {"n_predict": n_predict, "messages": messages}
    if stream is not None:
        body["stream"] = stream
    body.update(extra)
    return dumps_compact(body)


# ---- PIN stream pieces: [u32 LE len][UTF-8 piece] until EOF --------------------------------

PIECE_HEAD = Struct("len" / Int32ul)
PIECE = Struct("len" / Int32ul, "piece" / Bytes(this.len))
DEFAULT_MAX_PIECE = 1 << 20  # a detokenized piece is a few bytes; anything near this is garbage
_U32 = struct.Struct("<I")


def encode_piece(piece: bytes | str) -> bytes:
    """One PIN frame. (A frame should go out in one write: the C# reader needs it whole.)"""
    data = piece.encode() if isinstance(piece, str) else bytes(piece)
    if len(data) > 0xFFFFFFFF:
        raise LocalProtocolError("piece longer than u32", rule="pin.piece_len")
    return _U32.pack(len(data)) + data


class PieceStreamDecoder:
    """Incremental decoder of PIN's ``[u32 len][piece]`` frames (zero-length pieces included).

    The stream has no terminator (the engine just stops; clients read until EOF), so call
    :meth:`eof` when the connection ends to learn whether it stopped mid-frame.
    """

    def __init__(self, max_piece: int = DEFAULT_MAX_PIECE) -> None:
        self.max_piece = max_piece
        self._buf = bytearray()
        self._error: Exception | None = None

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def feed(self, data: Buffer) -> list[bytes]:
        if self._error is not None:
            raise self._error
        buf = self._buf
        buf += data
        out: list[bytes] = []
        pos, end = 0, len(buf)
        while end - pos >= 4:
            n = _U32.unpack_from(buf, pos)[0]
            if n > self.max_piece:
                err = FrameTooLarge(f"piece of {n} bytes > {self.max_piece}", rule="pin.piece_len")
                err.recoverable = False  # we will not read it, so the stream is lost
                self._error = err
                raise err
            if end - pos - 4 < n:
                break
            out.append(bytes(buf[pos + 4 : pos + 4 + n]))
            pos += 4 + n
        del buf[:pos]
        return out

    def eof(self) -> None:
        if self._buf:
            raise Truncated(f"stream ended inside a frame ({len(self._buf)} bytes left)", rule="pin.piece_truncated")


# ---- spec token frames: [u32 token_id][f32 logprob][u8 flags] --------------------------------

TOKEN_FRAME = Struct("token_id" / Int32ul, "logprob" / Float32l, "flags" / Int8ul)
TOKEN_FRAMES = Struct("frames" / GreedyRange(TOKEN_FRAME), Terminated)
TOKEN_FLAG_FINAL = 0x01
_TOKEN_FRAME = struct.Struct("<IfB")


@dataclass(frozen=True, slots=True)
class TokenFrame:
    token_id: int
    logprob: float
    flags: int = 0

    @property
    def final(self) -> bool:
        return bool(self.flags & TOKEN_FLAG_FINAL)


def encode_token_frame(token_id: int, logprob: float, *, final: bool = False, flags: int | None = None) -> bytes:
    if flags is None:
        flags = TOKEN_FLAG_FINAL if final else 0
    try:
        return _TOKEN_FRAME.pack(token_id, logprob, flags)
    except (struct.error, OverflowError) as e:
        raise LocalProtocolError(f"token frame field out of range: {e}", rule="spec.token_frame") from None


def decode_token_frames(payload: Buffer) -> list[TokenFrame]:
    if len(payload) % _TOKEN_FRAME.size:
        raise MalformedPayload(f"{len(payload)} bytes is not a whole number of 9-byte frames", rule="spec.frames_len")
    return [TokenFrame(*f) for f in _TOKEN_FRAME.iter_unpack(payload)]


def decode_token_frames_construct(payload: Buffer) -> list[TokenFrame]:
    try:
        frames = TOKEN_FRAMES.parse(bytes(payload)).frames
    except ConstructError as e:
        raise MalformedPayload(f"token frames: {e}", rule="spec.construct") from None
    return [TokenFrame(f.token_id, f.logprob, f.flags) for f in frames]


# ---- SET_EXPERT_MODE: raw "solo"/"combined", or (NEW/WS) JSON {"mode", "peer"} -------------

EXPERT_MODES = ("solo", "combined")


@dataclass(frozen=True, slots=True)
class ExpertModeRequest:
    mode: str
    peer: str | None = None
    json_form: bool = False


_NON_WS = re.compile(rb"[^ \t\r\n]")  # JSON whitespace


def _first_non_ws(payload: Buffer) -> int | None:
    m = _NON_WS.search(payload)
    return None if m is None else m.group()[0]


def parse_expert_mode(payload: Buffer) -> ExpertModeRequest:
    """Exact, case-sensitive match like the C++ (no trimming of the raw form)."""
    if _first_non_ws(payload) == ord("{"):
        obj = parse_json_object(payload, "expert_mode.json")
        mode, peer = obj.get("mode"), obj.get("peer")
        if peer is not None and not isinstance(peer, str):
            raise MalformedPayload("peer must be a string", rule="expert_mode.peer")
        json_form = True
    else:
        try:
            mode = bytes(payload).decode("utf-8")
        except UnicodeDecodeError:
            mode = None
        peer, json_form = None, False
    if mode not in EXPERT_MODES:
        raise MalformedPayload("expert_mode must be 'solo' or 'combined'", rule="expert_mode.mode")
    return ExpertModeRequest(mode, peer, json_form)


def encode_expert_mode(mode: str, peer: str | None = None, *, json_form: bool = False) -> bytes:
    if mode not in EXPERT_MODES:
        raise LocalProtocolError(f"unknown expert mode {mode!r}", rule="expert_mode.mode")
    if not json_form and peer is None:
        return mode.encode()
    obj: dict[str, Any] = {"mode": mode}
    if peer is not None:
        obj["peer"] = peer
    return dumps_compact(obj)


# ---- SWAP_QUANT: [u16 LE qk_len][qk UTF-8][tensor_pattern UTF-8 = rest] ----------------------

SWAP_QUANT = Struct("qk_len" / Int16ul, "qk" / Bytes(this.qk_len), "pattern" / GreedyBytes)
_U16 = struct.Struct("<H")


@dataclass(frozen=True, slots=True)
class SwapQuantRequest:
    qk: str
    pattern: str


def _utf8(data: Buffer, rule: str) -> str:
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedPayload("not UTF-8", rule=rule) from None


def parse_swap_quant(payload: Buffer) -> SwapQuantRequest:
    if len(payload) < 2:
        raise Truncated("SWAP_QUANT payload shorter than qk_len", rule="swap_quant.short")
    qk_len = _U16.unpack_from(payload, 0)[0]
    if qk_len > len(payload) - 2:
        raise MalformedPayload(f"qk_len {qk_len} > {len(payload) - 2} bytes left", rule="swap_quant.qk_len")
    mv = memoryview(payload)
    return SwapQuantRequest(_utf8(mv[2 : 2 + qk_len], "swap_quant.utf8"), _utf8(mv[2 + qk_len :], "swap_quant.utf8"))


def parse_swap_quant_construct(payload: Buffer) -> SwapQuantRequest:
    try:
        c = SWAP_QUANT.parse(bytes(payload))
    except ConstructError as e:
        raise MalformedPayload(f"SWAP_QUANT: {e}", rule="swap_quant.construct") from None
    return SwapQuantRequest(_utf8(c.qk, "swap_quant.utf8"), _utf8(c.pattern, "swap_quant.utf8"))


def encode_swap_quant(qk: str, pattern: str = "") -> bytes:
    qk_b = qk.encode()
    if len(qk_b) > 0xFFFF:
        raise LocalProtocolError("qk longer than 65535 bytes", rule="swap_quant.qk_len")
    return _U16.pack(len(qk_b)) + qk_b + pattern.encode()


# ---- JSON bodies: CONFIGURE, PREFILL, PIPELINE_ATTACH ----------------------------------------


def parse_configure(payload: Buffer) -> dict[str, Any]:
    """CONFIGURE: a JSON object; an empty payload means ``{}`` (docs/protocol.md §6.5)."""
    return parse_json_object(payload, "configure.json", allow_empty=True)


def parse_prefill_json(payload: Buffer) -> dict[str, Any]:
    """J17+ PREFILL chat body. Empty → error (the C++ answers ERROR for payload_len 0)."""
    body = parse_json_object(payload, "prefill.json")
    # null means "the loaded model" / "no configuration" (C# clients send null for an unset field)
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise MalformedPayload("model must be a string or null", rule="prefill.model")
    if body.get("hydra_config") is not None and not isinstance(body["hydra_config"], dict):
        raise MalformedPayload("hydra_config must be an object", rule="prefill.hydra_config")
    return body


def parse_pipeline_attach(payload: Buffer) -> dict[str, Any]:
    """``{"peer":"host:port","ot_split":"<regex>"}`` — read but unused by every engine."""
    body = parse_json_object(payload, "pipeline_attach.json", allow_empty=True)
    for key in ("peer", "ot_split"):
        if key in body and not isinstance(body[key], str):
            raise MalformedPayload(f"{key} must be a string", rule="pipeline_attach.fields")
    return body


def encode_pipeline_attach(peer: str, ot_split: str = "") -> bytes:
    return dumps_compact({"peer": peer, "ot_split": ot_split})
