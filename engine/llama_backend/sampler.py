"""llama.cpp sampler chains built from :class:`engine.sampling.SamplerParams`, and how a token is
drawn from one: by ``llama_sampler_sample`` alone, or (a grammar, a logit bias) from numpy
candidates with the grammar kept outside the chain (:func:`sample_row`)."""
from __future__ import annotations

import ctypes
import math
import random
import threading
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np

import llama_cpp.llama_cpp as L

from ..sampling import GrammarExhausted, SamplerParams
from .grammar_sampler import TOKEN_DATA, GrammarConstraint, token_array
from .runtime import LlamaBackendError

if TYPE_CHECKING:
    from ..backend import ModelBackend
    from .model_text import ModelText

LLAMA_DEFAULT_SEED = 0xFFFFFFFF
# A sampled request without a seed gets one from here. Given LLAMA_DEFAULT_SEED, llama.cpp
# draws its own from std::random_device: 22 µs a request (2 µs with a seed), on the inference
# thread, on the path of the first token. This generator is seeded once from the OS.
_SEEDS = random.Random()
MAX_RESAMPLES = 8
# when the sampled token is refused, the grammar first judges only this many most likely
# candidates (all of them only if it allows none): a whole vocabulary is 262,144 tokens on Gemma
SHORTLIST = 32


class Sampler:
    """A llama.cpp sampler chain. Not thread-safe; one per generating sequence.

    :meth:`sample` samples from the remembered output row of ``seq`` and also *accepts* the
    token (updates the penalty history), as ``llama_sampler_sample`` does. With a grammar or a
    logit bias the candidates are built in numpy and the grammar stays outside the chain (see
    :mod:`engine.llama_backend.grammar_sampler`); without, ``llama_sampler_sample`` does it all.
    """

    def __init__(self, chain: Any, params: SamplerParams, grammar: GrammarConstraint | None = None,
                 bias: tuple[np.ndarray, np.ndarray] | None = None, spare: "SpareChains | None" = None,
                 spare_key: tuple | None = None) -> None:
        self._chain = chain
        self.params = params
        self.grammar = grammar
        self.bias_ids, self.bias_values = bias if bias is not None else (None, None)
        self.ids: np.ndarray | None = None
        self._cur: np.ndarray | None = None
        # where free() leaves the chain for the next job with the same key (None: freed)
        self._spare, self._spare_key = (spare, spare_key) if spare_key is not None else (None, None)

    @property
    def plain(self) -> bool:
        """No grammar, no bias: ``llama_sampler_sample`` alone."""
        return self.grammar is None and self.bias_ids is None

    @property
    def argmax_only(self) -> bool:
        """Greedy with nothing that changes a logit or keeps a history (no penalties, grammar or
        bias): the token is the raw row's argmax, and the chain has nothing to accept.
        ``llama_sampler_sample`` would first copy the whole vocabulary into candidates (262,144
        on Gemma: ~0.3 ms a token, on the inference thread while the compute threads wait);
        numpy's argmax reads the row in ~0.04 ms and breaks ties alike (the first maximum)."""
        return self.plain and _plain_greedy(self)

    def candidates(self, n_vocab: int) -> np.ndarray:
        """The reusable candidate buffer (``llama_token_data[n_vocab]``)."""
        if self._cur is None or len(self._cur) != n_vocab:
            self._cur = np.empty(n_vocab, dtype=TOKEN_DATA)
            self.ids = np.arange(n_vocab, dtype=np.int32)
        return self._cur

    @property
    def handle(self) -> Any:
        if self._chain is None:
            raise LlamaBackendError("sampler was freed")
        return self._chain

    @overload
    def sample(self, model: "ModelBackend", seq: int, want_logprob: Literal[False] = False) -> int: ...
    @overload
    def sample(self, model: "ModelBackend", seq: int, want_logprob: Literal[True]) -> tuple[int, float]: ...

    def sample(self, model: "ModelBackend", seq: int, want_logprob: bool = False) -> int | tuple[int, float]:
        """Same as ``model.sample(seq, self, want_logprob)``."""
        return model.sample(seq, self, want_logprob)  # type: ignore[call-overload]

    def free(self) -> None:
        if self.grammar is not None:
            self.grammar.free()
            self.grammar = None
        if self._chain is not None:
            if self._spare is None or not self._spare.give(self._spare_key, self._chain):
                L.llama_sampler_free(self._chain)
            self._chain = None

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.free()
        except Exception:
            pass


