"""The fuzzer's hostile classes (issue 13): CONFIGURE / hydra_config values by type and range
with the process-death oracle, structural mutations inside the KV state region, and the
slow-sender mode."""
from __future__ import annotations

import json
import shlex
import shutil
import struct
import sys
from pathlib import Path

import pytest

from codec.kvblob import parse_kv_blob_header
from codec.seqstate import parse_seq_state
from engine.params_table import PARAMS
from tools.fuzzer.config_mutators import config_cases, values_for
from tools.fuzzer.execute import RunConfig
from tools.fuzzer.oracles import take_baseline
from tools.fuzzer.schedule import case_at
from tools.fuzzer.stateful import mutate_state_field, run_program
from tools.fuzzer.target import Target
from tests.helpers import run_fuzz as fuzz, serving

BROKEN = f"{shlex.quote(sys.executable)} tests/broken_server.py --port {{port}}"


def test_every_configure_key_meets_its_worst_values_first():
    cases = config_cases()
    keys = {p.key for p in PARAMS if p.config}
    assert {k for k, _ in cases} == keys
    first_round = dict(cases[:len(keys)])  # one value per key, before any key gets a second
    assert len(first_round) == len(keys)
    assert first_round["flash_attn"] == "7" and first_round["n_ctx"] == str(1 << 24 | 1)
    assert values_for(next(p for p in PARAMS if p.key == "rope_scale"))[:3] == ["2000000", "-0.999999", "0"]


def first_case(pred, limit: int = 4000) -> int:
    return next(i for i in range(limit) if pred(case_at(1, i)))


@pytest.mark.timeout(120)
def test_the_sweep_finds_a_config_value_that_kills_the_process(tmp_path):
    """flash_attn 7 made llama.cpp abort: the sweep reaches it by itself, the spawned target's
    death is the finding, and the replay reproduces it."""
    i = first_case(lambda c: c.generator == "config.values" and c.note.endswith("flash_attn=7"))
    p = fuzz("--target", "127.0.0.1:0", "--spawn", BROKEN + " --fragile-config", "--seed", "1", "--index", str(i),
             "--deadline", "1", "--minimize-seconds", "5", "--out", str(tmp_path), "--json")
    assert p.returncode == 1, p.stderr
    results = json.loads(p.stdout)
    [f] = results["findings"]
    assert f["class"] == "crash" and f["generator"] == "config.values", f
    assert {"returncode": -6, "signal": "SIGABRT"} in results["exits"]
    doc = json.loads(Path(f["file"]).read_text())
    assert b'"flash_attn":7' in bytes.fromhex(doc["case"]["messages"][0]["hex"])
    assert fuzz("--replay", f["file"]).returncode == 1


@pytest.fixture(scope="module")
def tiny_state() -> bytes:
    from engine.backend import BatchItem
    from engine.llama_backend.model import LoadedModel
    from engine.model_files import ensure_tiny_model

    m = LoadedModel(str(ensure_tiny_model()), n_ctx=256, n_seq_max=2)
    try:
        m.decode([BatchItem(0, [1, 5, 6, 7], 0, False)])
        return bytes(m.state_seq_get(0))
    finally:
        m.close()


def test_a_state_field_is_located_and_changed_in_place(tiny_state):
    from codec.kvblob import encode_kv_blob_header

    head = encode_kv_blob_header(3, 4, [1, 5, 6, 7])
    blob = head + tiny_state
    bomb = mutate_state_field(blob, "cell -1 pos", 2**26)
    assert len(bomb) == len(blob) and bomb[:len(head)] == head
    with pytest.raises(Exception, match="positions 0..67108864"):
        parse_seq_state(bomb[len(head):], max_cells=256)
    rows = mutate_state_field(blob, "layer 0 K row_size", 2**63)
    assert struct.unpack_from("<Q", rows, len(head) + 4 * 4 + 4 * 3 * 4 + 8 + 4)[0] == 2**63
    assert mutate_state_field(blob, "cell_count", -1)[len(head) + 12:len(head) + 16] == b"\xff" * 4
    assert mutate_state_field(head, "cell 0 pos", 1) is None  # no state: nothing to change
    assert parse_kv_blob_header(rows)[1] == len(head)


def test_stateful_programs_mutate_real_state_regions():
    cases = (case_at(1, i) for i in range(0, 4000))
    steps = [st for c in cases if c.generator == "stateful" for st in c.program if st["op"] == "put_mutated"]
    assert len({st["field"] for st in steps}) >= 4 and len({st["value"] for st in steps}) >= 4, steps


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_mutated_state_put_against_the_server(tiny_model_path):
    program = [{"op": "prefill", "slot": 0, "text": "hi there", "as": "b0"},
               {"op": "put_mutated", "slot": 1, "blob": "b0", "field": "cell -1 pos", "value": 5000},
               {"op": "put_mutated", "slot": 1, "blob": "b0", "field": "layer 0 V row_size", "value": 2**40},
               {"op": "meta", "slot": 1}, {"op": "info"}]
    with serving("--model", "tiny", "--no-http", "--parallel", "2", "--log-level", "WARNING") as sp:
        target = Target(sp.host, sp.port)
        cfg = RunConfig(deadline=5.0)
        out = await run_program(program, target, await take_baseline(target, 5.0), cfg)
        assert out.ok, out.failures
        assert len(out.sent) == 5 and [r["status"] for r in out.responses][0] == "OK", out.responses
        assert sp.proc.poll() is None


