"""Coverage-guided fuzzing of every codec decoder with atheris (libFuzzer for Python).

    python -m tools.atheris_codec -runs=20000          # libFuzzer flags pass through

The invariant (h11's fuzz/afl-server.py): whatever the bytes, a decoder either parses them
or raises the codec's own ``CodecError`` — never anything else. The struct hot path and the
construct definition of the request header must agree on every input.
"""
from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from codec import decode_v3, dialects, ggml, kvblob, payloads, store
    from codec.decoder import NEED_DATA, RequestDecoder, ResponseDecoder
    from codec.errors import CodecError, FrameTooLarge
    from codec.framing import REQUEST_HEADER, decode_request_header


def _drain(dec, data: bytes) -> None:
    dec.feed(data)
    for _ in range(64):
        try:
            if dec.next_event() is NEED_DATA:
                return
        except FrameTooLarge:
            continue


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    which = fdp.ConsumeIntInRange(0, 9)
    raw = fdp.ConsumeBytes(fdp.remaining_bytes())
    try:
        if which == 0:
            _drain(RequestDecoder(), raw)
        elif which == 1:
            _drain(ResponseDecoder(), raw)
        elif which == 2:
            kvblob.parse_kv_blob(raw)
        elif which == 3:
            decode_v3.parse_decode_v3(raw)
        elif which == 4:
            dialects.decode_dialect(raw)
            payloads.decode_e1_decode(raw)
        elif which == 5:
            payloads.parse_json_decode(raw)
        elif which == 6:
            payloads.parse_swap_quant(raw)
        elif which == 7:
            list(store.iter_indexed_chunks(raw))
        elif which == 8:
            d = ggml.GgmlRequestDecoder()
            d.feed(raw)
        else:
            ggml.parse_graph_compute(raw, (3, 6, 1))
    except CodecError:
        pass
    if len(raw) >= 16:
        c = REQUEST_HEADER.parse(raw[:16])
        if c.magic == 0x4859:
            h = decode_request_header(raw[:16])
            assert (h.op, h.key_len, h.payload_len, h.trace_len) == (c.op, c.key_len, c.payload_len, c.trace_len)


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
