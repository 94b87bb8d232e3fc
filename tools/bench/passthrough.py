"""passthrough: a real ggml-RPC client through our port vs straight to the ggml RPC server.

Upstream: llama.cpp's own RPC server from the wheel (``python -m hydra_rpc.ggml.child``).
Candidate: our server with ``--ggml-rpc-upstream`` pointing at it, so the client's
connections (first byte 0x0E) are spliced through. The client is llama.cpp itself
(``workers ggml-client``: register the endpoint, load with every layer offloaded, decode
greedily), once against our port and once against the upstream directly, interleaved.

Bulk: one large SET_TENSOR (what a weight upload is) into a freshly allocated remote
buffer, timed until a later answered command (GET_ALIGNMENT) returns — the server handles
a connection's commands in order, so that answer means every byte was received and stored.

Embedded: the same client through ``--ggml-rpc-embedded`` (a guarded child process per
session, one compute thread like the upstream), and what opening a session costs there —
connect until the HELLO is answered, with the warm spare in place — against a HELLO on the
standalone server.

Where the time goes: the CPU our server and the rpc-server used per 1,000 decoded tokens
(``/proc/PID/stat``, whole client runs), and GET_ALIGNMENT round trips — a hop with no compute
behind it — direct, through the relay to the upstream, and through an embedded child.
"""
from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass, field

from codec import ggml as G
from engine.ggml_rpc_lib import hello, open_session

from .common import BenchContext, BenchError, Result, Row, interleaved, now, percentile, spread
from .procs import GgmlRpcServer, HydraServer, WorkerTimeout, run_worker
from .traffic import messages_for

NAME = "passthrough"
MiB = 1 << 20
UPSTREAM_THREADS = 1


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = s.recv_into(view[got:])
        if not k:
            raise BenchError("ggml RPC server closed the connection")
        got += k
    return bytes(buf)


def _call(s: socket.socket, cmd: int, fields: dict, version) -> dict:
    """A fixed-layout command and its answer, laid out for the server's protocol version."""
    s.sendall(G.encode_request(cmd, G.request_layout(cmd, version).build(fields)))
    size = G.RESPONSE_HEADER_STRUCT.unpack(_recv_exact(s, G.RESPONSE_HEADER_STRUCT.size))[0]
    return G.response_layout(cmd, version).parse(_recv_exact(s, size))


def bulk_set_tensor(host: str, port: int, data: memoryview) -> float:
    """Seconds to upload ``data`` with one SET_TENSOR (blocking sockets; run in a thread)."""
    n = len(data)
    with socket.create_connection((host, port), timeout=120) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        version = hello(s).version
        buf = _call(s, G.Cmd.ALLOC_BUFFER, {"device": 0, "size": n}, version)
        if not buf.remote_ptr:
            raise BenchError(f"ALLOC_BUFFER of {n} bytes refused")
        base = _call(s, G.Cmd.BUFFER_GET_BASE, {"remote_ptr": buf.remote_ptr}, version).base_ptr
        tensor = G.RpcTensor(id=1, type=0, buffer=buf.remote_ptr, ne=(n // 4, 1, 1, 1), nb=(4, n, n, n), data=base,
                             name=b"hydra-bench-bulk")  # f32 vector filling the buffer
        head = G.encode_set_tensor(tensor, 0, b"", version=version)
        t0 = now()
        s.sendall(G.encode_request_header(G.Cmd.SET_TENSOR, len(head) + n) + head)  # the data follows
        s.sendall(data)
        _call(s, G.Cmd.GET_ALIGNMENT, {"device": 0}, version)
        seconds = now() - t0
        free = G.request_layout(G.Cmd.FREE_BUFFER, version).build({"remote_ptr": buf.remote_ptr})
        s.sendall(G.encode_request(G.Cmd.FREE_BUFFER, free))
    return seconds


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.0f}"


def round_trips_us(host: str, port: int, n: int) -> list[float]:
    """``n`` GET_ALIGNMENT round trips on one session, µs each (blocking; run it in a thread):
    what a hop costs without any compute behind it."""
    out = []
    s, reply = open_session(host, port, 30)
    with s:
        s.settimeout(30)
        version = reply.version
        for _ in range(n):
            t0 = now()
            _call(s, G.Cmd.GET_ALIGNMENT, {"device": 0}, version)
            out.append((now() - t0) * 1e6)
    return out


def session_setup_ms(host: str, port: int) -> float:
    """Connect until the HELLO reply is in (a blocking client; run in a thread)."""
    t0 = now()
    with socket.create_connection((host, port), timeout=30) as s:
        hello(s)
    return (now() - t0) * 1e3


def cpu_ms_per_k_tokens(before: dict, procs: dict, tokens: int) -> dict:
    """ms of CPU per 1,000 decoded tokens each of ``procs`` (name → ChildProcess) used since
    ``before`` (its ``cpu_seconds()`` then) — a whole client run: sessions, load, warm-up, decode."""
    out = {}
    for name, p in procs.items():
        now_s = p.cpu_seconds()
        if now_s is not None and before.get(name) is not None and tokens:
            out[name] = (now_s - before[name]) * 1e6 / tokens
    return out


