"""What the order of a batch's sequences costs llama.cpp, in CPU per decode step.

    python -m tools.bench.stream_order [--model gemma-270m] [--steps 120] [--rounds 3]

Four sequences on a context with one KV stream each (``kv_unified`` off, as llama-server's
``-np 4``), one token each per step, one compute thread so that the inference thread's CPU
time is the step's work whatever else the host runs. Rounds alternate a batch in ascending
sequence order (what ``LlamaBatch.fill`` writes) and the same batch in the order 1, 2, 3, 0
(what a server that lists running jobs by arrival wrote once conversations had moved between
slots). Prints one JSON object: CPU and wall ms per step for each order, per round.
"""
from __future__ import annotations

import argparse
import json
import time

from engine.llama_backend import BatchItem, LoadedModel
from engine.model_files import resolve_model
from engine.sampling import SamplerParams

ORDERS = {"ascending": [0, 1, 2, 3], "1-2-3-0": [1, 2, 3, 0]}


def steps(model: LoadedModel, order: list[int], n: int) -> dict[str, float]:
    """Prefill a story per sequence, then ``n`` greedy steps with the batch rows in ``order``."""
    pos, last = {}, {}
    for s in order:
        model.seq_clear(s)
    toks = {s: model.tokenize(f"Story number {s}: once upon a time") for s in order}
    model.decode([BatchItem(s, toks[s], 0) for s in order])
    samplers = {s: model.make_sampler(SamplerParams(temperature=0)) for s in order}
    for s in order:
        pos[s], last[s] = len(toks[s]), model.sample(s, samplers[s])
    cpu = wall = 0.0
    for _ in range(n):
        items = [BatchItem(s, [last[s]], pos[s]) for s in order]
        c0, w0 = time.thread_time(), time.perf_counter()
        model.decode(items, keep_order=True)
        cpu, wall = cpu + time.thread_time() - c0, wall + time.perf_counter() - w0
        for s in order:
            pos[s] += 1
            last[s] = model.sample(s, samplers[s])
    for sm in samplers.values():
        sm.free()
    return {"cpu_ms_per_step": round(cpu / n * 1000, 2), "wall_ms_per_step": round(wall / n * 1000, 2)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma-270m")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    model = LoadedModel(str(resolve_model(args.model)), n_ctx=8192, n_seq_max=4, n_threads=1, kv_unified=False)
    try:
        rounds = [{name: steps(model, order, args.steps) for name, order in ORDERS.items()}
                  for _ in range(args.rounds)]
    finally:
        model.close()
    print(json.dumps({"model": args.model, "steps": args.steps, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
