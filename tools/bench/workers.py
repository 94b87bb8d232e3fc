"""Baseline processes the harness runs besides the servers (``python -m tools.bench.workers MODE JSON``).

* ``bare-decode``: the bare llama-cpp-python loop — load the model with the server's settings,
  prefill, then decode 1 token + sample greedily, N times. The baseline of decode-overhead.
* ``bare-batch``: the same loop with k sequences decoded together, one token of each per
  ``llama_decode`` (what the engine's step does for k slots): the ceiling of slots-scaling.
* ``bare-prompt``: a cold document's prompt in the servers' chunks, then a greedy stream: the
  bare process of bindings-floor (:mod:`tools.bench.bindings_floor`).
* ``ggml-client``: the same loop with every layer offloaded to a ggml RPC server at
  ``endpoint`` (directly, or through our port's passthrough).
* ``raw-peer``: a plain blocking-socket peer that sends or swallows N bytes on request: the
  "raw loopback copy" baseline of state-transfer.
* ``echo-server``: a minimal uvloop echo server, the floor of per-request server CPU.
* ``pollers``: N STATE_META pollers (the connections scenario runs several of these, since one
  Python process cannot issue thousands of requests a second without queueing them itself).

Each one-shot mode prints ``BENCH_RESULT <json>`` as its last line.
"""
from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time
from typing import Any

from tools.bench.procs import READY_PREFIX, RESULT_PREFIX
from tools.spawn import cpu_used, thread_cpu_seconds


def greedy_decode(model, tokens: list[int], n_predict: int, seq: int = 0,
                  max_seconds: float | None = None) -> dict[str, Any]:
    """Prefill ``tokens`` (in n_batch chunks), then decode-1 + greedy-sample ``n_predict`` times
    (or until ``max_seconds`` after the first token: a busy host must not stretch a run).

    Returns the wall time of each sampled token, so the rate is computed exactly as the
    harness computes it for streamed pieces (first to last token).
    """
    from engine.llama_backend import BatchItem, SamplerParams
    from tools.bench.common import decode_prompt

    sampler = model.make_sampler(SamplerParams(temperature=0))
    t_start = time.perf_counter()
    decode_prompt(model, seq, tokens)
    pos = len(tokens)
    times: list[float] = []
    tok = sampler.sample(model, seq)
    times.append(time.perf_counter())
    stop_at = times[0] + max_seconds if max_seconds else float("inf")
    while len(times) < n_predict and not model.is_eog(tok) and times[-1] < stop_at:
        model.decode([BatchItem(seq, [tok], pos, True)])
        pos += 1
        tok = sampler.sample(model, seq)
        times.append(time.perf_counter())
    sampler.free()
    n = len(times)
    return {"tokens": n, "prompt_tokens": len(tokens), "t_start": t_start, "t_first": times[0], "t_last": times[-1],
            "decode_rate": (n - 1) / (times[-1] - times[0]) if n > 1 and times[-1] > times[0] else None,
            "e2e_rate": n / (times[-1] - t_start)}


def _load(p: dict[str, Any], **extra):
    from engine.llama_backend import LoadedModel

    if p.get("nice"):
        # the server's inference thread runs at this nice value: the baseline must yield to
        # other work on the host exactly as much (ggml's compute threads inherit it)
        os.setpriority(os.PRIO_PROCESS, 0, int(p["nice"]))

    t0 = time.perf_counter()
    m = LoadedModel(p["model"], n_ctx=p["n_ctx"], n_seq_max=p.get("n_seq_max", 1), n_batch=p.get("n_batch", 512),
                    n_threads=p.get("n_threads"), **extra)
    return m, (time.perf_counter() - t0) * 1000


def _prompt(m, p: dict[str, Any]) -> list[int]:
    return m.chat_tokens(p["messages"]) if p.get("messages") else list(p["tokens"])


def _warm(m, prompt: list[int], p: dict[str, Any]) -> None:
    """A short untimed decode first: the server under test is warm too (graphs, buffers, caches)."""
    if p.get("warmup"):
        greedy_decode(m, prompt, p["warmup"])
        m.seq_clear(0)


def bare_decode(p: dict[str, Any]) -> dict[str, Any]:
    m, load_ms = _load(p)
    try:
        prompt = _prompt(m, p)
        _warm(m, prompt, p)
        before = thread_cpu_seconds(os.getpid())
        out = greedy_decode(m, prompt, p["n_predict"], max_seconds=p.get("max_seconds"))
        # every thread of this process decodes: this one (llama_decode, sampling) and ggml's
        out["compute_cpu_s"] = cpu_used(before, thread_cpu_seconds(os.getpid()))
    finally:
        m.close()
    return {**out, "load_ms": load_ms}


