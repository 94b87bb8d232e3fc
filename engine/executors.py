"""Thread priorities, and the engine's two worker threads: inference (every llama.cpp call of
the live model, and ggml's compute threads it starts) and loader (building shadow models).

The scheme (docs/architecture.md, 'Priorities'; measurements in docs/performance.md):

* The event-loop thread runs SCHED_RR (:func:`promote_loop_thread`) where the process may:
  a request's wake-up then preempts any normal thread on the host at once — ggml's compute
  threads and every other process alike — so STATE_META stays fast on an idle host with
  decode on every core *and* on a busy one. ``SCHED_RESET_ON_FORK`` makes every thread and
  process it starts begin at the normal policy again.
* Inference and loader run at the normal priority (nice 0), or llama.cpp's ``--prio-batch``
  level, so generation keeps its fair share of a busy host.
* Where the real-time policy is not permitted (no CAP_SYS_NICE, RLIMIT_RTPRIO 0, or a cgroup
  without real-time runtime), the loop stays at the normal policy and the caller is told;
  ``low_priority`` (nice 19 for inference and loader) is the older scheme for a dedicated host.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import threading
import weakref
from typing import Any, Callable

log = logging.getLogger("engine.executors")

LOW_NICE = 19
#: llama.cpp's ggml_sched_priority (low, normal, medium, high, realtime) → nice
PRIO_NICE = {-1: 5, 0: 0, 1: -5, 2: -10, 3: -20}
#: the event-loop thread's SCHED_RR priority: above every normal thread, far below the kernel's own
LOOP_RT_PRIORITY = 10


def set_thread_nice(nice: int) -> str | None:
    """Set the calling thread's nice value (threads it starts inherit it); the error, or None."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (PermissionError, OSError, AttributeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def promote_loop_thread(priority: int = LOOP_RT_PRIORITY) -> str | None:
    """Put the calling thread under SCHED_RR at ``priority``; the error, or None when done.

    With SCHED_RESET_ON_FORK: threads and processes started from it later (the inference and
    loader threads, asyncio's default executor, ggml-RPC children) start at SCHED_OTHER, nice 0
    or above, instead of inheriting the real-time policy.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_RR | os.SCHED_RESET_ON_FORK, os.sched_param(priority))
    except (PermissionError, OSError, AttributeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def thread_policy() -> str:
    """The calling thread's scheduling, as INFO and the benchmark report it ("SCHED_RR 10", "nice 0")."""
    try:
        policy = os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK
        if policy in (os.SCHED_RR, os.SCHED_FIFO):
            name = "SCHED_RR" if policy == os.SCHED_RR else "SCHED_FIFO"
            return f"{name} {os.sched_getparam(0).sched_priority}"
        return f"nice {os.getpriority(os.PRIO_PROCESS, threading.get_native_id())}"
    except (OSError, AttributeError):  # pragma: no cover - non-Linux
        return "unknown"


def give_way() -> None:
    """On the inference thread, before the step after one that gave a job its first token:
    let the client that token's write woke run first.

    When a step hands back, the SCHED_RR loop preempts the inference thread at once, runs its
    whole turn (the streams' writes wake their readers, the next step is submitted) and sleeps.
    The inference thread, preempted rather than asleep, would then go straight into the next
    step, and a reader woken on its core (a client on the same host) would wait out the whole
    step for a token already written: most of what a short request a few milliseconds after
    another lost on the tiny models (docs/performance.md, "A step that kept the core").
    ``sched_yield`` puts the thread behind it once; with nothing else runnable on its core it
    returns at once (a system call, ~1 µs). Only there: before the first step from idle nothing
    was written, and an asyncio client still busy after its send would hold back the prefill;
    before every step, a steady stream's reader cut Gemma's chat decode by ~2 %.
    """
    _sched_yield()


_sched_yield: Callable[[], None] = getattr(os, "sched_yield", lambda: None)


def _init_thread(nice: int) -> None:
    error = set_thread_nice(nice)
    if error:  # raising priority needs CAP_SYS_NICE; llama.cpp warns and goes on too
        log.warning("failed to set the priority of thread %s to nice %d: %s", threading.current_thread().name,
                    nice, error)


async def start_workers(loop_realtime: bool, low_priority: bool = False, nice: int | None = None
                        ) -> tuple["InferenceThread", concurrent.futures.Executor,
                                   dict[str, str]]:
    """On the event-loop thread: promote it (``loop_realtime``), then start the inference and
    loader threads; returns them and what each thread got (INFO ``thread_priorities``)."""
    if loop_realtime:
        error = promote_loop_thread()
        if error:
            log.warning("the event loop stays at the normal scheduling policy (SCHED_RR not permitted: %s); "
                        "STATE_META may wait for a core while every core decodes", error)
    infer = make_inference_executor(low_priority, nice)
    loader = make_loader_executor(low_priority, nice)
    loop = asyncio.get_running_loop()
    got = {"event_loop": thread_policy()}
    for name, ex in (("inference", infer), ("loader", loader)):
        got[name] = await loop.run_in_executor(ex, thread_policy)
    return infer, loader, got


