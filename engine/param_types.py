"""How one engine parameter is typed: llama.cpp's string → number conversions, :class:`Param`
and the per-kind validators for JSON values and command-line text.

The table of parameters itself and the lookup by CONFIGURE key are in engine/params_table.py,
which re-exports every public name of this module.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from codec.seqstate import KV_TYPE_BLOCKS


class ParamError(ValueError):
    """A value of the wrong type or out of range; ``reason`` names the key and what it accepts."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(reason)
        self.key = key
        self.reason = reason


class UnknownParam(ParamError):
    """No parameter has this name."""


I32_MIN, I32_MAX = -(2**31), 2**31 - 1
MAX_CTX = 1 << 24  # positions are i32 and a KV cache of 16M cells is already far beyond any host here
TRUTHY = ("on", "enabled", "true", "1")
FALSEY = ("off", "disabled", "false", "0")
AUTOY = ("auto", "-1")
#: llama.cpp's ``kv_cache_types`` (common/arg.cpp), in its order.
KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
assert set(KV_CACHE_TYPES) == set(KV_TYPE_BLOCKS)
GPU_LAYERS_AUTO, GPU_LAYERS_ALL = -1, -2  # llama.cpp's encoding of "auto" / "all"
MAX_TEXT = 1 << 20  # inline chat templates and JSON kwargs

# ---- llama.cpp's string → number conversions ---------------------------------------------------

_WS = "[ \t\n\v\f\r]*"  # C isspace
_INT_RE = re.compile(_WS + r"([+-]?[0-9]+)")
_FLOAT_RE = re.compile(
    _WS + r"([+-]?(?:0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)(?:[pP][+-]?[0-9]+)?"
    r"|(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|(?i:inf(?:inity)?|nan(?:\([0-9A-Za-z_]*\))?)))"
)
_F32_MAX = 3.4028234663852886e38


def stoi(text: str) -> int:
    """``std::stoi``: leading blanks, a sign and digits; the rest of the text is ignored."""
    m = _INT_RE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a number")
    v = int(m.group(1))
    if not I32_MIN <= v <= I32_MAX:
        raise ValueError(f"{text!r} is out of range for an int")
    return v


def stoul32(text: str) -> int:
    """``std::stoul`` stored into a ``uint32_t`` (llama.cpp's seed): ``-1`` wraps to 0xffffffff."""
    m = _INT_RE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a number")
    v = int(m.group(1))
    if abs(v) >= 1 << 64:
        raise ValueError(f"{text!r} is out of range for an unsigned long")
    return v % (1 << 32)


def stod(text: str) -> float:
    """``std::stod``: the longest float prefix (decimal, hex, inf, nan)."""
    m = _FLOAT_RE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a number")
    s = m.group(1)
    low = s.lower().lstrip("+-")
    # float() reads decimal, inf and infinity; hex and nan(payload) need their own path
    v = float.fromhex(s) if low.startswith("0x") else math.nan if low.startswith("nan") else float(s)
    if math.isinf(v) and "inf" not in low:
        raise ValueError(f"{text!r} is out of range for a double")
    return v


def stof(text: str) -> float:
    """``std::stof``: :func:`stod` into a float; ERANGE → error."""
    v = stod(text)
    if math.isfinite(v) and abs(v) > _F32_MAX:
        raise ValueError(f"{text!r} is out of range for a float")
    return v


#: llama.cpp's conversions by name (the generated table says which one a string argument uses)
CONVERSIONS = {"stoi": stoi, "stoul": stoul32, "stof": stof, "stod": stod}


def onoffauto(text: str) -> str | None:
    """llama.cpp's ``is_truthy`` / ``is_falsey`` / ``is_autoy`` → "on" / "off" / "auto"."""
    return "on" if text in TRUTHY else "off" if text in FALSEY else "auto" if text in AUTOY else None


