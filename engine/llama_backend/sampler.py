"""llama.cpp sampler chains built from :class:`engine.sampling.SamplerParams`."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, overload

import llama_cpp.llama_cpp as L

from ..sampling import SamplerParams
from .runtime import LlamaBackendError

if TYPE_CHECKING:
    from .model import LoadedModel

LLAMA_DEFAULT_SEED = 0xFFFFFFFF


class Sampler:
    """A llama.cpp sampler chain. Not thread-safe; one per generating sequence.

    :meth:`sample` samples from the remembered output row of ``seq`` and also *accepts* the
    token (updates the penalty history), as ``llama_sampler_sample`` does.
    """

    def __init__(self, chain: Any, params: SamplerParams) -> None:
        self._chain = chain
        self.params = params

    @property
    def handle(self) -> Any:
        if self._chain is None:
            raise LlamaBackendError("sampler was freed")
        return self._chain

    @overload
    def sample(self, model: "LoadedModel", seq: int, want_logprob: Literal[False] = False) -> int: ...
    @overload
    def sample(self, model: "LoadedModel", seq: int, want_logprob: Literal[True]) -> tuple[int, float]: ...

    def sample(self, model: "LoadedModel", seq: int, want_logprob: bool = False) -> int | tuple[int, float]:
        """Same as ``model.sample(seq, self, want_logprob)``."""
        return model.sample(seq, self, want_logprob)  # type: ignore[call-overload]

    def free(self) -> None:
        if self._chain is not None:
            L.llama_sampler_free(self._chain)
            self._chain = None

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.free()
        except Exception:
            pass


def make_sampler(
    params: SamplerParams | None = None,
    model: "LoadedModel | None" = None,
    *,
    n_vocab: int | None = None,
) -> Sampler:
    """Build a sampler chain: [penalties] + (greedy | top_k, top_p, min_p, temp, dist(seed)).

    The penalties sampler of this llama.cpp version needs the vocabulary size: pass ``model``
    (or ``n_vocab``) when penalties are enabled.
    """
    p = params or SamplerParams()
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    if not chain:
        raise LlamaBackendError("llama_sampler_chain_init failed")
    try:
        if p.penalties_enabled:
            nv = n_vocab if n_vocab is not None else (model.n_vocab if model is not None else None)
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
            seed = LLAMA_DEFAULT_SEED if p.seed is None else int(p.seed) & 0xFFFFFFFF
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(seed))
    except BaseException:
        L.llama_sampler_free(chain)
        raise
    return Sampler(chain, p)