class SpareChains:
    """Sampler chains kept after their job for the next one with the same parameters.

    Building llama-server's default chain (top-k, top-p, min-p, temperature, dist) and freeing
    it costs ~12 µs a request, on the path of its first token. A chain that keeps nothing of
    its job — no penalties (a token history), no grammar, no bias — can serve the next job as
    it is: with a random seed its generator just goes on (as random as a new seed), and a
    chain with a fixed seed is reset, which seeds it again (the same tokens as a new chain).
    Taken on the inference thread, given back on the event loop's: hence the lock. At most
    :attr:`LIMIT` are kept; what ``close()`` finds is freed, and chains given back after it too.
    """

    LIMIT = 8

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[tuple, list[Any]] = {}
        self._count = 0
        self._closed = False

    def take(self, key: tuple) -> Any:
        """A kept chain for ``key`` (:func:`chain_key`), ready for a new job; None if there is none."""
        with self._lock:
            chains = self._kept.get(key)
            if not chains:
                return None
            chain = chains.pop()
            self._count -= 1
        if key[-1] is not None:  # a fixed seed: seeded again, as a new chain would be
            L.llama_sampler_reset(chain)
        return chain

    def give(self, key: tuple, chain: Any) -> bool:
        """Keep ``chain``, built for ``key`` (False: not kept; the caller frees it)."""
        with self._lock:
            if self._closed or self._count >= self.LIMIT:
                return False
            self._kept.setdefault(key, []).append(chain)
            self._count += 1
        return True

    def close(self) -> None:
        with self._lock:
            kept, self._kept, self._count, self._closed = self._kept, {}, 0, True
        for chains in kept.values():
            for chain in chains:
                L.llama_sampler_free(chain)

    def __len__(self) -> int:
        return self._count


def chain_key(p: SamplerParams) -> tuple | None:
    """What a chain of ``p`` is built from, when it keeps no state of a job; else None. Its last
    item is the fixed seed (None: greedy, or a random seed): what :meth:`SpareChains.take` resets."""
    if p.penalties_enabled or p.grammar is not None or p.logit_bias:
        return None
    if p.greedy:
        return (True, None)
    seed = None if p.seed is None or int(p.seed) & 0xFFFFFFFF == LLAMA_DEFAULT_SEED else int(p.seed) & 0xFFFFFFFF
    return (False, p.top_k, p.top_p, p.min_p, p.temperature, seed)


def make_sampler(
    params: SamplerParams | None = None,
    model: "ModelText | None" = None,
    *,
    n_vocab: int | None = None,
    spare: SpareChains | None = None,
) -> Sampler:
    """Build a sampler chain: [penalties] + (greedy | top_k, top_p, min_p, temp, dist(seed)).

    The penalties sampler of this llama.cpp version needs the vocabulary size: pass ``model``
    (or ``n_vocab``) when penalties are enabled; a logit bias needs it too, and a grammar needs
    ``model`` (its vocabulary). Raises ``ValueError`` for an unusable grammar or bias.
    ``spare``: a chain kept there is taken instead of building one, and ``free()`` leaves the
    chain there (see :class:`SpareChains`).
    """
    p = params or SamplerParams()
    key = chain_key(p) if spare is not None else None
    kept = spare.take(key) if key is not None else None
    if kept is not None:
        return Sampler(kept, p, spare=spare, spare_key=key)
    nv = n_vocab if n_vocab is not None else (model.n_vocab if model is not None else None)
    bias = _bias_arrays(p.logit_bias, nv)
    grammar = None
    if p.grammar is not None:
        if model is None:
            raise ValueError("a grammar needs the model's vocabulary: pass model=")
        grammar = GrammarConstraint(model._voc(), p.grammar, model.utf8_masks(), model.token_pieces())
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    if not chain:
        raise LlamaBackendError("llama_sampler_chain_init failed")
    try:
        if p.penalties_enabled:
            if nv is None:
                raise ValueError("repetition penalties need the vocabulary size: pass model= or n_vocab=")
            L.llama_sampler_chain_add(
                chain,
                L.llama_sampler_init_penalties(
                    int(nv), int(p.penalty_last_n), float(p.penalty_repeat), float(p.penalty_freq),
                    float(p.penalty_present),
                ),
            )
        if p.greedy:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
        else:
            if p.top_k > 0:
                L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(int(p.top_k)))
            if 0.0 < p.top_p < 1.0:
                L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(float(p.top_p), 1))
            if p.min_p > 0.0:
                L.llama_sampler_chain_add(chain, L.llama_sampler_init_min_p(float(p.min_p), 1))
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(float(p.temperature)))
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(_seed(p.seed)))
    except BaseException:
        L.llama_sampler_free(chain)
        if grammar is not None:
            grammar.free()
        raise
    return Sampler(chain, p, grammar, bias, spare=spare, spare_key=key)


