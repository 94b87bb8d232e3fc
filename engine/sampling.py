"""Sampling parameters, and how a request's own fields override the T1 defaults.

Pure data: the wire layer builds these without touching llama.cpp; the llama backend turns
them into a sampler chain.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping


class GrammarExhausted(RuntimeError):
    """The grammar allows no token at this step (e.g. the vocabulary cannot spell what it
    requires). Nothing was accepted: the generation must end here (finish reason "grammar")."""


@dataclass(frozen=True)
class GrammarSpec:
    """A GBNF grammar the sampled text must follow.

    ``lazy``: the grammar applies only from the first match of a trigger on: a regex of
    ``trigger_patterns`` (searched in the generated text; anchored as a whole-text match when
    it starts with ``^`` and ends with ``$``; the grammar sees the text from the first
    non-empty capture group on) or a token of ``trigger_tokens``.
    """

    text: str
    root: str = "root"
    lazy: bool = False
    trigger_patterns: tuple[str, ...] = ()
    trigger_tokens: tuple[int, ...] = ()
    # a prompt that opened a think block: the grammar applies once the block is closed (the
    # grammars built from tools and schemas); False: from the first token (a client's own GBNF)
    after_think: bool = True


def grammar_nesting(text: str) -> int:
    """Deepest parenthesis nesting of a GBNF text, ignoring literals, classes and comments."""
    depth = deepest = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"[":  # a literal or character class: skip to its unescaped end
            close = '"' if c == '"' else "]"
            i += 1
            while i < n and text[i] != close:
                i += 2 if text[i] == "\\" else 1
        elif c == "#":
            while i < n and text[i] not in "\r\n":
                i += 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        i += 1
    return deepest


@dataclass(frozen=True)
class SamplerParams:
    """Sampling parameters. ``temperature <= 0`` means greedy (argmax)."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None  # None: a random seed
    penalty_repeat: float = 1.0  # 1.0 = off
    penalty_last_n: int = 64
    penalty_freq: float = 0.0  # 0.0 = off
    penalty_present: float = 0.0  # 0.0 = off
    grammar: GrammarSpec | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias); -inf bans the token
    n_probs: int = 0  # > 0: also report the top n (token, logprob) of the raw logits

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalties_enabled(self) -> bool:
        return self.penalty_last_n != 0 and (
            self.penalty_repeat != 1.0 or self.penalty_freq != 0.0 or self.penalty_present != 0.0
        )


GREEDY = SamplerParams(temperature=0.0)

# A request's field names (OpenAI, llama-server and Hydra spellings) → SamplerParams attribute.
# Order matters where two spellings name one attribute: the later one wins ("temp" over
# "temperature"), as the C++ reads them.
REQUEST_FIELDS = {
    "temperature": "temperature", "temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
    "seed": "seed", "repeat_penalty": "penalty_repeat", "penalty_repeat": "penalty_repeat",
    "frequency_penalty": "penalty_freq", "presence_penalty": "penalty_present",
}
_INTEGER = {"top_k", "seed"}


def merge_sampling(t1: Mapping[str, Any], fields: Mapping[str, Any] | None = None, **given: Any) -> SamplerParams:
    """The T1 defaults (CONFIGURE ``sampling.*``), then the request's own numeric fields, then
    ``given`` (SamplerParams attributes, as they are: a grammar, a logit bias).

    Fields of the wrong type are ignored here: each wire dialect validates what it accepts.
    """
    values: dict[str, Any] = {
        "temperature": float(t1.get("sampling.temp", 0.8)),
        "top_k": int(t1.get("sampling.top_k", 40)),
        "top_p": float(t1.get("sampling.top_p", 0.95)),
        "min_p": float(t1.get("sampling.min_p", 0.05)),
        "seed": t1.get("sampling.seed", t1.get("seed")),
        "penalty_repeat": float(t1.get("sampling.penalty_repeat", 1.0)),
    }
    for key, attr in REQUEST_FIELDS.items():
        v = (fields or {}).get(key)
        if v is not None and not isinstance(v, bool) and isinstance(v, (int, float)):
            values[attr] = int(v) if attr in _INTEGER else float(v)
    return SamplerParams(**values, **given)
