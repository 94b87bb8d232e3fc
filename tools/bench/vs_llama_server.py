"""vs-llama-server: this server against llama-server, same machine, model and command line.

llama-server is built from the llama.cpp vendored in the installed wheel's sdist with the
wheel's ``CMAKE_ARGS`` (:mod:`tools.bench.llama_server`, ``scripts/build_llama_server.sh``).
Both servers get the **same** llama-server argv::

    -m MODEL --host 127.0.0.1 --port P -c 8192 -np 4 -t THREADS

(plus ``--chat-template-file`` when the model file carries no chat template: see
:func:`chat_template_args`; and ``--metrics`` for the rounds' ``-np 4`` servers, so that ours
tells how long its four streams stepped on fewer compute threads than configured), ours through
``hydra-llama-engine`` with ``--rpc-port 0`` added.
They run one at a time, in alternating rounds (the order rotates every round), each round on
fresh processes, with the same HTTP workload — OpenAI ``/v1/completions``, streamed, greedy,
``max_tokens`` 200, distinct prompts ``"Story number N: once upon a time"`` (the same N for
both servers in a round):

1. ``-np 4``: a warm-up request; **one stream** (decode tok/s from its first to its last
   token; time to first token, with the two requests of step 2);
2. a short history: two single requests on another prompt, then four short concurrent
   requests started in reverse order (so the conversations change slots) — the multi-stream
   slowdown of docs/performance.md showed only after such a history;
3. **four concurrent streams**: aggregate tok/s in the window where all four produce, while a
   poller in a process of its own (``tools/bench/slots_poll.py``: not the client's event loop,
   busy with the streams' chunks) reads ``/slots`` every 50 ms (its latency under load); each
   server's per-thread CPU
   over the phase (``/proc/PID/task/*/stat``: where the time goes) and its RSS after it. A
   p99 needs answers: when that phase gave fewer than ``SLOTS_MIN_ANSWERS`` (a small model
   decodes the four streams in a fraction of a second), four longer streams follow with
   ``/slots`` read every 10 ms, again with new prompts until ``SLOTS_LOAD_ANSWERS`` answers
   came, and the figure is theirs (``slots_phase`` in the round); the row is the p99 of every
   answer of the run's rounds;
4. **a long prompt, cold then cached**: a document of ~1,200 tokens (by the server's own
   ``/tokenize``) asked a question, then three other questions on the same document — time
   to first token cold, and with the document's prefix cached (both cache prompts by default);
5. **chat completions** through the model's own chat template (``/v1/chat/completions``; the
   default argv renders it with Jinja on both; a file without one, as Gemma 3 270M's, gets the
   same template file on both, so that both render one prompt): one stream (decode tok/s; time
   to first token with two short chats after it), then four concurrent;
6. ``-np 8`` (a fresh process of each): **eight concurrent streams**, aggregate tok/s.

After the rounds, **request by request**: both servers up at once (``-np 4``, each idle while
the other serves), requests strictly alternating (A B A B …, the same prompt for both in a
pair: every request but the first comes right after one of the other server's, so each meets
the same conditions — a rotating order, A B B A, had each server answer twice in a row, the
first after the other server and the second after itself, and a ~7 ms answer on tiny-moe takes
~5 ms more the first way, which split each figure's pairs in two): ``PAIRS`` one-stream
requests (decode tok/s), as many one-stream chats (decode tok/s through the chat template),
``FOUR_PAIRS`` times four streams started together (aggregate tok/s: a round gives one such
figure per server, minutes apart, so the host's drift between rounds decides a few per cent of
it), as many times four chats, ``TTFT_PAIRS`` short requests (time to first token),
``COLD_PAIRS`` long prompts on documents neither server has seen (time to first token cold: one
such prompt per round is too few for a figure of a few percent), ``CACHED_PAIRS`` questions
on a document each server already holds (time to first token with the prefix cached), and
``WHOLE_PAIRS`` short completions not streamed (their whole time: the fleet's agents send
``"stream": false`` as often as not). A round
lasts minutes and a 200-token request a few seconds; a host whose speed drifts between phases
gives the rounds' figures whichever phase each round met, the pairs meet it together — and a
round's time to first token is the median of three requests, a few milliseconds each on a
small model, where one scheduling hiccup decides it: the pairs give dozens. Then the
**control**: the same pairs between llama-server and a second llama-server process, whose
ratios show how far two identical servers differ on this host
(:mod:`tools.bench.vs_llama_server_figures`). Last, **the floor**: ours, llama-server and a bare
Python server on the same bindings (:mod:`tools.bench.bare_completion`) each serve the same few
requests one at a time, and ours' RSS is given over the bare one's — on a small model most of
ours' RSS is the interpreter's, which no Python server sheds.

Every figure is reported as ours / llama-server's: the row's value and baseline are the
medians over rounds (``/slots`` p99: over every answer of the rounds), the note gives the
per-round ratio's median and min–max. A chunk of the
stream is counted as one token (both servers send one per token for this text).

Without a llama-server binary the scenario reports ``skipped: no llama-server (reason)``: a
full run builds it when missing, a ``--quick`` run does not.
"""
from __future__ import annotations