class FreshThreadExecutor(concurrent.futures.Executor):
    """Runs each call on a thread of its own that ends with it; one call at a time, in the
    order submitted (as a single-thread pool would).

    Why not one long-lived thread: ggml's CPU backend computes in OpenMP parallel regions, and
    the first one a thread enters leaves a pool of OpenMP threads tied to that thread for as
    long as it lives. libgomp counts them as busy; once they and the inference thread's team
    outnumber the cores it stops spinning at barriers, so every barrier of every decode becomes
    a sleep and a wake-up. A model load enters such regions (the KV-cache probe decodes, weights
    are repacked), so a loader that lived on made decode on a 2-core host 3× slower (85,000
    context switches for 3,000 tokens of the tiny model, against 800). A thread that ends
    frees its pool.
    """

    def __init__(self, name: str, nice: int | None = None) -> None:
        self._name, self._nice = name, nice
        self._mutex = threading.Lock()
        self._last: threading.Thread | None = None
        self._pending: list[concurrent.futures.Future] = []
        self._count = 0
        self._shutdown = False

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        with self._mutex:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            fut: concurrent.futures.Future = concurrent.futures.Future()
            self._count += 1
            t = threading.Thread(target=self._run, args=(self._last, fut, fn, args, kwargs),
                                 name=f"{self._name}_{self._count}")
            self._last = t
            self._pending.append(fut)
            t.start()
            return fut

    def _run(self, previous: threading.Thread | None, fut: concurrent.futures.Future, fn, args, kwargs) -> None:
        if previous is not None:
            previous.join()
        try:
            if self._nice is not None:
                _init_thread(self._nice)
            _run_into(fut, fn, args, kwargs)
        finally:
            with self._mutex:
                self._pending.remove(fut)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._mutex:
            self._shutdown = True
            last, pending = self._last, list(self._pending)
        if cancel_futures:
            for fut in pending:
                fut.cancel()
        if wait and last is not None:
            last.join()


def make_loader_executor(low_priority: bool = False, nice: int | None = None) -> FreshThreadExecutor:
    """The executor that builds (shadow) models and frees old ones: a thread per call (see
    :class:`FreshThreadExecutor` for why)."""
    return FreshThreadExecutor("hydra-loader", nice if nice is not None else LOW_NICE if low_priority else None)


class InferenceThread(concurrent.futures.Executor):
    """One long-lived thread running every call on the live model, in the order submitted.

    :meth:`submit` is a single-thread pool's. :meth:`call` is the actor's per-step hand-off:
    the result reaches the loop with one ``call_soon_threadsafe`` — no concurrent Future chained
    to an asyncio one, no idle-worker semaphore. Measured on the path between two steps (where
    the inference thread waits for the loop): 59–63 µs to submit a step through
    ``run_in_executor``, 12–22 µs this way (docs/performance.md, "The path between two steps").
    """

    def __init__(self, name: str, nice: int | None = None) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._mutex = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=_work, args=(self._jobs, nice), name=f"{name}_0")
        self._thread.start()
        # as concurrent.futures' pools do: one nobody shut down must not keep the interpreter alive
        ref = weakref.ref(self)
        with contextlib.suppress(RuntimeError):  # the interpreter is exiting already
            threading._register_atexit(lambda: (ex := ref()) is not None and ex.shutdown(wait=False))

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._put((fut, fn, args, kwargs))
        return fut

    def call(self, fn: Callable, /, *args: Any) -> asyncio.Future:
        """``fn(*args)`` on this thread; await the returned future on the calling loop. A call
        whose future is cancelled before it starts does not run (as with ``run_in_executor``)."""
        fut = asyncio.get_running_loop().create_future()
        self._put((fut, fn, args, None))
        return fut

    def _put(self, job: tuple) -> None:
        with self._mutex:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._jobs.put(job)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._mutex:
            if not self._closed:
                self._closed = True
                if cancel_futures:
                    _cancel_queued(self._jobs)
                self._jobs.put(None)
        if wait and self._thread is not threading.current_thread():
            self._thread.join()


def _work(jobs: queue.SimpleQueue, nice: int | None) -> None:
    if nice is not None:
        _init_thread(nice)
    while (job := jobs.get()) is not None:
        fut, fn, args, kwargs = job
        job = None
        if kwargs is None:
            _run_for_loop(fut, fn, args)
        else:
            _run_into(fut, fn, args, kwargs)
        # a finished call's arguments (a state of many MiB) are not kept until the next
        fut = fn = args = kwargs = None


def _run_into(fut: concurrent.futures.Future, fn: Callable, args: tuple, kwargs: dict) -> None:
    """``fn`` for a concurrent Future, as a pool's worker runs it: not at all if it was cancelled."""
    try:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:  # delivered to the caller, as a pool would
            fut.set_exception(e)
        else:
            fut.set_result(result)
    finally:  # an error's traceback keeps this frame: not what its variables held
        fut = fn = args = kwargs = result = None


def _run_for_loop(fut: asyncio.Future, fn: Callable, args: tuple) -> None:
    if fut.done():  # cancelled while queued (a read of its state, benign from this thread)
        return
    result = error = None
    try:
        result = fn(*args)
    except BaseException as e:
        error = e
    try:
        fut.get_loop().call_soon_threadsafe(_settle, fut, result, error)
    except RuntimeError:  # the loop is closed: nobody waits any more
        pass
    finally:  # an error's traceback keeps this frame: not what its variables held
        fut = fn = args = result = error = None


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _cancel_queued(jobs: queue.SimpleQueue) -> None:
    while True:
        try:
            job = jobs.get_nowait()
        except queue.Empty:
            return
        if job is None:
            continue
        fut = job[0]
        if isinstance(fut, concurrent.futures.Future):
            fut.cancel()
        else:
            with contextlib.suppress(RuntimeError):
                fut.get_loop().call_soon_threadsafe(fut.cancel)


def make_inference_executor(low_priority: bool = False, nice: int | None = None) -> InferenceThread:
    """The one thread for all model calls of one engine (:class:`InferenceThread`).

    ggml's compute threads are started by this thread and inherit its priority. With
    ``low_priority`` it runs at nice 19 (the event loop, at nice 0, then preempts it; so does
    every other busy process on the host); ``nice`` sets another value instead.
    """
    return InferenceThread("hydra-inference", nice if nice is not None else LOW_NICE if low_priority else None)