@pytest.mark.timeout(120)
def test_slow_senders_the_target_never_cuts_are_a_finding(tmp_path):
    """tests/broken_server.py has no read deadlines: a dribbler lives as long as it likes."""
    p = fuzz("--target", "127.0.0.1:0", "--spawn", BROKEN, "--seed", "1", "--seconds", "4", "--index", "0",
             "--slow-senders", "2", "--slow-deadline", "2", "--out", str(tmp_path), "--json")
    results = json.loads(p.stdout)
    slow = [f for f in results["findings"] if f["rule"] == "slow-sender"]
    assert slow and slow[0]["class"] == "hang", results["findings"]
    assert results["slow_senders"]["overstayed"] >= 1 and results["slow_senders"]["cut_by_server"] == 0


@pytest.mark.timeout(120)
def test_slow_senders_are_cut_by_the_servers_minimum_rate(tmp_path, tiny_model_path):
    spawn = (f"{shlex.quote(sys.executable)} -m hydra_rpc.cli serve --model tiny --no-http --port {{port}} "
             "--stall-timeout 60 --min-rate 1024 --min-rate-window 2 --log-level WARNING")
    p = fuzz("--target", "127.0.0.1:0", "--spawn", spawn, "--seed", "1", "--index", "0", "--slow-senders", "3",
             "--slow-deadline", "30", "--out", str(tmp_path), "--json", timeout=100)
    results = json.loads(p.stdout)
    assert not [f for f in results["findings"] if f["rule"] == "slow-sender"], results["findings"]
    assert results["slow_senders"]["cut_by_server"] >= 3, results["slow_senders"]


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_position_bomb_then_state_get_against_the_server(tiny_model_path):
    """The 10-minute fuzz of issue 13, minimized: a state whose last cell sits at 2^26 (n_past
    67108865 and +1.5 GB once), then a STATE_GET of that slot, which hung. The bomb is refused
    before llama.cpp sees it; the slot keeps what it held and answers."""
    program = [{"op": "prefill", "slot": 1, "text": "ünïcödé ✓", "as": "b1"},
               {"op": "put_mutated", "slot": 1, "blob": "b1", "field": "cell -1 pos", "value": 2**26},
               {"op": "get", "slot": 1, "as": "b2"}, {"op": "meta", "slot": 1}]
    with serving("--model", "tiny", "--no-http", "--parallel", "2", "--log-level", "WARNING") as sp:
        target = Target(sp.host, sp.port)
        peak0 = sp.peak_kib()
        out = await run_program(program, target, await take_baseline(target, 5.0), RunConfig(deadline=5.0))
        assert out.ok, out.failures
        put, get = out.responses[1], out.responses[2]
        assert put["status"] == "BAD_REQUEST" and put["meta"]["rule"] == "seq.pos", put
        assert get["status"] == "OK" and get["meta"]["n_past"] < 64, get
        assert sp.peak_kib() - peak0 < 64 << 10


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux prlimit")
@pytest.mark.timeout(180)
def test_the_config_values_the_ten_minute_fuzz_found_find_nothing_now(tmp_path, tiny_model_path):
    """The same run's other findings against serve under a 4 GiB address-space limit: flash_attn
    7 (SIGABRT) and n_ctx 2^24 + 1 (+3.3 GB, a hang), each in a CONFIGURE and in a PREFILL's
    hydra_config. Now typed before llama.cpp sees them: the fuzzer finds nothing."""
    notes = {"CONFIGURE flash_attn=7", "PREFILL hydra_config flash_attn=7", "CONFIGURE n_ctx=16777217",
             "PREFILL hydra_config n_ctx=16777217"}
    found: dict[str, int] = {}
    for i in range(40000):
        c = case_at(1, i)
        if c.generator == "config.values" and c.note in notes:
            found.setdefault(c.note, i)
            if len(found) == len(notes):
                break
    assert set(found) == notes
    spawn = (f"prlimit --as={4 << 30} {shlex.quote(sys.executable)} -m hydra_rpc.cli serve --model tiny "
             "--port {port} --no-http --log-level WARNING")
    p = fuzz("--target", "127.0.0.1:0", "--spawn", spawn, "--seed", "1",
             *[a for i in sorted(found.values()) for a in ("--index", str(i))], "--out", str(tmp_path), "--json")
    results = json.loads(p.stdout)
    assert p.returncode == 0 and results["findings"] == [] and results["cases"] == len(notes), (p.stderr, results)
