"""Work the engine actor accepts, and what it hands back."""
from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from .sampling import SamplerParams

if TYPE_CHECKING:
    from .reasoning_budget import ReasoningBudget
    from .model_params import ModelParams
    from .status import ModelIdentity

_job_ids = itertools.count(1)


class EngineBusy(Exception):
    """The slot (or the engine) cannot take this work now. Maps to BUSY on the wire."""

    def __init__(self, message: str, retry_after_ms: int | None = None):
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class EngineUnavailable(Exception):
    """No model is loaded (first load failed or in progress). Maps to ERROR / HTTP 503."""


class ReloadFailed(EngineUnavailable):
    """The reload a request asked for (a model alias, a ``hydra_config``) did not happen:
    its build failed, the drain timeout passed, or a newer config replaced it."""


class ModelChanged(EngineUnavailable):
    """The model config a request named was swapped out before the request ran."""


class Unservable(Exception):
    """The engine, as configured and as full as it is, cannot serve the request: not the
    client's input, not a bug. With ``--no-jinja`` a chat template llama.cpp's built-in
    renderer does not know (llama-server starts on it too, and fails each chat); a KV cache
    the running slots fill together (``--kv-unified``), llama-server's "Context size has been
    exceeded.". ERROR on the Hydra port, HTTP 500, without a traceback."""


class KvCacheFull(Unservable):
    """A batch found no free KV cell: the slots together fill a unified cache. The step first
    gives up the cache of slots no job runs on (llama-server's ``try_clear_idle_slots``)."""


# The engine looks for stop sequences in the last 256 bytes it generated, on every token: longer
# ones could never match, and each one more costs every token of the job.
MAX_STOPS, MAX_STOP_BYTES = 16, 256


def stops_refused(stops: list[str]) -> str | None:
    """Why a request's stop sequences are refused, or None."""
    if len(stops) > MAX_STOPS or any(len(s.encode("utf-8", "surrogatepass")) > MAX_STOP_BYTES for s in stops):
        return f"at most {MAX_STOPS} stop sequences of at most {MAX_STOP_BYTES} bytes each"
    return None


class BadInput(ValueError):
    """The request's content is unusable (e.g. token id out of range). Maps to BAD_REQUEST."""


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token: int
    piece: bytes
    logprob: float = 0.0
    # the most likely tokens at this step (piece, logprob), when the job asked for ``n_probs``
    top: tuple[tuple[bytes, float], ...] = ()


@dataclass
class GenResult:
    slot: int
    n_past: int
    prompt_tokens: int
    tokens_generated: int
    stop_reason: str  # eos | length | stop | ctx_full | grammar | cancelled | none (prefill only)
    config_generation: int
    identity: ModelIdentity
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    cached_tokens: int = 0
    state: bytes | None = None  # seq state when capture_state
    logits: bytes | None = None  # last-token logits (float32) when capture_state
    tokens: list[int] = field(default_factory=list)  # the sequence's tokens after the job
    generated: list[int] = field(default_factory=list)
    text: bytes = b""


@dataclass(frozen=True)
class GenRequest:
    """Prefill (optional) then generate ``n_predict`` tokens on one slot: what a client asked for.

    Input, in order of precedence: ``messages`` (chat template), ``prompt`` (plain text),
    ``tokens``. With ``append`` the new tokens continue the slot's sequence;
    otherwise they are the whole sequence and the common prefix already in the KV
    cache is reused. No input at all means: continue from what the slot holds.

    ``slot`` None: the engine picks one when it admits the job (see ``engine.slot_choice``;
    ``JobHandle.slot`` tells which); such a request needs an input and cannot ``append``.
    """

    slot: int | None
    messages: list | None = None
    prompt: str | None = None
    tokens: list[int] | None = None
    append: bool = False
    n_predict: int = 0
    sampling: SamplerParams = field(default_factory=SamplerParams)
    stop: list[str] = field(default_factory=list)
    # chat template variables besides ``messages`` (``tools``, the request's chat_template_kwargs)
    template_vars: dict[str, Any] | None = None
    reasoning_budget: ReasoningBudget | None = None  # at most this many tokens inside a think block
    capture_state: bool = False
    want_logprobs: bool = False
    # Serve only on this model config (a request that named a model or a config); if another
    # one is live when the job is admitted, it fails with ModelChanged. None: whatever is live.
    params: ModelParams | None = None
    # False: never wait in the slot's queue — a busy slot refuses it with EngineBusy (a merged
    # DECODE runs detached from its client; the C++ answers it "slot is busy")
    wait: bool = True
    # False: whoever submitted reads only the result, not the tokens as they come, so a running
    # step keeps them until it ends instead of waking the event loop for each (engine.stepper)
    stream: bool = True