import asyncio
import functools
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from tools.spawn import ROOT

from .common import BenchContext, Result, Row, interleaved, now, spread, summarize
from .llama_server import OpenAIServer, build_info, find_or_build, thread_names
from .openai_workload import (PREFIX_TOKENS, SLOTS_POLL_S, aggregate, at_once, chat, completion,
                              compute_thread_counters, concurrent, ferry_question, not_streamed, prompt_cache_phase,
                              round_history, shared_document, story, strip, while_polling_slots)
from .vs_llama_server_figures import (BUDGETS, CONTROL, FLOOR, LABEL, NAME, OURS, SLOTS, SLOTS_LOAD_POLL_S,
                                      SLOTS_LOAD_ANSWERS, SLOTS_LOAD_REPEATS, SLOTS_MIN_ANSWERS, SLOTS_WIDE, VARIANTS,
                                      WHOLE_TOKENS, report)

TEMPLATES = Path(__file__).parent / "templates"
CTX = 8192
SLOTS_LOAD_MAX_TOKENS = 1500  # within a slot's 2,048 tokens of context (-c 8192 -np 4)
PAIRS = 4  # one-stream requests, and as many chats, per server in the alternating phase (1 with --quick)
FOUR_PAIRS = 3  # four streams at once per server there, and as many chats (1 with --quick)
TTFT_PAIRS = 40  # short requests per server there, for time to first token (4 with --quick)
CACHED_PAIRS = 12  # questions per server on a cached document there (2 with --quick)
WHOLE_PAIRS = 20  # completions not streamed per server there, their whole time (4 with --quick)
COLD_PAIRS = 4  # long prompts per server there, each on a document neither server has seen (1 with --quick)
FIRST_QUESTION = "Question: which town is first? Answer:"
FLOOR_SHORT = 8  # short requests of the floor's workload
TTFT_TOKENS = 4  # what the short requests ask for: their time to first token is the figure


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_argv(model: str, port: int, slots: int, threads: int, template: Sequence[str] = (), ctx: int = CTX
               ) -> list[str]:
    """The one command line both servers get."""
    return ["-m", model, "--host", "127.0.0.1", "--port", str(port), "-c", str(ctx), "-np", str(slots),
            "-t", str(threads), *template]


@functools.lru_cache(maxsize=8)
def chat_template_args(model: str) -> tuple[str, ...]:
    """``--chat-template-file`` for a model file that carries no chat template, else nothing.
    Without one the servers fall back differently (llama-server to ChatML, this server to Gemma
    turns for the Gemma family), and their chat rows would compare two prompts of different
    lengths; with the file both render the same one."""
    from gguf import GGUFReader

    fields = GGUFReader(model).fields
    if "tokenizer.chat_template" in fields:
        return ()
    arch = fields.get("general.architecture")
    gemma = arch is not None and str(arch.contents()).startswith("gemma")
    return "--chat-template-file", str(TEMPLATES / ("gemma-turns.jinja" if gemma else "chatml.jinja"))


def _shown(template: tuple[str, ...]) -> list[str]:
    """The template arguments as the results show them: the file by its name in the repository."""
    return [str(Path(a).relative_to(ROOT)) if a.startswith(str(ROOT)) else a for a in template]


def _argv_shown(threads: int, template: tuple[str, ...]) -> list[str]:
    """The shared argv as the results record it: ``MODEL`` and ``P`` for the model and port."""
    argv = llama_argv("MODEL", 0, SLOTS, threads, _shown(template))
    argv[argv.index("--port") + 1] = "P"
    return argv


