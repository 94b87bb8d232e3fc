"""``--codec``: fuzz the codec's decoders in-process, no target.

Every decoder gets random and mutated-valid bytes. Two oracles:

* codec-error — garbage may only ever raise a ``CodecError`` (codec/errors.py promises it);
* codec-diff  — differential (atheris' json_differential_fuzzer idea): the precompiled
  ``struct`` path and the declarative ``construct`` path must agree (both accept with equal
  results, or both refuse), and an incremental decoder must produce the same events whether
  it is fed the bytes at once or in pieces.

A case is (decoder name, input bytes), addressable by (seed, index) like any other.
"""
from __future__ import annotations

import hashlib
import math
import random
import struct
from typing import Any, Callable

from construct import ConstructError

from codec import decode_v3 as V3
from codec import dialects as D
from codec import ggml as G
from codec import kvblob as KV
from codec import payloads as P
from codec import store as S
from codec.decoder import PayloadChunk, RequestDecoder, ResponseDecoder
from codec.errors import BadMagic, CodecError, FrameTooLarge, Truncated
from codec.framing import (MAGIC, REQUEST_HEADER, RESPONSE_HEADER, RequestHeader, ResponseHeader,
                           decode_request_header, decode_response_header, encode_response)
from codec.limits import Limits

from .cases import Case, Message, Outcome
from .schedule import rng_for
from .templates import build_templates


class CodecFinding(Exception):
    def __init__(self, oracle: str, detail: str):
        super().__init__(detail)
        self.oracle = oracle


def _call(fn: Callable, *args: Any, **kw: Any) -> tuple[str, Any]:
    """("ok", result) or ("err", rule). Anything that is not a CodecError is a finding."""
    try:
        return "ok", fn(*args, **kw)
    except CodecError as e:
        return "err", e.rule
    except Exception as e:  # noqa: BLE001 - that is exactly what this oracle looks for
        raise CodecFinding("codec-error", f"{getattr(fn, '__name__', fn)} raised {type(e).__name__}: {e}"[:400])


def _diff(name: str, a: tuple[str, Any], b: tuple[str, Any], norm: Callable[[Any], Any] = lambda x: x) -> None:
    if a[0] != b[0]:
        raise CodecFinding("codec-diff", f"{name}: struct path {a[0]} ({_short(a[1])}), construct path {b[0]} "
                                         f"({_short(b[1])})")
    if a[0] == "ok" and norm(a[1]) != norm(b[1]):
        raise CodecFinding("codec-diff", f"{name}: results differ: {_short(a[1])} vs {_short(b[1])}")


def _short(x: Any) -> str:
    return repr(x)[:160]


def _floats_as_bits(x: Any) -> Any:
    """NaN != NaN: compare floats by their bits."""
    if isinstance(x, float):
        return struct.pack("<f", x) if not math.isnan(x) else b"nan"
    if isinstance(x, (list, tuple)):
        return [_floats_as_bits(v) for v in x]
    if hasattr(x, "__dataclass_fields__"):
        return {k: _floats_as_bits(getattr(x, k)) for k in x.__dataclass_fields__}
    return x


# ---------------------------------------------------------------------------------- construct twins


def _req_header_construct(b: bytes) -> RequestHeader:
    if len(b) < 16:
        raise Truncated("short", rule="hdr.short")
    try:
        c = REQUEST_HEADER.parse(b[:16])
    except ConstructError as e:
        raise Truncated(str(e), rule="hdr.construct") from None
    if c.magic != MAGIC:
        raise BadMagic("magic", rule="hdr.magic")
    return RequestHeader(c.op, c.flags, c.key_len, c.payload_len, c.trace_len, c.magic)


def _resp_header_construct(b: bytes) -> ResponseHeader:
    if len(b) < 12:
        raise Truncated("short", rule="resp.short")
    c = RESPONSE_HEADER.parse(b[:12])
    return ResponseHeader(c.status, c.meta_len, c.payload_len)


def _splits(data: bytes) -> list[bytes]:
    """The same bytes in pieces whose sizes depend only on the bytes (deterministic)."""
    rng = random.Random(hashlib.sha256(data).digest())
    out, pos = [], 0
    while pos < len(data):
        n = rng.choice((1, 1, 2, 3, 7, 16, 64))
        out.append(data[pos:pos + n])
        pos += n
    return out


