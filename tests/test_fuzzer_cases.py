"""The fuzzer's case generation, expectations and minimizer — no target needed."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from codec import decode_v3 as V3
from codec.dialects import Dialect
from codec.enums import Op
from codec.errors import MalformedPayload
from codec.framing import encode_request
from tools.fuzzer import payload_mutators as PM
from tools.fuzzer import schedule
from tools.fuzzer.cases import Case, Message
from tools.fuzzer.minimize import Minimizer
from tools.fuzzer.mutators import CANARY, frame
from tools.fuzzer.oracles import plan_frames
from tools.fuzzer.stateful import generate_program, valid_program
from tools.fuzzer.templates import build_templates

ROOT = Path(__file__).resolve().parents[1]


def _digests(seed: int, indexes) -> list[str]:
    return [schedule.case_at(seed, i).digest() for i in indexes]


def _span() -> list[int]:
    n_smoke, n_sweep = schedule.phase_sizes()
    # smoke, the start of the sweep, and the random phase (incl. stateful programs)
    return list(range(0, n_smoke + 60)) + list(range(n_smoke + n_sweep - 20, n_smoke + n_sweep + 200))


def test_same_seed_same_cases_in_process():
    first = _digests(7, _span())
    schedule._plan.cache_clear()  # rebuild templates and variant caches from scratch
    assert _digests(7, _span()) == first
    assert _digests(8, _span()) != first  # and the seed matters (random phase)


def test_same_seed_same_cases_across_processes():
    n_smoke, n_sweep = schedule.phase_sizes()
    cmd = [sys.executable, "-m", "hydra_rpc.cli", "fuzz", "--list", "--seed", "3", "--start",
           str(n_smoke + n_sweep - 30), "--cases", "150", "--target", "127.0.0.1:1"]
    outs = []
    for hashseed in ("1", "2"):  # hash randomisation must not leak into the cases
        env = dict(os.environ, PYTHONHASHSEED=hashseed)
        outs.append(subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True,
                                   timeout=60).stdout)
    assert outs[0] == outs[1] and outs[0].count("\n") == 150
    assert "random" in outs[0] and "stateful" in outs[0]


def test_smoke_sends_every_opcode_and_dialect():
    ops = {frame_.op for i in range(schedule.phase_sizes()[0])
           for frame_ in plan_frames(schedule.case_at(0, i).messages[0].data).frames}
    assert ops >= {int(op) for op in Op}
    names = {t.name for t in build_templates()}
    assert {"PREFILL.e1", "PREFILL.json", "DECODE.pin", "DECODE.frames", "DECODE.e1", "DECODE.v3",
            "STATE_PUT.v1", "STATE_PUT.v2", "STATE_PUT.v3", "SET_EXPERT_MODE.json"} <= names


def test_decisive_families_come_first():
    n_smoke = schedule.phase_sizes()[0]
    first = [schedule.case_at(0, n_smoke + k).generator for k in range(3)]
    assert first == ["op.sweep", "payload_len.huge", "v3.rules"]
    assert schedule.case_at(0, n_smoke + 2).note.endswith("hdr_hash")


def test_hydra_cases_never_open_a_ggml_session():
    for i in _span():
        case = schedule.case_at(5, i)
        if case.messages:
            assert case.messages[0].data[0] >= 0x14, case.note


def test_plan_frames_knows_clean_partial_garbage_and_pin():
    info = encode_request(Op.INFO)
    pin = encode_request(Op.DECODE, b"0", b'{"n_predict":2}')
    plan = plan_frames(info + pin)
    assert plan.tail == "clean" and [f.op for f in plan.frames] == [Op.INFO, Op.DECODE]
    assert plan.frames[1].dialect is Dialect.DECODE_PIN and plan.frames[0].dialect is None
    assert plan_frames(info + pin[:20]).tail == "partial"
    assert plan_frames(info + b"GET / HTTP/1.1\r\n\r\n").tail == "garbage"
    # a lying payload_len turns the canary into part of an unfinished request
    assert plan_frames(frame(0x99, b"0", CANARY, payload_len=len(CANARY) + 1)).tail == "partial"


V3_RULE_IDS = {
    "hdr_hash": "v3.hdr_hash", "short_payload": "v3.short_payload", "hdr_len_cap": "v3.hdr_len",
    "hdr_overrun": "v3.hdr_overrun", "hdr_json": "v3.hdr_json", "hdr_not_object": "v3.hdr_json",
    "v_missing": "v3.version", "v_2": "v3.version", "v_string": "v3.version", "v_huge": None,
    "kv_metadata_missing": "v3.kv_metadata", "kv_metadata_array": "v3.kv_metadata",
    "segments_missing": "v3.segments_type", "segments_object": "v3.segments_type", "segments_4": "v3.segments_count",
    "segment_no_hash": "v3.segment_fields", "segment_len_negative": "v3.segment_fields",
    "segment_len_string": "v3.segment_fields", "segment_offset": "v3.segment_offset", "segment_id": "v3.segment_id",
    "segment_dup_id": "v3.segment_id", "segment_sum_over": "v3.segment_sum", "segment_sum_under": "v3.segment_sum",
    "kv_hash_prefix": "v3.kv_hash_format", "kv_hash_hex": "v3.kv_hash_format", "kv_hash_long": "v3.kv_hash_format",
    "kv_hash_mismatch": "v3.kv_hash", "prompt_hash_wrong": None, "generation_array": "v3.prompt_build",
    "prompt_len_cap": "v3.prompt_len", "kv_len_cap": "v3.kv_len", "kv_short": "v3.kv_short",
    "kv_tokens": "v3.kv_tokens", "kv_checkpoint": "v3.kv_checkpoint", "kv_stream": "v3.kv_stream",
    "prompt_json": "v3.prompt_json", "prompt_scalar": "v3.prompt_build", "prompt_object": None,
}


def _v3_rule_hit(payload: bytes, declared: int | None, generation) -> str | None:
    try:
        if declared is not None:  # caps: only the head was sent, the length is declared
            hdr_len, hdr_hash = V3.parse_decode_v3_prefix(payload, declared)
            V3.validate_decode_v3(hdr_len, hdr_hash, payload[12:12 + hdr_len], declared)
            return None
        hdr, prompt, _ = V3.parse_decode_v3(payload)
        V3.parse_prompt_segment(prompt, hdr.generation)
    except MalformedPayload as e:
        return e.rule
    return None


def test_each_v3_mutation_breaks_the_rule_it_names():
    """Cross-check against the codec: the generator breaks exactly what its note says."""
    tp = next(t for t in build_templates() if t.name == "DECODE.v3_kv")
    rules = PM.v3_rules(tp)
    assert rules[0][0] == "hdr_hash"
    for name, payload, declared in rules:
        got = _v3_rule_hit(payload, declared, tp.parts["hdr"]["generation"])
        if name == "v_huge":
            assert got in (None, "v3.version")  # 2**70 ≥ 3: accepted by the letter of the rule
            continue
        assert got == V3_RULE_IDS[name], (name, got)


def test_stateful_programs_are_seeded_and_self_consistent():
    a = [generate_program(schedule.rng_for(1, i), 2) for i in range(50)]
    b = [generate_program(schedule.rng_for(1, i), 2) for i in range(50)]
    assert a == b
    assert all(valid_program(p) for p in a)
    ops = {st["op"] for p in a for st in p}
    assert ops >= {"prefill", "get", "put", "meta", "decode", "decode_v3", "configure", "meta_during_decode"}
    assert not valid_program([{"op": "put", "slot": 0, "blob": "b9"}])


def test_case_json_roundtrip():
    for i in _span()[::25]:
        c = schedule.case_at(2, i)
        assert Case.from_json(c.to_json()).digest() == c.digest()


def test_minimizer_shrinks_to_the_trigger():
    """Pipelined requests, one of them the 'bug' (op 0x99 with any payload): the minimizer
    keeps just that request, with key, trace and payload emptied and lengths fixed up."""
    noise = encode_request(Op.INFO, b"", b"", b"trace") + encode_request(Op.STATE_META, b"1")
    trigger = encode_request(0x99, b"0", CANARY + b"x" * 300, b"trace")
    case = Case(1, 0, "sweep", "pipeline", "t", messages=[Message(noise + trigger + noise, "dribble", 2, 1.0),
                                                          Message(b"junk")])

    async def still_fails(c: Case) -> bool:
        plan = plan_frames(b"".join(m.data for m in c.messages))
        return any(f.op == 0x99 for f in plan.frames)

    small = asyncio.run(Minimizer(still_fails, max_attempts=500, max_seconds=30).run(case))
    assert len(small.messages) == 1 and small.messages[0].mode == "burst"
    assert small.messages[0].data == frame(0x99)


@pytest.mark.parametrize("family", ["json", "kvblob", "v3.rules", "swap_quant", "dialect", "truncate"])
def test_random_phase_reaches_every_structured_family(family):
    n_smoke, n_sweep = schedule.phase_sizes()
    start = n_smoke + n_sweep
    gens = {schedule.case_at(4, i).generator for i in range(start, start + 400)}
    assert family in gens


def test_a_desync_reproduces_whichever_moment_its_extra_reply_is_seen_at():
    """Replies out of step are "extra" when the unasked-for reply came before the follow-up INFO
    was sent and "followup" when after: a re-run on a loaded host may see the other."""
    from tools.fuzzer.cases import Failure, Outcome

    def seen(oracle: str, rule: str) -> Outcome:
        out = Outcome()
        out.fail(oracle, "as seen", rule)
        return out

    assert seen("desync", "followup").same_failure(Failure("desync", "first run", "extra"))
    assert seen("desync", "extra").same_failure(Failure("desync", "first run", "followup"))
    assert not seen("desync", "mismatch").same_failure(Failure("desync", "first run", "extra"))
    assert not seen("desync", "followup-closed").same_failure(Failure("desync", "first run", "followup"))
    assert seen("liveness", "").same_failure(Failure("hang", "first run", ""))  # as before
