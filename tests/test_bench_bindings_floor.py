"""tools.bench.bindings_floor's arithmetic: where the servers end a prompt's decodes, and the
figures over llama-server's round by round."""
from __future__ import annotations

import pytest

from tools.bench.bindings_floor import chunk_ends, runs_table, summarize


@pytest.mark.parametrize("n, checkpoints, ends", [
    (1709, True, [1193, 1705, 1709]),  # Gemma's cold document: the checkpoints' two stops, then the end
    (1709, False, [1709]),             # no checkpoints: one batch of up to n_batch tokens
    (5000, False, [2048, 4096, 5000]),
    (5000, True, [2048, 4096, 4484, 4996, 5000]),
    (300, True, [296, 300]),           # shorter than 4 + n_ubatch: only the stop 4 before the end
])
def test_the_chunks_end_where_the_servers_end_theirs(n, checkpoints, ends):
    assert chunk_ends(n, checkpoints, n_batch=2048, n_ubatch=512) == ends


def test_each_figure_is_given_over_llama_servers_in_the_same_round():
    rounds = [{"llama-server": {"prompt_ms": 100.0, "tok_s": 50.0}, "bare": {"prompt_ms": 110.0, "tok_s": 50.0},
               "ours": {"prompt_ms": 120.0, "tok_s": 45.0}},
              {"llama-server": {"prompt_ms": 200.0, "tok_s": 40.0}, "bare": {"prompt_ms": 200.0, "tok_s": 44.0},
               "ours": {"prompt_ms": 190.0, "tok_s": 40.0}}]
    s = summarize(rounds)
    assert s["prompt_ms"]["bare_ratio"] == {"median": pytest.approx(1.05), "min": 1.0, "max": pytest.approx(1.1)}
    assert s["prompt_ms"]["ours_ratio"]["min"] == pytest.approx(0.95)
    assert s["tok_s"]["ours_ratio"]["max"] == pytest.approx(1.0) and s["tok_s"]["llama-server"] == 45.0
    table = runs_table([{"rounds": 2, "summary": s}])
    assert "| cold document, prompt ms | 2 | 150.0 | 155.0 | 155.0 | 1.050 (1.000–1.100) | 1.075 (0.950–1.200) |" in table