def _events(dec, pieces: list[bytes]) -> list[Any]:
    """Feed, collect events (consecutive payload chunks merged), errors as ("error", rule)."""
    out: list[Any] = []
    for piece in pieces:
        dec.feed(piece)
        while True:
            try:
                ev = dec.next_event()
            except BadMagic as e:
                out.append(("error", e.rule))
                return out
            except FrameTooLarge as e:
                out.append(("error", e.rule))
                if not e.recoverable:  # more than max_drain left to skip: the stream is given up
                    return out
                continue
            except CodecError as e:
                out.append(("error", e.rule))
                return out
            except Exception as e:  # noqa: BLE001
                raise CodecFinding("codec-error", f"{type(dec).__name__} raised {type(e).__name__}: {e}"[:400])
            if repr(ev) == "NEED_DATA":
                break
            if isinstance(ev, PayloadChunk) and out and isinstance(out[-1], PayloadChunk):
                out[-1] = PayloadChunk(out[-1].data + ev.data)
            else:
                out.append(ev)
    return out


SMALL_LIMITS = Limits(max_key_len=64, max_trace_len=64, max_payload={0x41: 0, 0x42: 512, 0x43: 1 << 12},
                      default_max_payload=256, buffer_threshold=48, max_meta_len=128)


def _ggml_events(make, data: bytes, pieces: list[bytes]) -> None:
    def collect(parts):
        dec, out = make(), []
        try:
            for p in parts:
                out.extend(dec.feed(p))
            dec.eof()
            out.append("eof")
        except CodecError as e:
            out.append(("error", e.rule))
        merged: list[Any] = []
        for ev in out:
            if isinstance(ev, G.PayloadChunk) and merged and isinstance(merged[-1], G.PayloadChunk):
                merged[-1] = G.PayloadChunk(merged[-1].data + ev.data)
            else:
                merged.append(ev)
        return merged

    try:
        a, b = collect([data]), collect(pieces)
    except CodecError:
        return
    except Exception as e:  # noqa: BLE001
        raise CodecFinding("codec-error", f"ggml decoder raised {type(e).__name__}: {e}"[:400])
    if a != b:
        raise CodecFinding("codec-diff", f"ggml decoder: whole {_short(a)} vs split {_short(b)}")


# ---------------------------------------------------------------------------------- the checks


def _check(name: str, data: bytes) -> None:
    """Run decoder ``name``'s oracles on ``data``: CodecFinding on a finding, KeyError for an unknown name."""
    area = name.partition(".")[0]
    if area in ("framing", "decoder"):
        _check_frames(name, data)
    elif area in ("kvblob", "payloads", "decode_v3", "store"):
        _check_payloads(name, data)
    elif area == "ggml":
        _check_ggml(name, data)
    else:
        raise KeyError(name)


def _check_frames(name: str, data: bytes) -> None:
    """Frame headers and the incremental frame decoders."""
    if name == "framing.request_header":
        _diff(name, _call(decode_request_header, data), _call(_req_header_construct, data))
    elif name == "framing.response_header":
        _diff(name, _call(decode_response_header, data), _call(_resp_header_construct, data))
    elif name == "decoder.request_stream":
        a, b = _events(RequestDecoder(SMALL_LIMITS), [data]), _events(RequestDecoder(SMALL_LIMITS), _splits(data))
        if a != b:
            raise CodecFinding("codec-diff", f"RequestDecoder: whole {_short(a)} vs split {_short(b)}")
    elif name == "decoder.response_stream":
        a, b = _events(ResponseDecoder(SMALL_LIMITS), [data]), _events(ResponseDecoder(SMALL_LIMITS), _splits(data))
        if a != b:
            raise CodecFinding("codec-diff", f"ResponseDecoder: whole {_short(a)} vs split {_short(b)}")
    else:
        raise KeyError(name)