def _seed(asked: int | None) -> int:
    """The seed for llama.cpp: the one asked for, or (none, -1 or LLAMA_DEFAULT_SEED) a random one."""
    seed = LLAMA_DEFAULT_SEED if asked is None else int(asked) & 0xFFFFFFFF
    return _SEEDS.getrandbits(32) if seed == LLAMA_DEFAULT_SEED else seed


def _bias_arrays(logit_bias: tuple[tuple[int, float], ...], n_vocab: int | None
                 ) -> tuple[np.ndarray, np.ndarray] | None:
    """(token ids, biases) for numpy, a repeated token's biases summed; None when empty."""
    if not logit_bias:
        return None
    if n_vocab is None:
        raise ValueError("a logit bias needs the vocabulary size: pass model= or n_vocab=")
    merged: dict[int, float] = {}
    for tok, b in logit_bias:
        tok, b = int(tok), float(b)
        if not 0 <= tok < n_vocab:
            raise ValueError(f"logit_bias token {tok} is outside the vocabulary (0..{n_vocab - 1})")
        if math.isnan(b) or b == math.inf:
            raise ValueError(f"logit_bias of token {tok} must be a number or -inf")
        merged[tok] = merged.get(tok, 0.0) + b
    ids = np.fromiter(merged, dtype=np.int64, count=len(merged))
    return ids, np.fromiter(merged.values(), dtype=np.float32, count=len(merged))