async def client_run(res: Result, way: str, endpoint: tuple[str, int], params: dict, timeout: float) -> dict:
    """One ``workers ggml-client`` run; a run that does not finish is retried once, and the
    report says so (``samples.retries`` and a note, with where it was stuck). Seen a few times in
    tens of runs on a busy 2-core host, on the direct way: llama.cpp's client (in
    ``ggml_backend_rpc_add_server``) waiting on an rpc-server it had just probed — a stall between
    the two llama.cpp ends, not a figure of ours."""
    p = {**params, "endpoint": "%s:%d" % endpoint}
    try:
        return await run_worker("ggml-client", p, timeout)
    except WorkerTimeout as e:
        res.samples.setdefault("retries", []).append({"way": way, "error": str(e)[-3000:]})
        res.notes.append(f"a ggml-client run ({way}) did not finish within {timeout:.0f} s and was run again; "
                         "its stacks are in samples.retries")
        return await run_worker("ggml-client", p, timeout)


async def sample_run(res: Result, way: str, rep: int, endpoint: tuple[str, int], params: dict, timeout: float,
                     procs: dict) -> tuple[dict, dict]:
    """:func:`client_run` and its decode sample, with the CPU ``procs`` used meanwhile."""
    before = {k: p.cpu_seconds() for k, p in procs.items()}
    out = await client_run(res, way, endpoint, params, timeout)
    return out, {"way": way, "rep": rep, "tokens": out["tokens"], "decode_rate": out["decode_rate"],
                 "load_ms": out["load_ms"], "register_ms": out["register_ms"],
                 "cpu_ms_per_k_tokens": cpu_ms_per_k_tokens(before, procs, out["tokens"])}


@dataclass
class _Samples:
    decodes: list[dict] = field(default_factory=list)
    bulks: list[dict] = field(default_factory=list)
    setups: list[dict] = field(default_factory=list)
    trips: dict[str, list[float]] = field(default_factory=lambda: {"direct": [], "proxy": [], "embedded": []})


async def run(ctx: BenchContext) -> Result:
    res = Result(NAME)
    tiny = ctx.models.tiny
    n_predict = ctx.pick(1000 if tiny else 64, 100 if tiny else 16)
    bulk = ctx.pick(256, 32) * MiB
    res.config = {"model": ctx.models.main, "n_predict": n_predict, "bulk_bytes": bulk, "reps": ctx.reps,
                  "upstream_threads": UPSTREAM_THREADS}
    sm = _Samples()
    params = {"model": ctx.models.main, "n_ctx": n_predict + 512, "n_threads": ctx.threads,
              "messages": messages_for(0), "n_predict": n_predict, "warmup": 16,
              "max_seconds": ctx.pick(5.0, 1.5)}
    # one compute thread, rpc-server's default: with two OpenMP threads on a 2-core host that
    # also runs the client and our server, barrier spin-waits make every run a lottery
    upstream = GgmlRpcServer(UPSTREAM_THREADS)
    try:
        ends = {"direct": (upstream.host, upstream.port)}
        await _relay_runs(ctx, res, sm, upstream, ends, params, memoryview(bytes(bulk)))
        await _embedded_runs(ctx, res, sm, ends, params)
    finally:
        upstream.stop()
    res.samples.update({"decodes": sm.decodes, "bulk": sm.bulks, "session_setup": sm.setups,
                        "round_trip_us": {w: [round(x, 1) for x in v] for w, v in sm.trips.items()}})
    _report(res, sm, bulk)
    return res


def _worker_seconds(ctx: BenchContext) -> float:
    return ctx.pick(300.0, 60.0)  # a --quick client takes a few seconds; a stuck one shows its stacks


async def _relay_runs(ctx: BenchContext, res: Result, sm: _Samples, upstream: GgmlRpcServer,
                      ends: dict[str, tuple[str, int]], params: dict, data: memoryview) -> None:
    """Our server with --ggml-rpc-upstream: client runs, round trips and bulk uploads, each
    direct to the upstream and through our port."""
    worker_s, n_trips, bulk = _worker_seconds(ctx), ctx.pick(2000, 300), len(data)
    with HydraServer(["--model", ctx.models.main, "--slots", "1", "--ctx", "1024",
                      "--ggml-rpc-upstream", f"{upstream.host}:{upstream.port}"]) as srv:
        ends["proxy"] = (srv.host, srv.port)
        procs = {"server": srv, "rpc-server": upstream}
        for rep, way in interleaved(ctx.reps, ["direct", "proxy"]):
            out, sample = await sample_run(res, way, rep, ends[way], params, worker_s, procs)
            if not str(out.get("device", "")).startswith("RPC"):
                raise BenchError(f"the ggml client did not offload to RPC: {out}")
            sm.decodes.append(sample)
        for way in ("direct", "proxy", "direct", "proxy"):
            sm.trips[way] += await asyncio.to_thread(round_trips_us, *ends[way], n_trips)
        await asyncio.to_thread(bulk_set_tensor, *ends["direct"], data[:MiB])  # warm-up
        for rep, way in interleaved(ctx.reps, ["direct", "proxy"]):
            sec = await asyncio.to_thread(bulk_set_tensor, *ends[way], data)
            sm.bulks.append({"way": way, "rep": rep, "seconds": sec, "mb_s": bulk / sec / 1e6})


