"""What a context checkpoint costs on a hybrid model: the capture of a sequence's recurrent
state (llama.cpp's ``PARTIAL_ONLY``) into a new buffer, and into a dropped checkpoint's buffer.

    python -m tools.bench.checkpoint_copy [--model tiny-hybrid-wide] [--reps 15] [--out FILE]
    python -m tools.bench.checkpoint_copy --table DIR     # the runs DIR/run-N.json in one table

One sequence is fed a short prompt on one thread; then, ``--reps`` times each (medians, ms):

* ``new_buffer``: ``seq_state.get_partial`` with no buffer to reuse (the first checkpoints of
  a slot; llama-server's ``std::vector`` resize and copy do the same work);
* ``reused_buffer``: the same into a buffer of the size, as a dropped checkpoint's is reused
  (``engine.checkpoints``: evicted, replaced or pruned ones);
* ``allocation_only``: a new zeroed buffer of the size and a write to each of its pages, nothing
  copied: what the kernel's page faults cost;
* ``extra_copy``: a copy of the captured bytes into a ``bytes`` object, what each capture
  made beyond llama.cpp's own copy before captures went into the kept buffer.

On ``tiny-hybrid-wide`` (Qwen 3.5 35B-A3B's delta net on tiny weights) the state is the
fleet model's ~63 MB. No server and no client: a property of the memory and the copy.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from tools.bench.common import add_run_args, machine_info, min_max_text, table_only, write_run


def _median_ms(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1000)
        del out
    return round(statistics.median(times), 2)


def _touch(buf: bytearray) -> bytearray:
    memoryview(buf)[::4096] = b"\1" * len(range(0, len(buf), 4096))
    return buf


def measure(model_path: str, reps: int) -> dict[str, Any]:
    from engine.llama_backend import BatchItem, LoadedModel
    from engine.llama_backend import seq_state

    with LoadedModel(model_path, n_ctx=512, n_seq_max=1, n_batch=512, n_threads=1) as m:
        m.decode([BatchItem(0, m.tokenize("A list of rivers, with the towns each one passes:"), 0)])
        ctx = m._ctx_handle()
        state = seq_state.get_partial(ctx, 0)
        size = len(state)
        spare = bytearray(size)
        return {"state_bytes": size,
                "new_buffer_ms": _median_ms(lambda: seq_state.get_partial(ctx, 0), reps),
                "reused_buffer_ms": _median_ms(lambda: seq_state.get_partial(ctx, 0, spare), reps),
                "allocation_only_ms": _median_ms(lambda: _touch(bytearray(size)), reps),
                "extra_copy_ms": _median_ms(lambda: bytes(state), reps)}


FIGURES = (("new_buffer_ms", "a capture into a new buffer"), ("reused_buffer_ms", "a capture into a dropped checkpoint's buffer"),
           ("allocation_only_ms", "a new buffer alone (its pages faulted in)"),
           ("extra_copy_ms", "the copy each capture made before (into `bytes`)"))


def runs_table(runs: list[dict[str, Any]]) -> str:
    """Several runs in one Markdown table: each figure's min–max (ms)."""
    sizes = sorted({r["state_bytes"] for r in runs})
    head = f"| {runs[0]['model']}: a recurrent state of {', '.join(f'{b / 1e6:.1f} MB' for b in sizes)} | ms ({len(runs)} runs) |"
    return "\n".join([head, "|---|---|", *(f"| {label} | {min_max_text([r[key] for r in runs], '.1f')} |"
                                                for key, label in FIGURES)])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.checkpoint_copy", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-hybrid-wide", help="a hybrid model: a name resolve_model knows, or a path")
    ap.add_argument("--reps", type=int, default=15)
    add_run_args(ap)
    args = ap.parse_args(argv)
    if (shown := table_only(args, runs_table)) is not None:
        return shown
    from engine.model_files import resolve_model

    path = resolve_model(args.model)
    result = {"machine": machine_info(), "model": args.model, "model_file": path.name, "reps": args.reps,
              **measure(str(path), args.reps)}
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}))
    write_run(args.out, result)
    return result


if __name__ == "__main__":
    main()
