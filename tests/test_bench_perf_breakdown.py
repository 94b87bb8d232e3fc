"""tools.bench.perf_breakdown: perf's report summed into kinds of work."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tools.bench.perf_breakdown import KINDS, OTHER, kinds, perf_missing, sample

# the shape of `perf report --stdio --sort dso,sym`: ours' wheel hides tinyBLAS's names
REPORT = """\
# Samples: 2K of event 'cpu-clock:ppp'
#
# Overhead  Shared Object             Symbol
# ........  ........................  ......
#
    27.36%  libc.so.6                 [.] __memmove_avx512_unaligned_erms
    20.76%  libggml-cpu.so.0          [.] ggml_compute_forward_get_rows
     8.50%  libggml-cpu.so.0          [.] ggml_compute_forward_gated_delta_net
     6.52%  libggml-cpu.so.0          [.] ggml_vec_dot_f32
     4.36%  libggml-cpu.so.0          [.] 0x00000000000e484d
     4.43%  libgomp.so.1.0.0          [.] 0x000000000001f7da
     1.20%  llama-server              [.] ggml_compute_forward_flash_attn_ext
     0.50%  libpython3.11.so.1.0      [.] _PyEval_EvalFrameDefault
     0.80%  [kernel.kallsyms]         [k] clear_page_erms
     0.30%  libllama.so               [.] llama_batch_allocr::init
"""


def test_a_report_is_summed_into_its_kinds_of_work():
    shares = kinds(REPORT)
    assert list(shares) == [*(name for name, _ in KINDS), OTHER]
    by_start = {name.split(" (")[0]: v for name, v in shares.items()}
    assert by_start == {"state copies": 48.12, "matrix products": 10.88, "recurrent ops": 8.5, "attention": 1.2,
                        "OpenMP waits": 4.43, "Python": 0.5, "kernel": 0.8, OTHER: 0.3}


def test_no_perf_is_said_not_guessed(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert "not installed" in perf_missing()


@pytest.mark.skipif(perf_missing() is not None, reason="perf cannot sample a process here")
def test_perf_samples_a_real_process_into_kinds():
    burn = subprocess.Popen([sys.executable, "-c", "while True: sum(range(10000))"])
    try:
        with tempfile.TemporaryDirectory() as tmp:
            shares = asyncio.run(asyncio.wait_for(sample(burn.pid, 1.0, Path(tmp)), 60))
    finally:
        burn.kill()
        burn.wait()
    assert shares["Python"] > 50.0 and sum(shares.values()) == pytest.approx(100.0, abs=1.0)