def start(variant: str, binary: str, model: str, slots: int, threads: int,
          ours_adds: Sequence[str] = (), *, ctx: int = CTX, template: Sequence[str] | None = None,
          shared: Sequence[str] = (), root: Path = ROOT) -> OpenAIServer:
    """One server on the shared argv (``variant``: one of ``VARIANTS``, ``CONTROL`` or ``FLOOR``);
    ours gets ``--rpc-port 0`` and ``ours_adds`` after it.
    ``template``: the chat template arguments (default: :func:`chat_template_args`); ``shared``:
    more arguments both servers get; ``root``: the checkout ours runs from (another one: a
    change measured before and after)."""
    port = free_port()
    argv = [*llama_argv(model, port, slots, threads, chat_template_args(model) if template is None else template, ctx),
            *shared]
    if variant in ("llama-server", CONTROL):
        return OpenAIServer([binary, *argv], port, "llama-server")
    if variant == FLOOR:  # it reads the argv's model, port, threads and context, and ignores the rest
        return OpenAIServer([sys.executable, "-m", "tools.bench.bare_completion", *argv], port, FLOOR, root=root)
    return OpenAIServer([sys.executable, "-m", "hydra_rpc.cli.llama_engine", *argv, "--rpc-port", "0", *ours_adds],
                        port, "hydra-llama-engine", root=root)


def _cpu_breakdown(srv: OpenAIServer, before: dict[int, float], after: dict[int, float], tokens: int,
                   wall: float) -> dict[str, Any]:
    """The server's CPU over a phase: per thread (main thread first), and per token."""
    names = thread_names(srv.pid)
    used = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    threads = sorted(((tid, s) for tid, s in used.items() if s > 0), key=lambda x: (x[0] != srv.pid, -x[1]))
    total = sum(used.values())
    return {"wall_s": round(wall, 3), "cpu_s": round(total, 3), "cores_busy": round(total / wall, 3) if wall else None,
            "main_thread_s": round(used.get(srv.pid, 0.0), 3),
            "other_threads_s": round(total - used.get(srv.pid, 0.0), 3),
            "cpu_ms_per_token": round(1000 * total / tokens, 3) if tokens else None,
            "threads": [{"tid": tid, "name": names.get(tid, "?"), "main": tid == srv.pid, "cpu_s": round(s, 3)}
                        for tid, s in threads]}


def rss_detail(pid: int) -> dict[str, float]:
    """The RSS split into anonymous memory and file pages (the mapped model, the binaries):
    ``/proc/PID/smaps_rollup``, MiB."""
    out: dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0].rstrip(":") in ("Rss", "Anonymous", "Shared_Clean", "Private_Clean"):
                    out[parts[0].rstrip(":")] = round(int(parts[1]) / 1024, 1)
    except (OSError, ValueError):
        pass
    if "Rss" in out and "Anonymous" in out:
        out["file"] = round(out["Rss"] - out["Anonymous"], 1)
    return out


