"""What a decode costs right after the host left the process idle: llama.cpp alone, no server.

    python -m tools.bench.idle_decode [--model tiny-small] [--gaps 0,0.5,2,10] [--decodes 150]
                                      [--busy-before 0,300] [--threads 1,2] [--out FILE]

A short request's first token is mostly one decode of a few tokens, and on a virtual machine
what the vCPU's caches held can be gone after a few milliseconds of idleness. This times one
``llama_decode`` of the last ``--tokens`` tokens of a short prompt (the rest kept in the KV
cache, as both servers keep a common prefix) after ``gap`` ms of ``time.sleep``, for each
thread count; ``--busy-before`` first spins the calling thread for that many µs, which brings a
halted vCPU back up but reloads none of what was evicted — so a decode that stays slow with it
lost its caches, not its CPU's wake-up. Reports the median, 10th and 90th percentile (µs) of
every setting and the ratio of each median to the same thread count's back-to-back decode.
Prints (and with ``--out`` writes) one JSON object.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from engine.backend import BatchItem
from engine.llama_backend.model import LoadedModel
from engine.model_files import resolve_model
from tools.bench.common import git_commit, machine_info, p10_median_p90, result_json, write_run

PROMPT = "A list of rivers, number 731:"


def _spin(us: float) -> None:
    end = time.perf_counter_ns() + int(us * 1000)
    while time.perf_counter_ns() < end:
        pass


def _decodes(model: LoadedModel, tokens: list[int], k: int, gap_ms: float, busy_us: float, n: int) -> list[float]:
    keep = len(tokens) - k
    out = []
    for _ in range(n):
        model.seq_rm(0, keep, -1)
        if gap_ms:
            time.sleep(gap_ms / 1000)
        if busy_us:
            _spin(busy_us)
        t0 = time.perf_counter_ns()
        model.decode([BatchItem(0, tokens[keep:], keep)])
        out.append((time.perf_counter_ns() - t0) / 1000)
    return out


def measure(model_path: str, threads: list[int], gaps: list[float], busy: list[float], k: int,
            n: int) -> list[dict[str, Any]]:
    model = LoadedModel(model_path, n_ctx=2048, n_threads=max(threads), n_seq_max=1)
    try:
        tokens = model.tokenize(PROMPT, add_special=True)
        if not 0 < k < len(tokens):
            raise SystemExit(f"--tokens must be 1..{len(tokens) - 1} for this prompt")
        model.decode([BatchItem(0, tokens, 0)])
        rows = []
        for t in threads:
            model.set_threads(t)
            _decodes(model, tokens, k, 0, 0, 20)  # settle at this thread count
            base = None
            for gap in gaps:
                for b in busy:
                    s = p10_median_p90(_decodes(model, tokens, k, gap, b, n))
                    if base is None:
                        base = s["median"]
                    rows.append({"threads": t, "gap_ms": gap, "busy_before_us": b, **s,
                                 "ratio": round(s["median"] / base, 3)})
        return rows
    finally:
        model.close()


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.idle_decode", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-small", help="a model name the engine resolves, or a GGUF path")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--gaps", default="0,0.5,2,10", help="ms of idleness before each decode")
    ap.add_argument("--busy-before", default="0,300", help="µs the thread spins after the gap")
    ap.add_argument("--tokens", type=int, default=4, help="tokens decoded (the prompt's last ones)")
    ap.add_argument("--decodes", type=int, default=150, help="decodes per setting")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = measure(str(resolve_model(args.model)), [int(t) for t in _floats(args.threads)], _floats(args.gaps),
                   _floats(args.busy_before), args.tokens, args.decodes)
    result = {"machine": {**machine_info(), "git_commit": git_commit()}, "model": args.model,
              "tokens": args.tokens, "decodes": args.decodes, "rows": rows}
    print(result_json(result), end="")
    write_run(args.out, result)
    return result


if __name__ == "__main__":
    main()