async def _embedded_runs(ctx: BenchContext, res: Result, sm: _Samples, ends: dict[str, tuple[str, int]],
                         params: dict) -> None:
    """Our server with --ggml-rpc-embedded: client runs, round trips and session setups, against
    the standalone upstream."""
    worker_s, n_trips = _worker_seconds(ctx), ctx.pick(2000, 300)
    with HydraServer(["--model", ctx.models.main, "--slots", "1", "--ctx", "1024", "--ggml-rpc-embedded"]) as srv:
        ends["embedded"] = (srv.host, srv.port)
        procs = {"server": srv}
        for rep, way in interleaved(ctx.reps, ["direct", "embedded"]):
            sm.decodes.append((await sample_run(res, way, rep, ends[way], params, worker_s, procs))[1])
        for _ in range(2):
            await asyncio.sleep(0.3)  # the pool's spare child ready
            sm.trips["embedded"] += await asyncio.to_thread(round_trips_us, *ends["embedded"], n_trips)
        for rep, way in interleaved(ctx.pick(10, 3), ["direct", "embedded"]):
            await asyncio.sleep(0.3)  # a session arriving after the pool has its spare ready
            sm.setups.append({"way": way, "rep": rep, "ms": await asyncio.to_thread(session_setup_ms, *ends[way])})


def _report(res: Result, sm: _Samples, bulk: int) -> None:
    """The samples' spreads into ``res.summary`` and its rows."""
    decodes, bulks, setups, trips = sm.decodes, sm.bulks, sm.setups, sm.trips
    tok = {w: spread(d["decode_rate"] for d in decodes if d["way"] == w) for w in ("direct", "proxy", "embedded")}
    mbs = {w: spread(b["mb_s"] for b in bulks if b["way"] == w) for w in ("direct", "proxy")}
    load = {w: spread(d["load_ms"] for d in decodes if d["way"] == w) for w in ("direct", "proxy", "embedded")}
    setup = {w: spread(x["ms"] for x in setups if x["way"] == w) for w in ("direct", "embedded")}
    cpu = {w: {proc: spread(d["cpu_ms_per_k_tokens"].get(proc) for d in decodes if d["way"] == w)
               for proc in ("server", "rpc-server")} for w in ("direct", "proxy", "embedded")}
    rtt = {w: {"p50": round(percentile(v, 50), 1), "p99": round(percentile(v, 99), 1)} if v else {}
           for w, v in trips.items()}
    res.summary = {"decode_tok_s": tok, "bulk_mb_s": mbs, "model_load_ms": load, "session_setup_ms": setup,
                   "cpu_ms_per_1000_tokens": cpu, "round_trip_us": rtt}
    res.rows.append(Row("llama.cpp ggml-RPC client tok/s through our port", tok["proxy"]["median"], "tok/s",
                        tok["direct"]["median"], "direct to the ggml server", "≥ 90 % of direct",
                        note=f"model load {load['proxy']['median']:.0f} vs {load['direct']['median']:.0f} ms",
                        limit=0.9 if tok["direct"]["median"] else None, on="ratio").with_spread(tok["proxy"]))
    relay, compute = cpu["proxy"]["server"], cpu["proxy"]["rpc-server"]
    res.rows.append(Row("our server's CPU per 1,000 tokens relayed (--ggml-rpc-upstream; whole client runs)",
                        relay["median"], "ms", compute["median"], "the rpc-server's own CPU for the same tokens")
                    .with_spread(relay))
    res.rows.append(Row("GET_ALIGNMENT round trip through our port, p50", rtt["proxy"].get("p50"), "µs",
                        rtt["direct"].get("p50"), "direct",
                        note=f"p99 {_fmt(rtt['proxy'].get('p99'))} vs {_fmt(rtt['direct'].get('p99'))} µs; "
                             f"--ggml-rpc-embedded p50 {_fmt(rtt['embedded'].get('p50'))} µs"))
    res.rows.append(Row(f"bulk SET_TENSOR of {bulk // MiB} MiB through our port", mbs["proxy"]["median"], "MB/s",
                        mbs["direct"]["median"], "direct", "≥ 80 % of direct",
                        limit=0.8 if mbs["direct"]["median"] else None, on="ratio").with_spread(mbs["proxy"]))
    res.rows.append(Row("llama.cpp ggml-RPC client tok/s, --ggml-rpc-embedded (a child per session)",
                        tok["embedded"]["median"], "tok/s", tok["direct"]["median"], "direct to a ggml server"))
    res.rows.append(Row("ggml session setup (connect → HELLO answered), --ggml-rpc-embedded",
                        setup["embedded"]["median"], "ms", setup["direct"]["median"], "a standalone ggml server",
                        note=f"max {setup['embedded']['max']} ms"))