def _check_payloads(name: str, data: bytes) -> None:
    """Payload parsers: KV blobs, the dialects' bodies, DECODE v3 and the Store's."""
    if name == "kvblob.header":
        _diff(name, _call(KV.parse_kv_blob_header, data), _call(KV.parse_kv_blob_header_construct, data))
    elif name == "kvblob.parse":
        _call(KV.parse_kv_blob, data)
        _call(KV.parse_kv_blob, data, n_vocab=4, has_logits=None, state_size=8)
        _call(KV.parse_kv_blob, data, n_vocab=2, has_logits=True, min_state=8)
        _call(KV.kv_header_need, data[: len(data) // 2], len(data))
    elif name == "payloads.e1":
        _diff("e1_tokens", _call(P.decode_e1_tokens, data), _call(P.decode_e1_tokens_construct, data))
        _diff("e1_decode", _call(P.decode_e1_decode, data), _call(P.decode_e1_decode_construct, data))
    elif name == "payloads.token_frames":
        _diff(name, _call(P.decode_token_frames, data), _call(P.decode_token_frames_construct, data), _floats_as_bits)
    elif name == "payloads.swap_quant":
        _diff(name, _call(P.parse_swap_quant, data), _call(P.parse_swap_quant_construct, data))
    elif name == "payloads.pieces":
        def pieces(parts):
            d = P.PieceStreamDecoder(max_piece=4096)
            out = []
            for p in parts:
                out += d.feed(p)
            d.eof()
            return out
        _diff(name, _call(pieces, [data]), _call(pieces, _splits(data)))
    elif name == "payloads.json":
        for fn in (P.parse_configure, P.parse_prefill_json, P.parse_json_decode, P.parse_expert_mode,
                   P.parse_pipeline_attach, P.decode_meta, D.prefill_dialect, D.decode_dialect,
                   D.looks_like_decode_v3_prefix, S.parse_manifest, S.parse_list_payload, S.parse_hash_list,
                   S.parse_missing_hashes, S.parse_put_meta):
            _call(fn, data)
    elif name == "decode_v3.prefix":
        _diff(name, _call(V3.parse_decode_v3_prefix, data), _call(V3.parse_decode_v3_prefix_construct, data))
    elif name == "decode_v3.frame":
        _call(V3.parse_decode_v3, data)
        _call(V3.validate_kv_segment, data, len(data))
        _call(V3.parse_prompt_segment, data, {"n_predict": 1})
    elif name == "store.chunks":
        for indexed in (True, False):
            it = S.iter_indexed_chunks if indexed else S.iter_sized_chunks
            _diff(f"{name}.{'indexed' if indexed else 'sized'}",
                  _call(lambda d: [(c.index, bytes(c.body)) for c in it(d)], data),
                  _call(S.parse_chunks_construct, data, indexed=indexed))
    else:
        raise KeyError(name)


def _check_ggml(name: str, data: bytes) -> None:
    """ggml-RPC: tensors, GRAPH_COMPUTE and SET_TENSOR payloads, the request stream."""
    if name == "ggml.tensor":
        _diff(name, _call(G.parse_rpc_tensor, data), _call(G.parse_rpc_tensor_construct, data), _floats_as_bits)
    elif name == "ggml.graph_compute":
        for v in (None, (3, 6, 1)):
            _diff(f"{name}@{v}", _call(G.parse_graph_compute, data, v),
                  _call(G.parse_graph_compute_construct, data, v), _floats_as_bits)
    elif name == "ggml.set_tensor":
        for v in (None, (7, 0, 1)):
            _diff(f"{name}@{v}", _call(G.parse_set_tensor_header, data, None, v),
                  _call(G.parse_set_tensor_header_construct, data, None, v), _floats_as_bits)
    elif name == "ggml.stream":
        _ggml_events(lambda: G.GgmlRequestDecoder(max_buffered=32, max_size=1 << 16), data, _splits(data))
        _call(G.classify_first_bytes, data)
        _call(G.classify_ggml_hello, data[:9])
        _call(G.parse_hello_request, data)
        _call(G.parse_hello_response, data)
    else:
        raise KeyError(name)


DECODERS = ("framing.request_header", "framing.response_header", "decoder.request_stream",
            "decoder.response_stream", "kvblob.header", "kvblob.parse", "payloads.e1", "payloads.token_frames",
            "payloads.swap_quant", "payloads.pieces", "payloads.json", "decode_v3.prefix", "decode_v3.frame",
            "store.chunks", "ggml.tensor", "ggml.graph_compute", "ggml.set_tensor", "ggml.stream")


def _corpus() -> dict[str, list[bytes]]:
    """Valid inputs per decoder: mutations of these reach deeper than random bytes."""
    reqs = [t.encode() for t in build_templates(2)]
    tensor = G.encode_rpc_tensor(G.RpcTensor(id=1, type=0, buffer=0x1000, ne=(4, 1, 1, 1), nb=(4, 16, 16, 16),
                                             data=0x2000, name=b"t"))
    v3 = next(t.payload for t in build_templates(2) if t.name == "DECODE.v3_kv")
    blob = next(t.payload for t in build_templates(2) if t.name == "STATE_PUT.v2")
    return {
        "framing.request_header": reqs, "decoder.request_stream": [b"".join(reqs[:6]), reqs[-3] + reqs[0]],
        "framing.response_header": [encode_response(0, b'{"a":1}', b"xy")],
        "decoder.response_stream": [encode_response(0, b'{"a":1}', b"x" * 100) + encode_response(2, b"{}")],
        "kvblob.header": [blob, KV.encode_kv_blob_header(3, 2, [5, 6])], "kvblob.parse": [blob],
        "payloads.e1": [P.encode_e1_decode(3, [1, 2, 3])], "payloads.pieces": [P.encode_piece("ab") * 3],
        "payloads.token_frames": [P.encode_token_frame(5, -0.5) + P.encode_token_frame(6, -1.0, final=True)],
        "payloads.swap_quant": [P.encode_swap_quant("q4", ".*")],
        "payloads.json": [b'{"n_predict":3,"messages":[],"mode":"solo","peer":"x"}', b'["a","b"]'],
        "decode_v3.prefix": [v3], "decode_v3.frame": [v3],
        "store.chunks": [S.encode_indexed_chunk(0, b"abc") + S.encode_indexed_chunk(1, b"")],
        "ggml.tensor": [tensor], "ggml.graph_compute": [G.encode_graph_compute([1], [G.parse_rpc_tensor(tensor)])],
        "ggml.set_tensor": [G.encode_set_tensor(G.parse_rpc_tensor(tensor), 0, b"data")],
        "ggml.stream": [G.encode_hello_request() + G.encode_request(G.Cmd.GET_ALIGNMENT, struct.pack("<I", 0))],
    }


_CORPUS: dict[str, list[bytes]] | None = None
INTERESTING_U32 = (0, 1, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF)


def gen_input(name: str, rng: random.Random) -> tuple[bytes, str]:
    global _CORPUS
    if _CORPUS is None:
        _CORPUS = _corpus()
    seeds = _CORPUS.get(name) or [b""]
    how = rng.randrange(6)
    if how == 0 or not seeds[0]:
        n = rng.choice((0, 1, 4, 9, 12, 16, 33, 300))
        return bytes(rng.randrange(256) for _ in range(n)), f"{n} random bytes"
    data = bytearray(rng.choice(seeds))
    if how == 1:
        cut = rng.randrange(len(data) + 1)
        return bytes(data[:cut]), f"seed cut at {cut}"
    edits = []
    for _ in range(rng.randrange(1, 6)):
        if not data:
            break
        pos = rng.randrange(len(data))
        k = rng.randrange(4)
        if k == 0:
            data[pos] ^= 1 << rng.randrange(8)
        elif k == 1 and pos + 4 <= len(data):
            data[pos:pos + 4] = struct.pack("<I", rng.choice(INTERESTING_U32))
        elif k == 2:
            data[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 8)))
        else:
            del data[pos:pos + rng.randrange(1, 8)]
        edits.append(f"{'flip set ins del'.split()[k]}@{pos}")
    return bytes(data), "seed " + ",".join(edits)


def case_at(seed: int, index: int) -> Case:
    name = DECODERS[index % len(DECODERS)]
    data, note = gen_input(name, rng_for(seed, index))
    return Case(seed, index, "codec", name, f"{name}: {note}", protocol="codec", messages=[Message(data)],
                decoder=name)


def run_codec_case(case: Case) -> Outcome:
    out = Outcome(sent=[m.data for m in case.messages])
    try:
        _check(case.decoder or case.generator, case.messages[0].data if case.messages else b"")
    except CodecFinding as e:
        out.fail(e.oracle, str(e))
    except RecursionError as e:  # the harness itself must not die on a decoder's deep input
        out.fail("codec-error", f"RecursionError: {e}")
    return out