def top_logprobs(row: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely tokens of a raw logits row, as (token, natural-log softmax),
    most likely first."""
    n = max(0, min(int(n), row.shape[0]))
    if n == 0:
        return []
    top = np.argpartition(row, -n)[-n:]
    top = top[np.argsort(-row[top], kind="stable")]
    m = float(row.max())
    lse = m + float(np.log(np.exp(row - m).sum(dtype=np.float64)))
    return [(int(t), float(row[t]) - lse) for t in top]


# ---- sampling under a grammar (engine.llama_backend.grammar_sampler) -----------------------
def _fill(sampler: "Sampler", row: np.ndarray) -> np.ndarray:
    cur = sampler.candidates(row.shape[0])
    cur["id"] = sampler.ids
    cur["logit"] = row
    cur["p"] = 0.0
    if sampler.bias_ids is not None:
        cur["logit"][sampler.bias_ids] += sampler.bias_values
    return cur


def _chain_pick(chain: Any, cur: np.ndarray, banned: set[int]) -> int:
    if banned:
        cur["logit"][np.fromiter(banned, dtype=np.int64)] = -np.inf
    if not np.isfinite(cur["logit"]).any():
        raise GrammarExhausted("no token is allowed at this step")
    arr = token_array(cur)
    L.llama_sampler_apply(chain, ctypes.byref(arr))
    if not 0 <= arr.selected < arr.size:
        raise LlamaBackendError("the sampler chain selected no token")
    return int(arr.data[arr.selected].id)


def sample_row(sampler: "Sampler", row: np.ndarray) -> int:
    """Sample one token from a raw logits row with the sampler's logit bias and grammar, and
    accept it into the grammar and the chain. Raises :class:`GrammarExhausted` (nothing
    accepted) when the grammar allows no token."""
    chain, grammar = sampler.handle, sampler.grammar
    if grammar is not None and _plain_greedy(sampler):
        tok = _greedy_pick(sampler, grammar, row)
        grammar.accept(tok)
        L.llama_sampler_accept(chain, tok)
        return tok
    tok = _chain_pick(chain, _fill(sampler, row), set())
    if grammar is not None and not grammar.allows(tok):
        short = _shortlist_pick(sampler, grammar, row)
        tok = short if short is not None else _resample(sampler, grammar, row, first=tok)
    if grammar is not None:
        grammar.accept(tok)
    L.llama_sampler_accept(chain, tok)
    return tok


def _plain_greedy(sampler: "Sampler") -> bool:
    """The chain is argmax alone (no penalties): numpy can stand in for it."""
    return sampler.params.greedy and not sampler.params.penalties_enabled


def _greedy_pick(sampler: "Sampler", grammar: GrammarConstraint, row: np.ndarray) -> int:
    """Greedy under a grammar, as the general path decides it, without building the whole
    candidate array for the first choice or, when the grammar is active, the shortlist (a lazy
    one before its trigger refuses only a token whose trigger text breaks it: the resample
    takes such tokens out one by one)."""
    logits = row
    if sampler.bias_ids is not None:
        logits = row.copy()
        logits[sampler.bias_ids] += sampler.bias_values
    tok = int(np.argmax(logits))
    if grammar.allows(tok):
        return tok
    if grammar.active and len(logits) > SHORTLIST:
        ids = np.argpartition(logits, -SHORTLIST)[-SHORTLIST:]
        short = np.empty(SHORTLIST, dtype=TOKEN_DATA)
        short["id"], short["logit"], short["p"] = ids, logits[ids], 0.0
        grammar.apply(short)
        best = int(np.argmax(short["logit"]))
        if np.isfinite(short["logit"][best]):  # apply() left only what the grammar allows
            return int(short["id"][best])
    return _resample(sampler, grammar, row, first=tok)


def _shortlist_pick(sampler: "Sampler", grammar: GrammarConstraint, row: np.ndarray) -> int | None:
    """llama-server's second try, on the most likely candidates only: the grammar judges
    ``SHORTLIST`` tokens instead of the whole vocabulary. None: it allowed none of them (or
    is lazy, where a refusal can depend on the whole text), so the whole vocabulary decides."""
    cur = _fill(sampler, row)
    if not grammar.active or len(cur) <= SHORTLIST:
        return None
    short = cur[np.argpartition(cur["logit"], -SHORTLIST)[-SHORTLIST:]]  # a copy, contiguous
    grammar.apply(short)
    if not np.isfinite(short["logit"]).any():
        return None
    return _chain_pick(sampler.handle, short, set())  # apply() left only what the grammar allows


def _resample(sampler: "Sampler", grammar: GrammarConstraint, row: np.ndarray, first: int) -> int:
    """The grammar judges the whole vocabulary; a lazy grammar's refusals (a trigger whose text
    breaks it) are taken out one by one."""
    refused = {first}
    for _ in range(MAX_RESAMPLES):
        cur = _fill(sampler, row)
        grammar.apply(cur)
        tok = _chain_pick(sampler.handle, cur, refused if not grammar.active else set())
        if grammar.allows(tok):
            if tok in refused:  # pragma: no cover - the chain picked a -inf candidate
                raise GrammarExhausted("no token is allowed at this step")
            return tok
        refused.add(tok)
    raise GrammarExhausted("no token allowed by the grammar was sampled")


def accept_forced(sampler: "Sampler", tok: int) -> None:
    """``tok`` chosen without sampling: the grammar must allow it (else GrammarExhausted, nothing
    taken), then the grammar and the chain accept it as they accept a sampled token."""
    grammar = sampler.grammar
    if grammar is not None:
        if not grammar.allows(tok):
            raise GrammarExhausted("the grammar refuses the token the reasoning budget writes")
        grammar.accept(tok)
    L.llama_sampler_accept(sampler.handle, tok)