# ---- one parameter -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Param:
    key: str  # the CONFIGURE / hydra_config key (for startup-only parameters: the settings field)
    cli: tuple[str, ...]  # llama.cpp spellings (short forms first, as in arg.cpp)
    kind: str
    tier: str
    default: Any = None
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()  # other JSON keys for the same parameter
    refused: tuple[int, ...] = ()  # values inside the range that llama.cpp refuses (``--parallel 0``)
    repeat: bool = False  # each command-line occurrence adds to a list (``-r``, ``-ot``, ``-a``)
    clamp: bool = False  # llama.cpp clamps into [lo, hi] instead of refusing (``--temp``)
    config: bool = True  # has a CONFIGURE key (False: command line only)

    # -- JSON ------------------------------------------------------------------------------
    def validate(self, value: Any) -> Any:
        """The typed value of a JSON ``value``, or ParamError naming what the key accepts."""
        return _JSON[self.kind](self, value)

    # -- command line / environment -----------------------------------------------------------
    def parse_cli(self, text: str) -> Any:
        """The typed value of command-line or ``LLAMA_ARG_*`` text, converted like llama.cpp."""
        try:
            return _CLI[self.kind](self, text)
        except ValueError as e:
            if isinstance(e, ParamError):
                raise
            raise ParamError(self.key, f"{self.key}: {e}") from None

    def fail(self, what: str) -> ParamError:
        return ParamError(self.key, f"{self.key} must be {what}")

    def _range(self, v: float) -> float:
        lo = self.lo if self.lo is not None else -math.inf
        hi = self.hi if self.hi is not None else math.inf
        if isinstance(v, float) and math.isnan(v) or not lo <= v <= hi:
            if self.clamp and not math.isnan(v):
                return type(v)(min(max(v, lo), hi))
            raise self.fail(f"{_describe_range(self)}, got {v!r}")
        return v


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def _describe_range(p: Param) -> str:
    kind = "an integer" if p.kind == "int" else "a finite number"
    if p.lo is not None and p.hi is not None:
        return f"{kind} in [{_num(p.lo)}, {_num(p.hi)}]"
    return f"{kind} >= {_num(p.lo)}" if p.lo is not None else kind


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return _is_int(v) or isinstance(v, float)


def _j_int(p: Param, v: Any) -> int:
    if not _is_int(v):
        raise p.fail(f"{_describe_range(p)} (got {type(v).__name__})")
    if v in p.refused:
        raise p.fail(f"{_describe_range(p)} other than {v}")
    return int(p._range(v))


def _j_float(p: Param, v: Any) -> float:
    if not _is_num(v) or not math.isfinite(v):
        raise p.fail(f"{_describe_range(p)} (got {v!r})")
    return float(p._range(float(v)))


def _j_seed(p: Param, v: Any) -> int:
    if not _is_int(v) or not -1 <= v <= 0xFFFFFFFF:
        raise p.fail("an integer in [-1, 4294967295] (-1 = random)")
    return v % (1 << 32)


def _j_bool(p: Param, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v in TRUTHY + FALSEY:
        return v in TRUTHY
    raise p.fail("a bool (or one of on|off|true|false|1|0)")


def _j_onoffauto(p: Param, v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    if _is_int(v) and v in (-1, 0, 1):  # llama.cpp's text forms "1", "0", "-1"
        v = str(v)
    s = onoffauto(v) if isinstance(v, str) else None
    if s is None:
        raise p.fail("one of on|off|auto (1|0|-1) or a bool")
    return s


def _j_enum(p: Param, v: Any) -> str:
    if not isinstance(v, str) or v not in p.choices:
        raise p.fail(f"one of {'|'.join(p.choices)}")
    return v


def _j_str(p: Param, v: Any) -> str:
    if not isinstance(v, str) or not v or len(v) > (p.hi or MAX_TEXT):
        raise p.fail(f"a non-empty string of at most {int(p.hi or MAX_TEXT)} characters")
    if "\0" in v:
        raise p.fail("a string without NUL characters")
    return v


def _j_model(p: Param, v: Any) -> str:
    if isinstance(v, dict) and set(v) == {"path"}:
        v = v["path"]
    return _j_str(p, v)


def _j_gpu_layers(p: Param, v: Any) -> int:
    if isinstance(v, str) and v in ("auto", "all"):
        return GPU_LAYERS_AUTO if v == "auto" else GPU_LAYERS_ALL
    if _is_int(v) and GPU_LAYERS_ALL <= v <= I32_MAX:
        return v
    raise p.fail("a number of layers, 'auto' or 'all'")


def _items(p: Param, v: Any, seps: str) -> list[str]:
    if isinstance(v, str):
        parts = re.split(f"[{seps}]", v)
    elif isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v):
        parts = [x for item in v for x in re.split(f"[{seps}]", item)]
    else:
        raise p.fail("a string or a list of strings")
    return [x.strip() for x in parts if x.strip()]


def _j_str_list(p: Param, v: Any) -> tuple[str, ...]:
    return tuple(_items(p, v, ","))


def _j_hostports(p: Param, v: Any) -> tuple[str, ...]:
    out = _items(p, v, ",")
    for ep in out:
        host, sep, port = ep.rpartition(":")
        if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) <= 65535:
            raise p.fail(f"HOST:PORT[,HOST:PORT...], got {ep[:80]!r}")
    if not out:
        raise p.fail("HOST:PORT[,HOST:PORT...]")
    return tuple(out)