async def paired(ctx: BenchContext, http: Any, binary: str, model: str, max_tokens: int,
                 variants: Sequence[str] = tuple(VARIANTS)) -> dict[str, list]:
    """Both servers up, one request at a time, alternating request by request (a drift of the
    host's speed meets both alike): one-stream decode tok/s, completions then chats, four streams
    at once (aggregate tok/s), completions then chats, then time to first token of short
    requests, of long prompts cold, then of questions on a document each server holds cached,
    then the whole time of short completions not streamed.
    ``variants``: llama-server and ours, or llama-server and a second llama-server (the control)."""
    first, second = variants
    with start(first, binary, model, SLOTS, ctx.threads) as a, start(second, binary, model, SLOTS, ctx.threads) as b:
        servers = {first: a, second: b}
        for srv in servers.values():
            await completion(http, srv.base, "Warm up: the weather today is", 8)

        async def each_pair(n: int, request: Callable[[str, int], Awaitable[dict[str, Any]]], key: str
                            ) -> list[dict[str, Any]]:
            pairs: list[dict[str, Any]] = [{"pair": i} for i in range(n)]
            for i in range(n):
                for variant in variants:  # A B A B: each request after the other server's
                    r = await request(variant, i)
                    pairs[i][variant] = r[key]
                    pairs[i][f"{variant}_finish"] = r["finish"]
            return pairs

        one = await each_pair(ctx.pick(PAIRS, 1), lambda v, i: completion(
            http, servers[v].base, story(900 + i), max_tokens), "decode_tok_s")
        chat_one = await each_pair(ctx.pick(PAIRS, 1), lambda v, i: chat(
            http, servers[v].base, 950 + i, max_tokens), "decode_tok_s")
        four = await each_pair(ctx.pick(FOUR_PAIRS, 1), lambda v, i: at_once(
            http, servers[v].base, list(range(1100 + SLOTS * i, 1100 + SLOTS * (i + 1))), max_tokens), "tok_s")
        chat_four = await each_pair(ctx.pick(FOUR_PAIRS, 1), lambda v, i: at_once(
            http, servers[v].base, list(range(1200 + SLOTS * i, 1200 + SLOTS * (i + 1))), max_tokens, use_chat=True),
            "tok_s")
        ttft = await each_pair(ctx.pick(TTFT_PAIRS, 4), lambda v, i: completion(
            http, servers[v].base, f"A list of rivers, number {700 + i}:", TTFT_TOKENS), "ttft_ms")
        limit, n_cold = document_tokens(ctx), ctx.pick(COLD_PAIRS, 1)
        fresh = {v: [await shared_document(http, srv.base, 800 + i, limit) for i in range(n_cold)]
                 for v, srv in servers.items()}
        cold = await each_pair(n_cold, lambda v, i: completion(
            http, servers[v].base, fresh[v][i] + FIRST_QUESTION, TTFT_TOKENS), "ttft_ms")
        docs = {v: await shared_document(http, srv.base, 600, limit) for v, srv in servers.items()}
        for v, srv in servers.items():  # cold, not measured: the document is in a slot after it
            await completion(http, srv.base, docs[v] + FIRST_QUESTION, TTFT_TOKENS)
        cached = await each_pair(ctx.pick(CACHED_PAIRS, 2), lambda v, i: completion(
            http, servers[v].base, docs[v] + ferry_question(i, i % 12 + 1), TTFT_TOKENS), "ttft_ms")
        whole = await each_pair(ctx.pick(WHOLE_PAIRS, 4), lambda v, i: not_streamed(
            http, servers[v].base, f"A list of lakes, number {500 + i}:", WHOLE_TOKENS), "ms")
    return {"one": one, "chat_one": chat_one, "four": four, "chat_four": chat_four, "ttft": ttft, "cached": cached,
            "cold": cold, "whole": whole}


async def rss_floor(ctx: BenchContext, http: Any, binary: str, model: str, max_tokens: int,
                    variants: Sequence[str] = (OURS, LABEL, FLOOR)) -> dict[str, dict[str, Any]]:
    """Each server's RSS after the same requests, one server at a time on a fresh process:
    ours, llama-server and a bare Python server on the same bindings (``FLOOR``: the
    interpreter, the bindings and the model answering completions, nothing of a server). The
    requests: a warm-up, one stream of ``max_tokens``, ``FLOOR_SHORT`` short ones, and a
    document (its text from the first server's ``/tokenize``: the floor has none) asked three
    questions."""
    out: dict[str, dict[str, Any]] = {}
    doc = ""
    for variant in variants:
        with start(variant, binary, model, SLOTS, ctx.threads) as srv:
            doc = doc or await shared_document(http, srv.base, 500, document_tokens(ctx))
            await completion(http, srv.base, "Warm up: the weather today is", 8)
            await completion(http, srv.base, story(1000), max_tokens)
            for i in range(FLOOR_SHORT):
                await completion(http, srv.base, f"A list of rivers, number {1000 + i}:", TTFT_TOKENS)
            for i in range(3):
                await completion(http, srv.base, doc + ferry_question(i, i + 2), TTFT_TOKENS)
            out[variant] = memory(srv)
    return out


