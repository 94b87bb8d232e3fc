"""vs-llama-server's pairs pooled over runs (tools/bench/pooled.py): intervals, verdicts, the
test against the control, and the section combined.md gets."""
from __future__ import annotations

import json
import random

import pytest

from tools.bench import pooled
from tools.bench.common import Result
from tools.bench.vs_llama_server_figures import CONTROL


def _pairs(ours: list[float], side: str = "hydra", theirs: float = 40.0) -> list[dict]:
    return [{"pair": i, "llama-server": theirs, side: theirs * q} for i, q in enumerate(ours)]


def _samples(one: list[float], ttft: list[float], control: list[float] | None = None) -> dict:
    s = {"pairs": {"one": _pairs(one), "ttft": _pairs(ttft, theirs=30.0)}}
    if control is not None:
        s["control"] = {"one": _pairs(control, CONTROL)}
    return s


def _by_label(figures: list[pooled.PooledFigure]) -> dict[str, pooled.PooledFigure]:
    return {f.label.split(",")[0]: f for f in figures}


def test_a_figure_is_ahead_behind_or_level_by_its_interval_and_its_direction():
    runs = [_samples([1.05, 1.06, 1.04, 1.05], [1.10, 1.08, 1.12, 1.09]),
            _samples([1.06, 1.05, 1.07, 1.04], [1.11, 1.10, 1.09, 1.13])]
    figs = _by_label(pooled.pool(runs))
    assert set(figs) == {"one stream", "time to first token"}  # figures without pairs are left out
    one, ttft = figs["one stream"], figs["time to first token"]
    assert one.ours.n == 8 and 1.04 <= one.ours.low <= one.ours.value <= one.ours.high <= 1.07
    assert one.verdict == "ahead"  # more tok/s than llama-server
    assert ttft.lower_is_better and ttft.verdict == "behind"  # a later first token
    assert one.control is None and one.p_like_control is None

    level = _by_label(pooled.pool([_samples([0.98, 1.02, 0.99, 1.01, 1.00, 0.97, 1.03], [0.9] * 4)]))
    assert level["one stream"].verdict == "level"
    assert level["time to first token"].verdict == "ahead"


def test_the_same_runs_give_the_same_table():
    runs = [_samples([0.98, 1.02, 0.99, 1.01], [0.9, 1.1, 1.0, 0.95], [1.0, 1.01, 0.99, 1.02])]
    assert pooled.markdown(pooled.pool(runs), 1) == pooled.markdown(pooled.pool(runs), 1)


def test_p_tells_one_distribution_from_two():
    rng = random.Random(1)
    same = [rng.gauss(1.0, 0.01) for _ in range(24)]
    other = [rng.gauss(1.0, 0.01) for _ in range(24)]
    apart = [x + 0.05 for x in other]
    assert pooled.p_same(same, other, random.Random(0)) > 0.05
    assert pooled.p_same(same, apart, random.Random(0)) < 0.01


def test_the_control_is_pooled_beside_ours():
    runs = [_samples([1.05] * 6, [0.7] * 6, control=[0.99, 1.0, 1.01, 1.0, 0.98, 1.02])]
    one = _by_label(pooled.pool(runs))["one stream"]
    assert one.control is not None and one.control.n == 6 and one.control.low <= 1.0 <= one.control.high
    assert one.p_like_control is not None and one.p_like_control < 0.05
    row = next(line for line in pooled.markdown([one], 1).splitlines() if line.startswith("| one stream"))
    assert "| 6 | 1.050 (1.050–1.050) | ahead | 1.000 (" in row


def test_failed_pairs_are_left_out():
    pairs = _pairs([1.0, 1.1]) + [{"pair": 2, "llama-server": None, "hydra": 40.0}, {"pair": 3, "llama-server": 40.0}]
    assert pooled.pair_ratios(pairs, "hydra") == [1.0, 1.1]