def batched_decode(model, prompts: list[list[int]], n_predict: int, max_seconds: float | None = None) -> dict[str, Any]:
    """Prefill every prompt (sequence i = prompt i), then decode one token of every sequence per
    ``llama_decode`` and sample each greedily, ``n_predict`` times (or for ``max_seconds``).

    A sequence that reaches its end of generation stops the run: the aggregate rate is only
    defined while all of them produce, as in the server's steady window."""
    from engine.llama_backend import BatchItem, SamplerParams

    k = len(prompts)
    samplers = [model.make_sampler(SamplerParams(temperature=0)) for _ in range(k)]
    try:
        for seq in range(k):
            model.seq_clear(seq)
        model.decode([BatchItem(seq, prompt, 0, True) for seq, prompt in enumerate(prompts)])  # < n_batch
        pos = [len(x) for x in prompts]
        toks = [samplers[s].sample(model, s) for s in range(k)]
        times = [time.perf_counter()]
        stop_at = times[0] + max_seconds if max_seconds else float("inf")
        while len(times) < n_predict and times[-1] < stop_at and not any(model.is_eog(t) for t in toks):
            model.decode([BatchItem(s, [toks[s]], pos[s], True) for s in range(k)])
            for s in range(k):
                pos[s] += 1
            toks = [samplers[s].sample(model, s) for s in range(k)]
            times.append(time.perf_counter())
    finally:
        for s in samplers:
            s.free()
    n = len(times)
    rate = k * (n - 1) / (times[-1] - times[0]) if n > 1 and times[-1] > times[0] else None
    return {"sequences": k, "steps": n, "aggregate_tok_s": rate}


def bare_batch(p: dict[str, Any]) -> dict[str, Any]:
    """``batched_decode`` for each of ``rounds`` (a list of sequence counts, in the harness's
    interleaved order), on one loaded model: one load, the rounds as alike as the server's."""
    m, load_ms = _load(p)
    try:
        prompts = [m.chat_tokens(x) for x in p["messages"]]
        batched_decode(m, prompts[:1], p.get("warmup", 32))  # warm: graphs, buffers, caches
        rounds = [batched_decode(m, prompts[:k], p["n_predict"], p.get("max_seconds")) for k in p["rounds"]]
    finally:
        m.close()
    return {"rounds": rounds, "load_ms": load_ms}


def ggml_client(p: dict[str, Any]) -> dict[str, Any]:
    from engine.ggml_rpc_lib import list_devices, register_rpc_server

    t0 = time.perf_counter()
    device = register_rpc_server(p["endpoint"])
    reg_ms = (time.perf_counter() - t0) * 1000
    m, load_ms = _load(p, n_gpu_layers=99)
    try:
        prompt = _prompt(m, p)
        _warm(m, prompt, p)
        out = greedy_decode(m, prompt, p["n_predict"], max_seconds=p.get("max_seconds"))
    finally:
        m.close()
    return {**out, "register_ms": reg_ms, "load_ms": load_ms, "device": device,
            "devices": [d["name"] for d in list_devices()]}


def pollers(p: dict[str, Any]) -> dict[str, Any]:
    """``n`` STATE_META pollers on their own connections for ``seconds``; their first polls are
    spread over one interval (``index0``/``of``: this process's place among all pollers)."""
    import asyncio

    import uvloop

    from codec.enums import Op
    from tools.bench.traffic import Poller, latencies

    n, interval = p["n"], p["interval"]
    if p.get("realtime"):
        # a stand-in for a client on another host: this host's CPU-bound processes must not
        # delay the client's own reads (where SCHED_RR is not permitted, it stays normal)
        try:
            os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(10))
        except OSError:
            pass

    async def go() -> list:
        # all poller processes start together, after every one of them has finished importing
        await asyncio.sleep(max(0.0, p.get("start_at", 0) - time.time()))
        stop = asyncio.Event()
        ps = [Poller(p["host"], p["port"], [(Op.STATE_META, str((p["index0"] + i) % p["slots"]))], interval,
                     phase=interval * (p["index0"] + i) / p["of"]) for i in range(n)]
        tasks = [asyncio.create_task(x.run(stop)) for x in ps]
        await asyncio.sleep(p["seconds"])
        stop.set()
        return [poll for polls in await asyncio.gather(*tasks) for poll in polls]

    c0 = os.times()
    polls = uvloop.run(go())
    c1 = os.times()
    out = {"latencies_ms": [round(x, 4) for x in latencies(polls)], "errors": sum(1 for x in polls if x.status != 0),
           "cpu_s": (c1.user + c1.system) - (c0.user + c0.system)}
    if p.get("timeline"):  # send times on the harness's clock (perf_counter: CLOCK_MONOTONIC, shared)
        out["polls"] = [[round(x.t, 5), round(x.ms, 4), x.status] for x in polls]
    return out


