"""CONFIGURE and PREFILL ``hydra_config`` values mutated by type and range.

A value llama.cpp asserts on (``{"flash_attn": 7}``), a size it allocates by (``n_ctx``
2^31), a divisor (``rope_scale`` 0): one such value used to take the whole process down. For
every key of the engine's typed parameter table this family sends the edges of its range and
one step past them, values of every other JSON type, and JSON only a hostile client writes
(``1e400``, ``NaN``, 5000 digits) — in a CONFIGURE and in a PREFILL's ``hydra_config``. What
it must get back is a reply (applied, or the key in ``rejected_keys``, or an error); the
process-death oracle (``--spawn``) and the memory oracle catch the rest.

Values that would make the target read files are kept harmless (model paths that do not
exist), and ``rpc_servers`` only names a closed loopback port.
"""
from __future__ import annotations

import json
import random

from codec.enums import Op
from engine.params_table import I32_MAX, I32_MIN, PARAMS, Param

from .mutators import Family, Mutation, burst, frame
from .templates import Template

OTHER_TYPES = ('"x"', "true", "null", "[]", "{}", "-1", "1.5")
HOSTILE_JSON = ("1e400", "-1e400", "NaN", "1" * 5000, '"\\u0000"')
TYPE_EDGES = {
    "bool": ("2", '"true"', "0", "1", "true", "false"),
    "onoffauto": ("7", "2", "-1", '"maybe"', "0", "1", '"on"', '"off"', '"auto"'),
    "seed": ("-1", "0", "4294967295", "4294967296", "-2", "18446744073709551616"),
    "model": ('""', '"/nonexistent/model.gguf"', '"../../x.gguf"', '"' + "m" * 5000 + '"'),
    "str": ('""', '"' + "t" * 70000 + '"', '"{{ x }}"'),
    "hostports": ('"127.0.0.1:1"', '""', '["127.0.0.1:1"]', '"nohost"', "5"),
    "str_list": ("[]", '["a"]', '["a", 5]', '"a"'),
    "overrides": ('"x=CPU"', '"bad"', '["a=b"]'),
    "float_list": ("[1, 0]", "[-1]", '["x"]', "[1e400]"),
    "json_object": ("{}", '{"a": [1]}', '"{}"'),
    "gpu_layers": ('"auto"', '"all"', "-3", "0", "999", "2147483648"),
}


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e18 else repr(float(x))


def range_edges(p: Param) -> list[str]:
    """One step past each bound of a numeric parameter, then the bounds, 0 and -1, as JSON text
    (past the edge first: those are the values that used to reach llama.cpp unchecked)."""
    lo = p.lo if p.lo is not None else (I32_MIN if p.kind == "int" else None)
    hi = p.hi if p.hi is not None else (I32_MAX if p.kind == "int" else None)
    step = 1 if p.kind == "int" else None
    past, edges = [], []
    for edge, sign in ((hi, 1), (lo, -1)):
        if edge is not None:
            past.append(_number(edge + sign * (step or max(1.0, abs(edge)))))
            edges.append(_number(edge))
    extra = [str(2**31), str(2**63), "1.5"] if p.kind == "int" else ["3.5e38", "1e-320", "1e38"]
    return list(dict.fromkeys(past + ["0", "-1"] + extra + edges))


def values_for(p: Param) -> list[str]:
    """JSON texts for one parameter: its own edges first, then the other types and hostile JSON."""
    if p.kind in ("int", "float"):
        own = range_edges(p)
    elif p.kind == "enum":
        own = [json.dumps(c) for c in p.choices] + ['""', '"bogus"', "0"]
    else:
        own = list(TYPE_EDGES.get(p.kind, ()))
    return list(dict.fromkeys(own + list(OTHER_TYPES) + list(HOSTILE_JSON)))


def config_cases() -> list[tuple[str, str]]:
    """(key, JSON text of its value) for every CONFIGURE key, each value once: every key's first
    value, then every key's second, … so each key meets its worst values early."""
    per_key = [(p.key, values_for(p)) for p in PARAMS if p.config]
    depth = max(len(vs) for _, vs in per_key)
    return [(key, vs[i]) for i in range(depth) for key, vs in per_key if i < len(vs)]


def _body(key: str, value: str, hydra_config: bool) -> bytes:
    obj = '{"%s":%s}' % (key, value)
    if hydra_config:
        return ('{"prompt":"x","hydra_config":%s}' % obj).encode("utf-8", "surrogatepass")
    return obj.encode("utf-8", "surrogatepass")


class ConfigValues(Family):
    """One CONFIGURE key per case, its value mutated by type and range; the sweep sends each in
    a CONFIGURE, the random phase also in a PREFILL's ``hydra_config``."""

    name = "config.values"

    def __init__(self) -> None:
        self._cases = config_cases()

    def applies(self, tp: Template) -> bool:
        return tp.name in ("CONFIGURE.empty", "PREFILL.prompt")

    def variants(self, tp: Template) -> int:
        return len(self._cases) if tp.op == Op.CONFIGURE else 0

    def make(self, tp: Template, variant: int, rng: random.Random) -> Mutation:
        key, value = self._cases[variant % len(self._cases)]
        hydra_config = tp.op == Op.PREFILL
        where = "PREFILL hydra_config" if hydra_config else "CONFIGURE"
        return Mutation(self.name, f"{where} {key}={value[:24]}",
                        burst(frame(tp.op, tp.key, _body(key, value, hydra_config), tp.trace)),
                        f"{where} {key}", value[:48] + ("…" if len(value) > 48 else ""))

    def random(self, tp: Template, rng: random.Random) -> Mutation:
        return self.make(tp, rng.randrange(len(self._cases)), rng)
