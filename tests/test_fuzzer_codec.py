"""``hydra-rpc fuzz --codec``: decoders fed garbage in-process, with differential checks."""
from __future__ import annotations

import asyncio
import struct
from pathlib import Path

from codec import ggml as G
from codec import payloads as P
from codec.errors import FrameTooLarge
from tools.fuzzer import codec_mode
from tools.fuzzer.execute import RunConfig
from tools.fuzzer.progress import Progress
from tools.fuzzer.runner import Options, Runner

KNOWN: set[str] = set()


def run_codec(cases: int, seed: int, out: Path | None = None) -> dict:
    opts = Options(seed=seed, cases=cases, protocol="codec", out=out, minimize_seconds=5, cfg=RunConfig())
    return asyncio.run(Runner(opts, None, Progress(quiet=True)).run())


def test_every_decoder_survives_garbage_and_both_paths_agree(tmp_path):
    results = run_codec(6 * len(codec_mode.DECODERS) * 40, seed=5, out=tmp_path)
    assert results["cases"] == 6 * len(codec_mode.DECODERS) * 40
    unexpected = [f for f in results["findings"] if f["signature"] not in KNOWN]
    assert unexpected == [], unexpected


def test_codec_cases_are_addressable():
    a = [codec_mode.case_at(9, i).digest() for i in range(200)]
    assert a == [codec_mode.case_at(9, i).digest() for i in range(200)]
    assert {codec_mode.case_at(9, i).decoder for i in range(200)} == set(codec_mode.DECODERS)


def test_a_decoder_that_raises_is_a_codec_error(monkeypatch):
    def broken(payload):
        if len(payload) % 4:
            raise IndexError("boom")  # not a CodecError: the codec's contract is broken
        return []

    monkeypatch.setattr(P, "decode_e1_tokens", broken)
    case = next(c for c in (codec_mode.case_at(1, i) for i in range(2000))
                if c.decoder == "payloads.e1" and len(c.messages[0].data) % 4)
    out = codec_mode.run_codec_case(case)
    assert out.primary.oracle == "codec-error" and "IndexError" in out.primary.detail


def test_paths_that_disagree_are_a_codec_diff(monkeypatch):
    monkeypatch.setattr(P, "parse_swap_quant_construct",
                        lambda payload: P.SwapQuantRequest("other", ""))
    case = next(c for c in (codec_mode.case_at(2, i) for i in range(2000))
                if c.decoder == "payloads.swap_quant" and codec_mode._call(P.parse_swap_quant, c.messages[0].data)[0]
                == "ok")
    out = codec_mode.run_codec_case(case)
    assert out.primary.oracle == "codec-diff"


# Regression: found by `hydra-rpc fuzz --codec` (codec-diff:ggml.stream), fixed in codec/ggml.py.
def test_ggml_decoder_keeps_frames_before_an_oversize_one():
    data = G.encode_hello_request() + bytes((G.Cmd.SET_TENSOR,)) + struct.pack("<Q", 1 << 40)
    dec = G.GgmlRequestDecoder(max_size=1 << 20)
    events = []
    try:
        events += dec.feed(data)
    except FrameTooLarge:
        pass
    assert any(isinstance(e, G.RequestComplete) and e.cmd == G.Cmd.HELLO for e in events)