def raw_peer(p: dict[str, Any]) -> None:
    """Serve ``[u8 cmd][u64 n]`` requests one connection at a time: ``G`` → send n bytes,
    ``P`` → receive n bytes then ack one byte, ``Q`` → exit. Buffers are preallocated, so the
    copy costs only the kernel's socket work on this side."""
    buf = bytearray(p["max_bytes"])
    view = memoryview(buf)
    srv = socket.create_server(("127.0.0.1", 0))
    print(f"{READY_PREFIX}{srv.getsockname()[1]}", flush=True)
    while True:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while True:
                head = _recv_exact(conn, 9)
                if head is None:
                    break
                cmd, n = head[0], struct.unpack("<Q", head[1:])[0]
                if cmd == ord("Q"):
                    return
                if cmd == ord("G"):
                    conn.sendall(view[:n])
                elif cmd == ord("P"):
                    got = 0
                    while got < n:
                        k = conn.recv_into(view[got:n])
                        if not k:
                            break
                        got += k
                    conn.sendall(b"\x01")


def echo_server(_p: dict[str, Any]) -> None:
    """The floor of a request's server CPU: a minimal uvloop server that writes back whatever
    arrives (one ``data_received`` → one ``write``), until killed."""
    import asyncio

    import uvloop

    class Echo(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.transport.write(data)

    async def serve() -> None:
        srv = await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", 0)
        print(f"{READY_PREFIX}{srv.sockets[0].getsockname()[1]}", flush=True)
        await asyncio.Event().wait()

    uvloop.run(serve())


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def bare_prompt(p: dict[str, Any]) -> dict[str, Any]:
    """bindings-floor's bare process: a cold ``document`` decoded in the chunks the servers use
    (its time), then a greedy stream of ``n_predict`` tokens on ``prompt`` in another sequence."""
    from engine.llama_backend import BatchItem
    from tools.bench.bindings_floor import chunk_ends

    m, load_ms = _load(p, kv_unified=False)
    try:
        doc = m.tokenize(p["document"], add_special=True)
        t0, at = time.perf_counter(), 0
        for end in chunk_ends(len(doc), bool(m.n_swa or m.recurrent), m.n_batch, m.n_ubatch):
            m.decode([BatchItem(0, doc[at:end], at, end == len(doc))])
            at = end
        prompt_ms = (time.perf_counter() - t0) * 1000
        out = greedy_decode(m, m.tokenize(p["prompt"], add_special=True), p["n_predict"], seq=1)
    finally:
        m.close()
    return {"prompt_ms": prompt_ms, "prompt_n": len(doc), "tok_s": out["decode_rate"], "load_ms": load_ms}


MODES = {"bare-decode": bare_decode, "bare-batch": bare_batch, "bare-prompt": bare_prompt, "ggml-client": ggml_client,
         "pollers": pollers}


def main(argv: list[str]) -> int:
    mode, params = argv[0], json.loads(argv[1]) if len(argv) > 1 else {}
    if mode in ("raw-peer", "echo-server"):
        (raw_peer if mode == "raw-peer" else echo_server)(params)
        return 0
    if params.get("stack_dump_after"):
        # a worker stuck inside native code (a ggml-RPC round trip nobody answers) says where:
        # its threads' stacks go to stderr, which the harness shows when it gives up on it
        import faulthandler

        faulthandler.dump_traceback_later(params["stack_dump_after"], exit=False)
    out = MODES[mode](params)
    write_result(out)
    return 0


def write_result(out: dict[str, Any]) -> None:
    """The ``BENCH_RESULT`` line, whole. A timeline makes it hundreds of KiB: more than a pipe
    holds, and stdout's descriptor may have been left non-blocking (a full run once read a
    result cut at 64 KiB — ``print`` on an unbuffered stdout does not retry a partial write)."""
    sys.stdout.flush()
    data = memoryview((RESULT_PREFIX + json.dumps(out) + "\n").encode())
    os.set_blocking(sys.stdout.fileno(), True)
    while data:
        data = data[os.write(sys.stdout.fileno(), data):]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