def test_combined_md_gets_a_section_only_when_vs_llama_server_ran():
    res = Result("vs-llama-server", samples=_samples([1.0, 1.02], [0.8, 0.9]))
    other = Result("meta-under-decode", samples={"latency_ms": [1.0]})
    failed = Result("vs-llama-server", samples=_samples([2.0], [0.5]), error="RuntimeError: no llama-server")
    text = pooled.section([[res, other], [res, failed]])
    assert text.startswith("## vs-llama-server: the pairs pooled") and "over 2 run(s)" in text
    assert "| 4 |" in text  # two runs' two pairs; the failed run left out
    assert pooled.section([[other]]) == ""


def test_the_command_reads_a_bench_out_folder_and_committed_copies(tmp_path, capsys):
    for i in (1, 2):
        run = tmp_path / "out" / f"run-{i}"
        run.mkdir(parents=True)
        Result("vs-llama-server", samples=_samples([1.0 + i / 100] * 3, [0.9] * 3)).write(run)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "run-1.json").write_text(json.dumps(Result("vs-llama-server", samples=_samples([1.0], [1.0])).as_dict()))
    (docs / "run-2.json").write_text(json.dumps(Result("busy-host").as_dict()))  # another scenario: skipped
    assert pooled.main([str(tmp_path / "out"), str(docs)]) == 0
    printed = capsys.readouterr().out
    assert "over 3 run(s)" in printed and "| 7 |" in printed
    assert "| ≥ 1.0× llama-server | 3/3 (1.010, 1.020, 1.000) | — |" in printed  # the runs' verdicts after it

    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    assert pooled.main([str(empty)]) == 1
    assert pooled.main([]) == 2


def test_slots_p99_is_taken_over_every_rounds_answers():
    def rounds(variant: str, answers: list[float]) -> list[dict]:
        return [{"variant": variant, "round": i, "slots_ms": answers} for i in range(3)]

    fast, slow = [1.0] * 194 + [4.0] * 6, [1.0] * 194 + [8.0] * 6  # 3 % slow: p99 is in the tail
    runs = [{"rounds": rounds("hydra", fast) + rounds("llama-server", slow)}] * 2
    slots = pooled.pool(runs)[-1]
    assert slots.label.startswith("/slots p99") and slots.lower_is_better
    assert slots.ours.n == 1200 and slots.samples == "1200 and 1200 answers"
    assert 0.4 < slots.ours.value < 0.6 and slots.verdict == "ahead"
    assert pooled.pool([{"rounds": rounds("hydra", fast)}]) == []  # llama-server gave none: no figure


def test_each_run_is_judged_as_its_row_judges_it_and_the_control_beside_it():
    """A run meets a paired budget when the median of ours' values over the median of
    llama-server's does (ties on the limit met); the control is judged the same way."""
    runs = [_samples([1.00, 1.02, 0.90, 1.01], [0.95, 1.10, 0.98], control=[0.99, 0.98, 1.02]),
            _samples([0.97, 0.99, 0.98], [1.00, 1.00, 1.01], control=[1.01, 1.03, 1.00]),
            {"pairs": {"ttft": _pairs([0.90], theirs=30.0)}}]  # a run from before the one-stream pairs
    one, ttft = pooled.run_verdicts(runs)
    assert one.ours == pytest.approx((1.005, 0.98)) and one.control == pytest.approx((0.99, 1.01))
    assert one.met(one.ours) == "1/2 (1.005, 0.980)" and one.met(one.control) == "1/2 (0.990, 1.010)"
    assert ttft.ours == pytest.approx((0.98, 1.0, 0.9))
    assert ttft.met(ttft.ours) == "3/3 (0.980, 1.000, 0.900)"  # at most 1.0: 1.000 meets it
    assert ttft.met(ttft.control) == "—" and ttft.budget == "≤ 1.0× llama-server"
    table = pooled.run_verdicts_markdown([one, ttft]).splitlines()
    assert table[-2] == ("| one stream, alternating request by request, decode tok/s | ≥ 1.0× llama-server "
                         "| 1/2 (1.005, 0.980) | 1/2 (0.990, 1.010) |")
