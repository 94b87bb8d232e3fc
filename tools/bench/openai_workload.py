"""The HTTP workload vs-llama-server runs against each server: streamed OpenAI requests and
what one records of them (chunk arrival times, TTFT, the server's own counts), and completions
not streamed (their whole time).

Both servers send one streamed chunk per generated token for these texts, so a chunk counts as
a token. Everything here speaks only the public OpenAI/llama-server HTTP API, the same way to
both servers.
"""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any, Awaitable, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from .common import BenchError, now, spread
from .traffic import sse_events, steady_rate

SLOTS_POLL_S = 0.05
T = TypeVar("T")
PREFIX_TOKENS = 1200  # the shared document of the prompt-cache phase, by the server's tokenizer
CACHED_REQUESTS = 3  # follow-ups on the same document after the cold one


def story(n: int) -> str:
    return f"Story number {n}: once upon a time"


def ferry_question(n: int, hour: int) -> str:
    """A question on the shared document (:func:`shared_document`), to follow it in a prompt."""
    return f"Question {n}: which town has the ferry at {hour} o'clock? Answer:"


def chat_messages(n: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Tell me a long story about the number {n}."}]


def _chunk_text(choice: dict[str, Any]) -> str:
    """The generated text of one streamed choice: ``text`` (completions) or the delta's content,
    reasoning or tool call (chat)."""
    if choice.get("text"):
        return choice["text"]
    delta = choice.get("delta") or {}
    functions = ((c.get("function") or {}) for c in delta.get("tool_calls") or [])
    calls = "".join(f"{f.get('name') or ''}{f.get('arguments') or ''}" for f in functions)
    return delta.get("content") or delta.get("reasoning_content") or calls


async def prompt_cache_metrics(http: Any, base: str) -> list[str]:
    """This server's prompt-cache lines of ``/metrics`` (its tiers' counters), as they read."""
    async with http.get(f"{base}/metrics") as r:
        if r.status != 200:
            raise BenchError(f"/metrics answered {r.status} (is the server started with --metrics?)")
        return [ln for ln in (await r.text()).splitlines() if ln.startswith("hydra_prompt_cache")]


async def stream(http: Any, base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed request: the arrival of each chunk with text, the text, TTFT, the server's
    counts and timings."""
    t0 = now()
    times: list[float] = []
    pieces: list[str] = []
    finish, timings, usage = None, {}, {}
    async for t, ev in sse_events(http, f"{base}{path}", {**body, "temperature": 0, "stream": True}):
        if "error" in ev:
            raise BenchError(f"in-band error: {str(ev['error'])[:300]}")
        usage = ev.get("usage") or usage
        timings = ev.get("timings") or timings
        for ch in ev.get("choices") or []:
            piece = _chunk_text(ch)
            if piece:
                times.append(t)
                pieces.append(piece)
            finish = ch.get("finish_reason") or finish
    rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else None
    return {"t_send": t0, "t_end": now(), "times": times, "text": "".join(pieces), "timings": timings,
            "chunks": len(times), "decode_tok_s": rate,
            "ttft_ms": (times[0] - t0) * 1000 if times else None, "finish": finish,
            "completion_tokens": usage.get("completion_tokens") or timings.get("predicted_n"),
            "prompt_tokens": usage.get("prompt_tokens") or timings.get("prompt_n"),
            "server_tok_s": timings.get("predicted_per_second")}


async def not_streamed(http: Any, base: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One completion not streamed (``"stream": false``, as the fleet's agents send many): the
    client's time from the send to the whole answer read, and how it finished."""
    t0 = now()
    answer = await post_json(http, f"{base}/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                                             "temperature": 0, "stream": False})
    ms = (now() - t0) * 1000
    return {"ms": ms, "finish": (answer.get("choices") or [{}])[0].get("finish_reason")}


async def completion(http: Any, base: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return await stream(http, base, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens})


async def chat(http: Any, base: str, n: int, max_tokens: int) -> dict[str, Any]:
    return await stream(http, base, "/v1/chat/completions", {"messages": chat_messages(n), "max_tokens": max_tokens})


async def round_history(http: Any, base: str, base_n: int, max_tokens: int, slots: int = 4
                        ) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """What a vs-llama-server round sends before its four streams, after a warm-up: one stream
    of ``max_tokens`` (story ``base_n``), two short requests, then ``slots`` short ones started in
    reverse order a beat apart (so the conversations change slots: the multi-stream slowdown
    of docs/performance.md showed only after such a history). Their records, in that order."""
    await completion(http, base, "Warm up: the weather today is", 8)
    single = await completion(http, base, story(base_n), max_tokens)
    history = [await completion(http, base, f"A list of rivers, number {base_n + i}:", 16) for i in range(2)]
    shuffle = []
    for n in reversed(range(base_n + 1, base_n + 1 + slots)):
        shuffle.append(asyncio.ensure_future(completion(http, base, story(n), 24)))
        await asyncio.sleep(0.05)
    return single, history, list(await asyncio.gather(*shuffle))


def aggregate(runs: list[dict[str, Any]]) -> float | None:
    """Chunks of all streams per second in the window where every stream was producing."""
    return steady_rate([r["times"] for r in runs])


async def while_polling_slots(base: str, work: Awaitable[T], interval: float = SLOTS_POLL_S
                              ) -> tuple[T, list[float]]:
    """``work`` awaited while a process of its own reads ``/slots`` every ``interval`` s
    (``tools/bench/slots_poll.py``): its result, and each answer's latency (ms)."""
    host, _, port = base.split("://", 1)[1].rpartition(":")
    child = await asyncio.create_subprocess_exec(
        sys.executable, str(Path(__file__).with_name("slots_poll.py")), host, port, str(interval),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    assert child.stdin is not None and child.stdout is not None
    try:
        if (await child.stdout.readline()).strip() != b"ready":
            raise BenchError("the /slots poller did not start")
        result = await work
    finally:
        child.stdin.close()
        out, _ = await child.communicate()
    answer = json.loads(out.decode().strip().splitlines()[-1])
    if "error" in answer:
        raise BenchError(f"{base}: {answer['error']}")
    return result, answer["latencies_ms"]


async def post_json(http: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST ``body`` and read the JSON answer; any other status than 200 is a BenchError with
    the server's words."""
    async with http.post(url, json=body) as r:
        if r.status != 200:
            raise BenchError(f"{url} answered {r.status}: {(await r.text())[:300]}")
        return await r.json()


async def count_tokens(http: Any, base: str, text: str) -> int:
    return len((await post_json(http, f"{base}/tokenize", {"content": text}))["tokens"])


async def shared_document(http: Any, base: str, n: int, limit: int) -> str:
    """A document of at most ``limit`` tokens (by this server's tokenizer), the same text for
    the same ``n`` and model on both servers."""
    lines = [f"Reference notes, set {n}."]
    lines += [f"Note {i}: the river passes the town of Ashford-{n}-{i} on its way to the sea, "
              f"and the ferry there leaves at {i % 12 + 1} o'clock." for i in range(400)]
    lo, hi = 1, len(lines)  # the longest prefix of lines within the limit: bisect on the count
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if await count_tokens(http, base, "\n".join(lines[:mid])) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return "\n".join(lines[:lo]) + "\n"


async def prompt_cache_phase(http: Any, base: str, n: int, limit: int) -> dict[str, Any]:
    """A shared document asked about cold, then CACHED_REQUESTS times more: the follow-ups'
    prefill should reuse the document's KV (both servers cache prompts by default)."""
    doc = await shared_document(http, base, n, limit)
    asks = [ferry_question(i, i + 2) for i in range(1 + CACHED_REQUESTS)]
    runs = [await completion(http, base, doc + q, 8) for q in asks]
    return {"prefix_tokens": runs[0]["prompt_tokens"], "cold": runs[0], "cached": runs[1:],
            "cold_ttft_ms": runs[0]["ttft_ms"], "cached_ttft_ms": spread(r["ttft_ms"] for r in runs[1:])["median"]}


async def concurrent(http: Any, base: str, numbers: list[int], max_tokens: int, *,
                     use_chat: bool = False) -> list[dict[str, Any]]:
    if use_chat:
        return list(await asyncio.gather(*(chat(http, base, n, max_tokens) for n in numbers)))
    return list(await asyncio.gather(*(completion(http, base, story(n), max_tokens) for n in numbers)))


async def at_once(http: Any, base: str, numbers: list[int], max_tokens: int, *, use_chat: bool = False
                  ) -> dict[str, Any]:
    """Streams started together (:func:`concurrent`) as one figure: their aggregate tok/s
    (:func:`aggregate`), and each stream's finish."""
    runs = await concurrent(http, base, numbers, max_tokens, use_chat=use_chat)
    return {"tok_s": aggregate(runs), "finish": [r["finish"] for r in runs]}


COMPUTE_THREAD_COUNTERS = {"hydra_compute_threads_reduced_seconds_total": "reduced_s",
                           "hydra_compute_threads_lowered_total": "lowered"}


async def compute_thread_counters(http: Any, base: str) -> dict[str, float] | None:
    """This server's compute-thread counters from ``/metrics`` (None from a server without
    them, llama-server among them): how long it stepped on fewer threads than configured."""
    async with http.get(f"{base}/metrics") as r:
        if r.status != 200:
            return None
        text = await r.text()
    out = {COMPUTE_THREAD_COUNTERS[m.name]: m.value for family in text_string_to_metric_families(text)
           for m in family.samples if m.name in COMPUTE_THREAD_COUNTERS}
    return out or None


def strip(r: dict[str, Any]) -> dict[str, Any]:
    """A request's record for the JSON: arrival times relative to its send, rounded (not its
    text and raw timings: the counts taken from them are there)."""
    out = {k: v for k, v in r.items() if k not in ("times", "t_send", "t_end", "text", "timings")}
    out["chunk_ms"] = [round((t - r["t_send"]) * 1000, 2) for t in r["times"]]
    for k in ("decode_tok_s", "ttft_ms", "server_tok_s"):
        if out.get(k) is not None:
            out[k] = round(out[k], 3)
    return out
