"""The decoders' named phases: the transition table is the state machine, and a move it does
not list raises instead of going through."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import codec.decoder as decoder_module
from codec.decoder import RequestDecoder, RequestEnd, RequestStart, ResponseDecoder, ResponseEnd
from codec.decoder_state import TRANSITIONS, IllegalTransition, Phase, advance
from codec.enums import Op, Status
from codec.errors import BadMagic, CodecError, FrameTooLarge
from codec.framing import encode_request, encode_response
from codec.limits import Limits


def test_an_illegal_transition_raises_naming_both_phases():
    with pytest.raises(IllegalTransition, match="from HEAD to PAYLOAD") as ei:
        advance(Phase.HEAD, Phase.PAYLOAD)
    assert "codec bug" in str(ei.value)
    # Not a CodecError: fuzzers take those for the expected answer to garbage and would hide it.
    assert not isinstance(ei.value, CodecError)


@pytest.mark.parametrize("current,new", list(itertools.product(Phase, Phase)))
def test_advance_follows_the_table_exactly(current, new):
    if new in TRANSITIONS[current]:
        assert advance(current, new) is new
    else:
        with pytest.raises(IllegalTransition):
            advance(current, new)


def test_every_phase_has_a_row_and_broken_is_final():
    assert set(TRANSITIONS) == set(Phase)
    assert TRANSITIONS[Phase.BROKEN] == frozenset()


def test_a_decoder_refuses_an_illegal_move_and_stays_where_it_was():
    dec = RequestDecoder()
    with pytest.raises(IllegalTransition, match="RequestDecoder moved from HEAD to SKIP"):
        dec._goto(Phase.SKIP)
    assert dec.at_boundary  # still HEAD: the refused move did not happen
    dec.feed(encode_request(Op.INFO))
    assert isinstance(dec.next_event(), RequestStart) and isinstance(dec.next_event(), RequestEnd)


@pytest.fixture
def walked(monkeypatch):
    """Every (from, to) move the decoders make while the test runs."""
    moves: list[tuple[Phase, Phase]] = []
    goto = decoder_module._Decoder._goto

    def record(self, phase: Phase) -> None:
        before = self._state
        goto(self, phase)
        moves.append((before, phase))

    monkeypatch.setattr(decoder_module._Decoder, "_goto", record)
    return moves


def _drain(dec) -> list:
    out = []
    while (ev := dec.next_event()) is not decoder_module.NEED_DATA:
        out.append(ev)
    return out


H, PRE, PAY, SKIP, BROKEN = Phase.HEAD, Phase.PREAMBLE, Phase.PAYLOAD, Phase.SKIP, Phase.BROKEN


def test_a_request_walks_head_preamble_payload_head(walked):
    dec = RequestDecoder()
    dec.feed(encode_request(Op.PREFILL, b"0", b'{"prompt":"x"}', b"t"))
    assert [type(e).__name__ for e in _drain(dec)] == ["RequestStart", "PayloadChunk", "RequestEnd"]
    assert walked == [(H, PRE), (PRE, PAY), (PAY, H)]


def test_an_ignored_payload_is_skipped(walked):
    dec = RequestDecoder()
    dec.feed(encode_request(Op.INFO, b"", b"junk"))
    evs = _drain(dec)
    assert evs[0].payload_len == 0 and evs[-1] == RequestEnd(skipped=True)
    assert walked == [(H, PRE), (PRE, SKIP), (SKIP, H)]


def test_a_refused_frame_skips_or_breaks_by_max_drain(walked):
    dec = RequestDecoder(Limits(max_payload={Op.CONFIGURE: 2}, max_drain=100))
    dec.feed(encode_request(Op.CONFIGURE, b"", b"{}   "))
    with pytest.raises(FrameTooLarge):
        dec.next_event()
    assert _drain(dec) == [RequestEnd(skipped=True)]
    assert walked == [(H, PRE), (PRE, SKIP), (SKIP, H)]
    walked.clear()
    dec = RequestDecoder(Limits(max_payload={Op.CONFIGURE: 2}, max_drain=3))
    dec.feed(encode_request(Op.CONFIGURE, b"", b"{}   "))
    with pytest.raises(FrameTooLarge) as ei:
        dec.next_event()
    assert not ei.value.recoverable and walked == [(H, PRE), (PRE, BROKEN)]


def test_skip_payload_and_bad_magic(walked):
    dec = RequestDecoder(Limits(buffer_threshold=2))
    dec.feed(encode_request(Op.PREFILL, b"0", b"abcdef")[:-2])
    assert isinstance(dec.next_event(), RequestStart)
    dec.skip_payload()
    dec.feed(b"ef")
    assert _drain(dec) == [RequestEnd(skipped=True)]
    assert walked == [(H, PRE), (PRE, PAY), (PAY, SKIP), (SKIP, H)]
    walked.clear()
    dec.feed(b"GET / HTTP/1.1\r\n\r\n")
    for _ in range(2):  # broken for good: the same error every time, and no further move
        with pytest.raises(BadMagic):
            dec.next_event()
    assert walked == [(H, BROKEN)]


def test_a_response_walks_the_same_table(walked):
    dec = ResponseDecoder()
    dec.feed(encode_response(Status.OK, b"{}", b"xy"))
    assert isinstance(_drain(dec)[-1], ResponseEnd)
    assert walked == [(H, PRE), (PRE, PAY), (PAY, H)]


@given(st.lists(st.one_of(st.binary(max_size=40),
                          st.builds(lambda op, p: encode_request(op, b"0", p), st.sampled_from(list(Op)),
                                    st.binary(max_size=40))), max_size=6),
       st.lists(st.booleans(), max_size=20), st.integers(1, 64))
@settings(max_examples=300, deadline=None)
def test_any_input_and_skip_payload_only_ever_walk_the_table(parts, skips, drain):
    """Garbage, refusals and skip_payload at any point raise CodecErrors at most, never an
    IllegalTransition (which is not one, so it would fail this test)."""
    dec = RequestDecoder(Limits(max_payload={op: 16 for op in Op}, max_drain=drain, buffer_threshold=8))
    dec.feed(b"".join(parts))
    for skip in skips + [False] * 40:
        if skip:
            try:
                dec.skip_payload()
            except FrameTooLarge:
                pass
        try:
            if dec.next_event() is decoder_module.NEED_DATA:
                break
        except CodecError:
            if dec._state is Phase.BROKEN:
                break
