"""What the engine needs from a model: the ``ModelBackend`` protocol and how one is built.

``LoadedModel`` (llama.cpp, built by ``engine.llama_backend.factory.LlamaFactory``) is the
production backend; tests add a scripted one. Nothing here imports a backend (they import
this). The actor and the stepper only ever call what is declared here, always from one thread
at a time (the inference thread, or the loader thread while building).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from .sampling import SamplerParams

if TYPE_CHECKING:
    import numpy as np

    from .buffers import Buffer
    from .chat.formats import ChatFormat
    from .kv_cache import KvCacheInfo
    from .model_params import ModelParams


@dataclass(slots=True)
class BatchItem:
    """Tokens of one sequence for one ``decode`` step.

    ``pos0`` is the position of the first token (= ``seq_pos_max(seq) + 1`` for a
    continuation). With ``logits_last`` the logits of the last token are computed and can
    be read with ``logits`` / sampled with ``sample``.
    """

    seq: int
    tokens: Sequence[int]
    pos0: int
    logits_last: bool = True


class ModelBackend(Protocol):
    """One model with one context of ``n_seq_max`` sequences (the engine's slots).

    ``identity`` holds at least model_path, model_name, tokenizer, model_quant and
    model_capabilities (the keys the wire reports).
    """

    @property
    def n_vocab(self) -> int: ...
    @property
    def n_batch(self) -> int: ...
    @property
    def n_ubatch(self) -> int: ...
    @property
    def bos(self) -> int: ...
    @property
    def identity(self) -> dict[str, Any]: ...
    @property
    def kv_cache(self) -> "KvCacheInfo":
        """The KV cache's configuration and layout (n_ctx_slot: what one slot may hold)."""

    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> list[int]: ...
    def chat_tokens(self, messages: list[dict[str, Any]]) -> list[int]: ...
    @property
    def chat_syntax(self) -> "ChatFormat":
        """The chat template's tool-call and reasoning format."""
    @property
    def user_turn_tokens(self) -> list[int]:
        """The tokens that open a user turn in the chat template's prompts (empty: unknown)."""
    @property
    def tool_result_turns(self) -> int:
        """How the template writes tool results: 0 not in user turns, 1 a run in one, 2 one each."""
    def render_chat(self, messages: list[dict[str, Any]], **extra: Any) -> str:
        """Prompt text for ``messages`` with the generation prompt; ``extra``: template variables."""
    def chat_text_tokens(self, text: str) -> list[int]:
        """Tokens of a rendered chat prompt (special tokens parsed, one BOS)."""
    def token_to_piece(self, tok: int, special: bool = False) -> bytes: ...
    def is_eog(self, tok: int) -> bool: ...

    @property
    def n_threads(self) -> int:
        """Compute threads the context was created with (the most ``set_threads`` may ask for)."""

    def set_threads(self, n: int) -> None:
        """Compute threads for the next decodes (``ComputeThreads`` lowers it on a busy host)."""

    def decode(self, items: Sequence[BatchItem]) -> None: ...
    def logits(self, seq: int) -> "np.ndarray": ...
    def set_logits(self, seq: int, row: "np.ndarray") -> None:
        """``seq``'s last token has these logits (they came with its state): the next ``logits``
        and ``sample`` of ``seq`` read them, until the next ``decode``."""
    def make_sampler(self, params: SamplerParams | None = None) -> Any:
        """A sampler handle for ``sample``; the engine calls its ``free()`` when the job ends."""
    def sample(self, seq: int, sampler: Any, want_logprob: bool = False) -> Any:
        """The next token of ``seq`` (with ``want_logprob``: ``(token, logprob)``). With a grammar
        that allows no token, raises ``engine.sampling.GrammarExhausted`` having accepted nothing."""
    def accept(self, sampler: Any, tok: int) -> None:
        """Let ``sampler`` (its grammar, its penalties) take ``tok``, written without sampling."""
    def top_logprobs(self, seq: int, n: int) -> list[tuple[int, float]]:
        """The ``n`` most likely (token, logprob) of ``seq``'s raw logits; call before ``sample``."""

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool: ...
    def seq_clear(self, seq: int) -> None: ...
    def seq_pos_max(self, seq: int) -> int: ...
    def seq_pos_min(self, seq: int) -> int:
        """Smallest position ``seq`` holds a cell for (-1 if empty)."""
    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        """Move the positions [p0, p1) of ``seq`` by ``delta`` (a context shift, a reused chunk;
        only when ``can_shift``)."""
    def seq_copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Give ``dst`` (empty) the cells of positions [0, n) of ``src`` (only when ``kv_shareable``)."""

    @property
    def kv_shareable(self) -> bool:
        """Sequences share one KV buffer, so a partial ``seq_copy_prefix`` is possible (and cheap)."""
    @property
    def can_shift(self) -> bool:
        """The KV cache can shift positions (``seq_add``): not with a sliding-window cache."""
    @property
    def n_swa(self) -> int:
        """Sliding-window size of the attention (0: full attention everywhere)."""
    @property
    def recurrent(self) -> bool:
        """The memory has a recurrent part (a recurrent or hybrid model): a sequence's state is
        the state after its last token only, so it cannot be cut back to a shorter prefix
        (``seq_rm`` of a partial range fails) nor shifted."""

    def state_seq_size(self, seq: int) -> int: ...
    def state_seq_get(self, seq: int) -> bytes | memoryview: ...
    def state_seq_get_into(self, seq: int, buf: bytearray | memoryview) -> int: ...
    def state_seq_set(self, seq: int, data: bytes | bytearray | memoryview) -> int: ...
    def checkpoint_get(self, seq: int, reuse: Buffer | None = None) -> bytes | Buffer | memoryview:
        """The part of ``seq``'s state that cannot be cut back (the recurrent state, the window
        cache): llama.cpp's ``PARTIAL_ONLY`` capture, what a context checkpoint keeps. Written
        into ``reuse`` (a dropped checkpoint's buffer) when it is large enough."""
    def checkpoint_set(self, seq: int, data: bytes | Buffer | memoryview) -> bool:
        """Load a :meth:`checkpoint_get` capture into ``seq`` (its other cells stay); False when
        llama.cpp refuses it."""

    def close(self) -> None: ...


class BackendFactory(Protocol):
    """Builds backends; injected through ``EngineConfig.backend``."""

    def check(self) -> None:
        """Raise RuntimeError when this backend cannot run here (checked before serving)."""

    def build(self, params: "ModelParams", progress: "Callable[[float], None] | None" = None) -> ModelBackend:
        """Load a model and create its context (loader thread; blocking). ``progress`` is called
        with the share of the model's tensor bytes loaded so far (0..1), from the loader thread."""

    def devices(self, params: "ModelParams") -> list[str]:
        """The compute devices a model built from ``params`` runs on (INFO ``devices``)."""