class EventChannel:
    """A job's token events, from the actor to whoever streams them: ``asyncio.Queue``'s
    ``put_nowait`` / ``get`` / ``get_nowait`` / ``empty`` / ``qsize`` without its task
    accounting (an Event and a counter touched per item), on the path of every token."""

    __slots__ = ("_items", "_getters")

    def __init__(self) -> None:
        self._items: deque = deque()
        self._getters: deque[asyncio.Future] = deque()

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        self._wake_one()

    async def get(self) -> Any:
        while not self._items:
            getter = asyncio.get_running_loop().create_future()
            self._getters.append(getter)
            try:
                await getter
            except BaseException:
                getter.cancel()
                if self._items:  # woken, then cancelled: the item goes to the next reader
                    self._wake_one()
                raise
        return self._items.popleft()

    def _wake_one(self) -> None:
        while self._getters:
            getter = self._getters.popleft()
            if not getter.done():
                getter.set_result(None)
                return

    def get_nowait(self) -> Any:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)


@dataclass(eq=False)
class GenJob:
    """One request's run inside the engine: the request and the state the actor and the
    inference thread keep for it. The wire side holds a ``JobHandle`` on it, never this."""

    request: GenRequest
    id: int = field(default_factory=lambda: next(_job_ids))
    slot: int | None = None  # the slot it runs on: the request's, or the one the engine chose
    # (model, tokens): the input tokenized before a slot was chosen; used if that model still serves
    tokenized: tuple[Any, list[int]] | None = field(default=None, repr=False)
    # set when ``messages`` are rendered: the generation prompt ends inside an open think block,
    # so the output starts as reasoning (read by the wire side once the first token arrives)
    opens_reasoning: bool = False
    cancelled: bool = False
    events: EventChannel = field(default_factory=EventChannel)  # TokenEvent…, then None
    done: asyncio.Future | None = None
    client_blocked: bool = False  # see JobHandle.set_client_blocked
    wake: Callable[[], None] | None = field(default=None, repr=False)  # set by the engine on submit

    def __post_init__(self) -> None:
        if self.slot is None:
            self.slot = self.request.slot

    def cancel(self) -> None:
        self.cancelled = True
        if self.client_blocked and self.wake is not None:  # a paused job is not stepped: have it reaped now
            self.wake()


class JobHandle:
    """What the submitter of a request holds: its tokens as they come, its result, a cancel."""

    __slots__ = ("_job", "id", "request")

    def __init__(self, job: GenJob):
        self._job = job
        self.id: int = job.id  # neither changes over a job's life
        self.request: GenRequest = job.request

    @property
    def slot(self) -> int | None:
        """The slot the job runs on (None until the engine chose one for a request naming none)."""
        return self._job.slot

    @property
    def opens_reasoning(self) -> bool:
        """The rendered chat prompt ends inside an open think block: output starts as reasoning."""
        return self._job.opens_reasoning

    @property
    def cancelled(self) -> bool:
        return self._job.cancelled

    def cancel(self) -> None:
        self._job.cancel()

    def set_client_blocked(self, blocked: bool) -> None:
        """Called by the wire layer: its write of this job's tokens waits on a client that is not
        reading (the transport's flow control paused it), or no longer does. While blocked, the
        engine does not step the job — tokens nobody can send would only pile up in memory — and
        the slot reports ``waiting_on: client``."""
        job = self._job
        if blocked != job.client_blocked:
            job.client_blocked = blocked
            if job.wake is not None:
                job.wake()

    async def next_event(self) -> TokenEvent | None:
        """The next token (waiting for it); None once the job has ended."""
        return await self._job.events.get()

    def ready_events(self) -> list[TokenEvent | None]:
        """The events already generated, without waiting: a writer sends them in one write. A
        None in the list is the end of the job."""
        q, out = self._job.events, []
        while not q.empty():
            out.append(q.get_nowait())
        return out

    def has_ready_events(self) -> bool:
        return not self._job.events.empty()

    @property
    def events_waiting(self) -> int:
        """Events generated and not read yet (a detached job's progress)."""
        return self._job.events.qsize()

    async def result(self) -> GenResult:
        assert self._job.done is not None
        return await self._job.done

    async def outcome(self) -> GenResult | BaseException:
        """The result or the error the job ended with, without raising; a job the engine
        cancelled (a stop) ends as CancelledError, which is returned, not raised — awaiting
        ``result()`` would raise it into the caller as if the caller were cancelled."""
        done = self._job.done
        await asyncio.wait({done})
        if done.cancelled():
            return asyncio.CancelledError()
        return done.exception() or done.result()

    def finished(self) -> bool:
        return self._job.done is not None and self._job.done.done()