def _j_overrides(p: Param, v: Any) -> tuple[tuple[str, str], ...]:
    # llama.cpp splits on ","; the C# client joins with "\n": both separate overrides here
    out = []
    for item in _items(p, v, ",\n"):
        pattern, sep, buft = item.partition("=")
        if not sep or not pattern or not buft:
            raise p.fail(f"<tensor name pattern>=<buffer type>[,...], got {item[:80]!r}")
        try:
            re.compile(pattern)
        except re.error as e:
            raise p.fail(f"a valid tensor name pattern ({pattern[:80]!r}: {e})") from None
        out.append((pattern, buft))
    return tuple(out)


def _j_float_list(p: Param, v: Any) -> tuple[float, ...]:
    if isinstance(v, list) and all(_is_num(x) for x in v):
        vals = [float(x) for x in v]
    elif isinstance(v, str):
        try:
            vals = [stof(x) for x in re.split(r"[,/]+", v) if x]
        except ValueError as e:
            raise p.fail(f"a list of numbers ({e})") from None
    else:
        raise p.fail("a list of numbers or a string N0,N1,...")
    if not vals or not all(math.isfinite(x) and x >= 0 for x in vals):
        raise p.fail("a non-empty list of finite numbers >= 0")
    return tuple(vals)


def _j_json_object(p: Param, v: Any) -> dict:
    if isinstance(v, str):
        if len(v) > MAX_TEXT:
            raise p.fail(f"a JSON object of at most {MAX_TEXT} bytes")
        try:
            v = json.loads(v)
        except (ValueError, RecursionError) as e:
            raise p.fail(f"a valid JSON object ({str(e)[:80]})") from None
    if not isinstance(v, dict):
        raise p.fail("a JSON object")
    return v


_JSON = {
    "int": _j_int, "float": _j_float, "seed": _j_seed, "bool": _j_bool, "onoffauto": _j_onoffauto,
    "enum": _j_enum, "str": _j_str, "model": _j_model, "gpu_layers": _j_gpu_layers, "str_list": _j_str_list,
    "hostports": _j_hostports, "overrides": _j_overrides, "float_list": _j_float_list, "json_object": _j_json_object,
}


def _c_onoffauto(p: Param, text: str) -> str:
    v = onoffauto(text)
    if v is None:
        raise p.fail(f"one of on|off|auto, got {text[:40]!r}")
    return v


def _c_gpu_layers(p: Param, text: str) -> int:
    if text in ("auto", "all"):
        return _j_gpu_layers(p, text)
    try:
        return _j_gpu_layers(p, stoi(text))
    except ValueError:
        raise p.fail(f"a number of layers, 'auto' or 'all', got {text[:40]!r}") from None


_CLI = {
    "int": lambda p, t: _j_int(p, stoi(t)), "float": lambda p, t: _j_float(p, stof(t)),
    "seed": lambda p, t: stoul32(t), "bool": _j_bool, "onoffauto": _c_onoffauto, "enum": _j_enum, "str": _j_str,
    "model": _j_str, "gpu_layers": _c_gpu_layers, "str_list": _j_str_list, "hostports": _j_hostports,
    "overrides": _j_overrides, "float_list": _j_float_list, "json_object": _j_json_object,
}
