"""The fuzzer's per-reply oracle for STATE_META: a key past the slot count reaches the slot the
engine maps it onto (modulo the count, as the C++ does), which is not a desync."""
from __future__ import annotations

import pytest

from codec.enums import Op, Status
from tools.fuzzer.cases import Outcome
from tools.fuzzer.oracles import Baseline, SentFrame, judge, slot_reached
from tools.fuzzer.responses import Resp


@pytest.mark.parametrize("key, n_slots, want", [
    (b"3", 2, 1), (b"7", 4, 3), (b"1", 2, 1), (b" 5abc", 4, 1), (b"3", None, 3), (b"-1", 2, -1), (b"x", 2, None)])
def test_slot_reached(key, n_slots, want):
    assert slot_reached(key, n_slots) == want


@pytest.mark.parametrize("slot_id, desync", [(1, False), (3, True), (0, True)])
def test_state_meta_for_a_key_past_the_slots_is_judged_by_the_slot_it_reaches(slot_id, desync):
    out = Outcome()
    reply = Resp(Status.OK, b"{}", {"slot_id": slot_id}, 0, b"")
    judge(reply, SentFrame(Op.STATE_META, b"3", b""), Baseline(Status.OK, True, 1, n_slots=2), out)
    assert bool(out.failures) is desync, out.failures
