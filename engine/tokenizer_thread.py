"""The tokenizer thread: an input too long for the event loop is tokenized beside the decode,
as llama-server tokenizes on its HTTP threads, not between two steps on the inference thread,
where every running stream waited for it (~0.3 ms per 1,000 characters on Gemma 3's
vocabulary: an agent's conversation of 50,000 characters held the decode ~15 ms). The job
reaches the scheduler when its tokens are there: a :class:`Tokenized` message to the actor.

llama.cpp's tokenizer only reads the vocabulary (llama-server's HTTP threads tokenize while its
loop decodes). The model a tokenization reads must outlive it: while one is pending the actor
is not quiescent, so a reload neither swaps nor frees that model, and stopping waits for it
before the model is freed.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass
from typing import Any, Callable

from .jobs import GenJob
from .scheduler import fail
from .stepper import job_input


@dataclass
class Tokenized:
    """A pending job's input is tokenized (or failed to be): the actor offers it now."""
    job: GenJob
    model: Any
    future: asyncio.Future


class TokenizerThread:
    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hydra-tokenizer")
        self._pending: dict[GenJob, asyncio.Future] = {}

    @property
    def pending(self) -> bool:
        """A tokenization runs or waits: the model it reads must stay."""
        return bool(self._pending)

    def start(self, job: GenJob, model: Any, post: Callable[[object], None]) -> None:
        """Tokenize ``job``'s input for ``model`` on the thread; ``post`` gets a
        :class:`Tokenized` on the event loop when it is done."""
        future = asyncio.get_running_loop().run_in_executor(self._pool, job_input, model, job, False)
        self._pending[job] = future
        future.add_done_callback(lambda f: post(Tokenized(job, model, f)))

    def take(self, msg: Tokenized) -> list[int] | None:
        """The tokens of a finished tokenization (raises what it raised); None when the job
        was already failed (the engine stopping)."""
        if self._pending.pop(msg.job, None) is None:
            return None
        return msg.future.result()

    async def close(self, exc: BaseException) -> None:
        """Fail every pending job with ``exc``, wait for the running tokenization (the model
        is freed after), end the thread."""
        pending, self._pending = self._pending, {}
        for job, future in pending.items():
            future.cancel()  # one not started yet never starts
            fail(job, exc)
        if pending:
            await asyncio.wait(pending.values())
        self._pool.shutdown(wait=False)
