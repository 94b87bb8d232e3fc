"""Which case has which index: ``case_at(seed, index, settings)``.

Pure: the case at (seed, index) depends on nothing else (no global RNG, no target
answers — boofuzz #115), so ``--seed S --index I`` re-creates any case and the same seed
always gives the same sequence. Order, cheap and decisive first:

1. **smoke** — every template once, unmodified (valid requests for every opcode/dialect);
2. **sweep** — every mutation family's finite variant list, merged round-robin, so the first
   few dozen cases already hit each family once (op sweep with a smuggled canary, huge
   payload_len, v3 header hash, …) and no family waits behind a long one;
3. **random** — unbounded: a seeded family + template + random variant per index, with a
   stateful step program every ``STATEFUL_EVERY``-th case.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from . import config_mutators as CM
from . import mutators as M
from . import payload_mutators as PM
from . import stateful
from .cases import Case
from .templates import Template, build_templates

STATEFUL_EVERY = 8
STATEFUL_SWEEP = 12  # seeded programs inside the sweep


@dataclass(frozen=True)
class GenSettings:
    slots: int = 2  # slots the stateful programs and keys may use (0..slots-1)


def rng_for(seed: int, index: int) -> random.Random:
    # A string seed goes through SHA-512 in CPython: stable across processes and versions
    # (unlike hash()), and independent streams for neighbouring indexes.
    return random.Random(f"hydra-fuzz:{seed}:{index}")


class _Families:
    def __init__(self, templates: list[Template]):
        self.templates = templates
        # The order is the sweep's round-robin order: the most decisive families first.
        self.sweep_order: list[M.Family] = [
            M.OpSweep(), M.LengthLie("payload_len", huge=True), PM.V3Rules(), PM.KvBlobCorruption(),
            M.Truncate(), M.LengthLie("payload_len"), M.Key(), M.LengthLie("key_len"), M.LengthLie("trace_len"),
            PM.JsonStructure(), CM.ConfigValues(), M.Magic(), M.Flags(), M.Trace(), PM.SwapQuant(), PM.Dialect(),
            M.Pipeline(templates), M.Dribble(), M.Abrupt(),
        ]
        self.random_only: list[M.Family] = [M.Havoc(), M.RandomPayload()]
        # Random-phase weights: structure-aware families get more turns than blind havoc.
        self.weights = {"op.sweep": 2, "payload_len.huge": 1, "v3.rules": 3, "kvblob": 3, "truncate": 2,
                        "payload_len.lie": 3, "key": 2, "key_len.lie": 1, "trace_len.lie": 1, "json": 5, "config.values": 3,
                        "magic": 1, "flags": 1, "trace": 1, "swap_quant": 1, "dialect": 2, "pipeline": 3,
                        "dribble": 1, "abrupt": 2, "havoc": 5, "payload.random": 3}

    def applicable(self, fam: M.Family) -> list[Template]:
        tps = [t for t in self.templates if fam.applies(t)]
        if fam.per_op:
            seen: set[int] = set()
            tps = [t for t in tps if not (t.op in seen or seen.add(t.op))]
        if isinstance(fam, M.LengthLie) and fam.huge:
            # payload-reading opcodes first: that is where a huge length hurts an engine
            tps.sort(key=lambda t: (t.kind == "none", t.generation))
        return tps


@lru_cache(maxsize=8)
def _plan(settings: GenSettings) -> tuple[list[Template], _Families, tuple[tuple[str, int, int], ...]]:
    templates = build_templates(settings.slots)
    fams = _Families(templates)
    lists: list[list[tuple[str, int, int]]] = []
    names = {t.name: i for i, t in enumerate(templates)}
    for f_idx, fam in enumerate(fams.sweep_order):
        entries = []
        for tp in fams.applicable(fam):
            picks = fam.sweep_variants(tp) if hasattr(fam, "sweep_variants") else range(fam.variants(tp))
            entries += [(fam.name, names[tp.name], v) for v in picks]
        lists.append(entries)
    lists.append([("stateful", -1, v) for v in range(STATEFUL_SWEEP)])
    merged: list[tuple[str, int, int]] = []
    depth = max(len(x) for x in lists)
    for i in range(depth):
        for entries in lists:
            if i < len(entries):
                merged.append(entries[i])
    return templates, fams, tuple(merged)


def phase_sizes(settings: GenSettings = GenSettings()) -> tuple[int, int]:
    """(number of smoke cases, number of sweep cases)."""
    templates, _, sweep = _plan(settings)
    return len(templates), len(sweep)


def _family(fams: _Families, name: str) -> M.Family:
    for fam in fams.sweep_order + fams.random_only:
        if fam.name == name:
            return fam
    raise KeyError(name)


def case_at(seed: int, index: int, settings: GenSettings = GenSettings()) -> Case:
    templates, fams, sweep = _plan(settings)
    rng = rng_for(seed, index)
    n_smoke = len(templates)
    if index < n_smoke:
        tp = templates[index]
        return Case(seed, index, "smoke", "smoke", f"valid {tp.name}", messages=M.burst(tp.encode()))
    j = index - n_smoke
    if j < len(sweep):
        fam_name, t_idx, variant = sweep[j]
        if fam_name == "stateful":
            return stateful_case(seed, index, "sweep", rng, settings)
        mut = _family(fams, fam_name).make(templates[t_idx], variant, rng)
        return _to_case(seed, index, "sweep", mut)
    if j % STATEFUL_EVERY == STATEFUL_EVERY - 1:
        return stateful_case(seed, index, "random", rng, settings)
    families = fams.sweep_order + fams.random_only
    fam = rng.choices(families, weights=[fams.weights.get(f.name, 1) for f in families])[0]
    tp = rng.choice(fams.applicable(fam) or templates)
    return _to_case(seed, index, "random", fam.random(tp, rng))


def _to_case(seed: int, index: int, phase: str, mut: M.Mutation) -> Case:
    mutated = {"field": mut.field, "value": mut.value} if mut.field else None
    return Case(seed, index, phase, mut.generator, mut.note, messages=M.guard_first_byte(mut.messages),
                mutated=mutated)


def stateful_case(seed: int, index: int, phase: str, rng: random.Random, settings: GenSettings) -> Case:
    program = stateful.generate_program(rng, settings.slots)
    return Case(seed, index, phase, "stateful", stateful.describe(program), program=program)