def document_tokens(ctx: BenchContext) -> int:
    """The long documents' size (by the server's tokenizer): ``PREFIX_TOKENS``, a quarter with --quick."""
    return ctx.pick(PREFIX_TOKENS, PREFIX_TOKENS // 4)


def memory(srv: OpenAIServer) -> dict[str, Any]:
    """A server's RSS now, its peak, and the RSS split into anonymous memory and file pages (MiB)."""
    return {"rss_mib": round((srv.rss_kib() or 0) / 1024, 1), "peak_rss_mib": round((srv.peak_kib() or 0) / 1024, 1),
            "rss_detail_mib": rss_detail(srv.pid)}


def slots_phase_tokens(max_tokens: int, four_s: float) -> int:
    """Tokens per stream for ``SLOTS_MIN_ANSWERS`` polls, when ``max_tokens`` took ``four_s``."""
    want_s = SLOTS_MIN_ANSWERS * SLOTS_LOAD_POLL_S * 1.5
    return min(SLOTS_LOAD_MAX_TOKENS, max(max_tokens, int(max_tokens * want_s / max(four_s, 1e-3))))


async def slots_under_load(http: Any, base: str, base_n: int, max_tokens: int, four_s: float,
                           four_answers: int, want: int = SLOTS_LOAD_ANSWERS) -> tuple[dict[str, Any], list[float]]:
    """Four streams long enough for ``SLOTS_MIN_ANSWERS`` answers of ``/slots`` read every
    ``SLOTS_LOAD_POLL_S`` (from how long the four-stream phase took for ``max_tokens``, with
    half as much again for the prefill and the polls' own time), four new ones again until
    ``want`` answers came (at most ``SLOTS_LOAD_REPEATS`` times: a slot's context bounds a
    stream): the phase's record, the answers."""
    n = slots_phase_tokens(max_tokens, four_s)
    answers: list[float] = []
    tokens = repeats = 0
    while repeats < SLOTS_LOAD_REPEATS and (repeats == 0 or len(answers) < want):
        first = base_n + 50 + repeats * SLOTS
        streams, got = await while_polling_slots(
            base, concurrent(http, base, list(range(first, first + SLOTS)), n), SLOTS_LOAD_POLL_S)
        answers += got
        tokens += sum(r["chunks"] for r in streams)
        repeats += 1
    return {"max_tokens": n, "poll_s": SLOTS_LOAD_POLL_S, "four_phase_answers": four_answers,
            "repeats": repeats, "tokens": tokens}, answers


async def one_round(ctx: BenchContext, http: Any, variant: str, binary: str, model: str, rnd: int,
                    max_tokens: int) -> dict[str, Any]:
    base_n = 100 * (rnd + 1)
    out: dict[str, Any] = {"variant": variant, "round": rnd}
    t_start = now()
    with start(variant, binary, model, SLOTS, ctx.threads, shared=("--metrics",)) as srv:
        out["startup_s"] = round(now() - t_start, 3)
        single, history, shuffle_runs = await round_history(http, srv.base, base_n, max_tokens, SLOTS)
        threads_before = await compute_thread_counters(http, srv.base)

        async def four_streams() -> tuple[list[dict[str, Any]], dict[int, float], dict[int, float], float]:
            before, t0 = srv.thread_cpu(), now()
            four = await concurrent(http, srv.base, list(range(base_n + 10, base_n + 10 + SLOTS)), max_tokens)
            return four, before, srv.thread_cpu(), now() - t0

        (four, before, after, four_s), polls = await while_polling_slots(srv.base, four_streams())
        threads_after = await compute_thread_counters(http, srv.base)
        out.update(memory(srv))  # before the longer phase, whose streams leave states in both prompt caches
        if len(polls) < SLOTS_MIN_ANSWERS:
            out["slots_phase"], polls = await slots_under_load(http, srv.base, base_n, max_tokens, four_s, len(polls))
        out["cpu_four"] = _cpu_breakdown(srv, before, after, sum(r["chunks"] for r in four), four_s)
        if threads_before and threads_after:  # ours: how long the phase stepped on fewer compute threads
            out["cpu_four"]["compute_threads"] = {k: round(threads_after[k] - threads_before.get(k, 0.0), 3)
                                                  for k in threads_after}
        cache = await prompt_cache_phase(http, srv.base, base_n, document_tokens(ctx))
        chat_one = await chat(http, srv.base, base_n + 30, max_tokens)
        chat_short = [await chat(http, srv.base, base_n + 40 + i, 8) for i in range(2)]
        chat_four = await concurrent(http, srv.base, list(range(base_n + 31, base_n + 31 + SLOTS)), max_tokens,
                                     use_chat=True)
    with start(variant, binary, model, SLOTS_WIDE, ctx.threads) as srv:
        await completion(http, srv.base, "Warm up: the weather today is", 8)
        eight = await concurrent(http, srv.base, list(range(base_n + 20, base_n + 20 + SLOTS_WIDE)), max_tokens)
    out.update(
        one_tok_s=single["decode_tok_s"],
        ttft_ms=spread(r["ttft_ms"] for r in (single, *history))["median"],
        four_tok_s=aggregate(four), eight_tok_s=aggregate(eight),
        four_per_stream_tok_s=[r["decode_tok_s"] for r in four],
        slots_ms=[round(x, 3) for x in polls], slots_p99_ms=summarize(polls).get("p99"),
        cache_prefix_tokens=cache["prefix_tokens"], cache_cold_ttft_ms=cache["cold_ttft_ms"],
        cache_warm_ttft_ms=cache["cached_ttft_ms"],
        chat_one_tok_s=chat_one["decode_tok_s"], chat_four_tok_s=aggregate(chat_four),
        chat_ttft_ms=spread(r["ttft_ms"] for r in (chat_one, *chat_short))["median"],
        requests={"single": strip(single), "history": [strip(r) for r in history],
                  "shuffle": [strip(r) for r in shuffle_runs], "four": [strip(r) for r in four],
                  "eight": [strip(r) for r in eight],
                  "cache": [strip(cache["cold"])] + [strip(r) for r in cache["cached"]],
                  "chat_one": strip(chat_one), "chat_short": [strip(r) for r in chat_short],
                  "chat_four": [strip(r) for r in chat_four]})
    return out


BUILD_NOTE = ("scripts/build_llama_server.sh builds it once (about 10 minutes on 2 cores) into the wheel cache; "
              "a full `hydra-rpc bench` run builds it when missing, a --quick run does not "
              "(HYDRA_BENCH_BUILD_LLAMA_SERVER=1 makes it, =0 never builds).")


def skipped(reason: str) -> Result:
    res = Result(NAME)
    res.rows.append(Row(f"skipped: no llama-server ({reason})", None, ""))
    res.summary = {"skipped": reason}
    res.samples = {"skipped": True}
    res.notes.append(f"skipped: no llama-server ({reason}). {BUILD_NOTE}")
    print(f"hydra-rpc bench: {NAME}: skipped: no llama-server ({reason})", file=sys.stderr, flush=True)
    return res


async def run(ctx: BenchContext) -> Result:
    import aiohttp

    binary, reason = await asyncio.to_thread(find_or_build, not ctx.quick)
    if binary is None:
        return skipped(reason)
    res = Result(NAME)
    model = ctx.models.busy if ctx.models.tiny else ctx.models.main  # tiny mode: tiny-small (~0.6 ms/token)
    max_tokens = ctx.pick(200, 32)
    res.config = {"model": model, "llama_server": str(binary), "llama_server_build": build_info(binary),
                  "argv": _argv_shown(ctx.threads, chat_template_args(model)),
                  "ours_adds": ["--rpc-port", "0"], "wide_slots": SLOTS_WIDE, "max_tokens": max_tokens,
                  "rounds": ctx.reps, "threads": ctx.threads, "slots_poll_s": SLOTS_POLL_S, "variants": VARIANTS,
                  "budgets": {k: list(v) for k, v in BUDGETS.items()}}
    rounds: list[dict[str, Any]] = []
    # a new connection per request, for both: llama-server (cpp-httplib) may close a kept-alive
    # connection after a stream, which a pooled client would meet as "Server disconnected"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900),
                                     connector=aiohttp.TCPConnector(force_close=True)) as http:
        for rnd, variant in interleaved(ctx.reps, VARIANTS):
            print(f"hydra-rpc bench: {NAME}: round {rnd + 1}/{ctx.reps}, {variant}", file=sys.stderr, flush=True)
            rounds.append(await one_round(ctx, http, variant, str(binary), model, rnd, max_tokens))
        print(f"hydra-rpc bench: {NAME}: request by request, the two servers alternating", file=sys.stderr, flush=True)
        pairs = await paired(ctx, http, str(binary), model, max_tokens)
        print(f"hydra-rpc bench: {NAME}: the control, llama-server against a second llama-server", file=sys.stderr,
              flush=True)
        control = await paired(ctx, http, str(binary), model, max_tokens, ("llama-server", CONTROL))
        print(f"hydra-rpc bench: {NAME}: RSS beside a bare Python server on the same bindings", file=sys.stderr,
              flush=True)
        floor = await rss_floor(ctx, http, str(binary), model, max_tokens)
    res.samples = {"rounds": rounds, "pairs": pairs, "control": control, "floor": floor}
    report(res, rounds, ctx.reps, pairs, control, floor)
    return res
