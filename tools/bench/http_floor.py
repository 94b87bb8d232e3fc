"""What one HTTP request costs before any model work: ``GET /health`` on a new connection.

    python -m tools.bench.http_floor [--model tiny] [--requests 1000] [--rounds 3] [--out FILE]
    python -m tools.bench.http_floor --table DIR     # the runs DIR/run-N.json in one table

A short completion's first token on tiny-small is a few hundred microseconds of decode and as
much again of the request's path; this measures the HTTP part of that path alone, on five
servers up at once:

* ``llama-server`` and ``ours`` (``hydra-llama-engine``) on the shared llama-server argv
  (:func:`tools.bench.vs_llama_server.start`), model loaded;
* ``raw protocol``: an ``asyncio.Protocol`` on uvloop that reads the request head and writes a
  fixed answer — what Python on this loop costs with no HTTP library;
* ``aiohttp``: a minimal aiohttp application on uvloop (no access log);
* ``our HTTP server``: this server's HTTP side with one route and no engine: the budgeted
  accepts (``conn_budget.Acceptor``), ``http.server``'s connections with their read deadlines,
  ``http.app``'s routing, errors and metrics, the access log.

Each round gives each server a block of ``--requests`` requests (the servers' order rotates),
each on a new connection (``Connection: close``) from a blocking socket, timed from before
``connect`` until the server closed. Reports per server the median wall time and the server's
CPU (every thread, ``/proc/PID/task/*/schedstat``) per request, and both as ratios to llama-server's.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import sys
from itertools import groupby
from pathlib import Path
from typing import Any, Callable

from tools.bench.common import (MODEL_HELP, interleaved, machine_info, min_max_text, parse_against_llama_server,
                                report_run, table_only)
from tools.bench.llama_server import OpenAIServer, build_info, llama_server_or_exit, servers_running
from tools.bench.models import model_set
from tools.bench.slots_poll import timed_get
from tools.bench.vs_llama_server import free_port, start
from tools.spawn import thread_cpu_seconds

MINIMAL = ("raw protocol", "aiohttp", "our HTTP server")
HEALTH_BODY = json.dumps({"status": "ok", "startup_stage": "ready", "has_model": True, "model_name": "m"}).encode()


def health_us(port: int) -> float:
    """One ``GET /health`` on a new connection: µs from before ``connect`` until the close."""
    status, seconds = timed_get(port, "/health")
    if status != 200:
        raise RuntimeError(f"/health answered {status}")
    return seconds * 1e6


def _block(srv: OpenAIServer, n: int) -> tuple[list[float], float]:
    """``n`` timed requests after a few uncounted ones; the server's CPU µs per request."""
    for _ in range(20):
        health_us(srv.port)
    cpu0 = sum(thread_cpu_seconds(srv.pid).values())
    walls = [health_us(srv.port) for _ in range(n)]
    return walls, (sum(thread_cpu_seconds(srv.pid).values()) - cpu0) / n * 1e6


def measure(servers: dict[str, OpenAIServer], n: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    """{server: {"wall_us": [...], "cpu_us": [one per block]}}; the order rotates every round."""
    out: dict[str, dict[str, list[float]]] = {k: {"wall_us": [], "cpu_us": []} for k in servers}
    for _, round_order in groupby(interleaved(rounds, list(servers)), key=lambda pair: pair[0]):
        for _, k in round_order:
            walls, cpu = _block(servers[k], n)
            out[k]["wall_us"] += walls
            out[k]["cpu_us"].append(cpu)
    return out


def summarize(samples: dict[str, dict[str, list[float]]], base: str = "llama-server") -> dict[str, Any]:
    med = statistics.median
    ref_wall, ref_cpu = med(samples[base]["wall_us"]), med(samples[base]["cpu_us"])
    return {k: {"wall_us": round(med(s["wall_us"]), 1), "wall_ratio": round(med(s["wall_us"]) / ref_wall, 3),
                "cpu_us": round(med(s["cpu_us"]), 1), "cpu_ratio": round(med(s["cpu_us"]) / ref_cpu, 3)}
            for k, s in samples.items()}


def runs_table(runs: list[dict[str, Any]]) -> str:
    """Several runs in one table: per server, the medians' and ratios' min–max over the runs."""
    lines = ["| server | wall per request (µs; ratio) | server CPU per request (µs; ratio) |", "|---|---|---|"]
    for k in runs[0]["summary"]:
        cells = []
        for fig in ("wall", "cpu"):
            values = [r["summary"][k][f"{fig}_us"] for r in runs]
            ratios = [r["summary"][k][f"{fig}_ratio"] for r in runs]
            cells.append(f"{min_max_text(values, '.0f')}; {min_max_text(ratios, '.2f')}×")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------- the minimal servers
class _RawHttp(asyncio.Protocol):
    ANSWER = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
              b"Connection: close\r\n\r\n%s" % (len(HEALTH_BODY), HEALTH_BODY))

    def connection_made(self, transport: Any) -> None:
        self.transport, self.head = transport, b""

    def data_received(self, data: bytes) -> None:
        self.head += data
        if b"\r\n\r\n" in self.head:
            self.transport.write(self.ANSWER)
            self.transport.close()


async def _serve(kind: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    if kind == "raw protocol":
        await loop.create_server(_RawHttp, "127.0.0.1", port)
    elif kind == "aiohttp":
        from aiohttp import web

        async def health(request: web.Request) -> web.Response:
            return web.Response(body=HEALTH_BODY, content_type="application/json")

        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
    else:  # this server's HTTP side: its accepts, connections, routing, errors, metrics, access log
        from hydra_rpc.config import ServerConfig
        from hydra_rpc.conn_budget import ConnectionBudget
        from hydra_rpc.http.app import HttpApp
        from hydra_rpc.http.server.messages import Request, Response
        from hydra_rpc.http.server.serve import HttpServer
        from hydra_rpc.observability.metrics import Metrics

        async def our_health(request: Request) -> Response:
            return Response(HEALTH_BODY, content_type="application/json")

        cfg = ServerConfig()
        app = HttpApp(Metrics(), 1 << 20)
        app.router.add_get("/health", our_health)
        HttpServer(app, cfg, ConnectionBudget(cfg.max_connections, 4 * cfg.max_connections)).listen("127.0.0.1", port)
    await asyncio.Event().wait()


def _minimal(kind: str) -> OpenAIServer:
    port = free_port()
    return OpenAIServer([sys.executable, "-m", "tools.bench.http_floor", "--serve", kind, "--port", str(port)],
                        port, kind, timeout=30.0)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.http_floor", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help=MODEL_HELP)
    ap.add_argument("--requests", type=int, default=1000, help="counted requests per block")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve", choices=MINIMAL, help=argparse.SUPPRESS)  # a minimal server's own process
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parse_against_llama_server(ap, argv)
    if args.serve:
        import uvloop

        uvloop.run(_serve(args.serve, args.port))
        return {}
    if (shown := table_only(args, runs_table)) is not None:
        return shown
    binary = llama_server_or_exit()
    model = model_set(args.model).busy
    starts: dict[str, Callable[[], OpenAIServer]] = {
        k: functools.partial(start, k, str(binary), model, 4, args.threads) for k in ("llama-server", "ours")}
    starts.update({k: functools.partial(_minimal, k) for k in MINIMAL})
    with servers_running(starts) as servers:
        samples = measure(servers, args.requests, args.rounds)
    result = {"machine": machine_info(), "model": args.model, "model_file": Path(model).name,
              "llama_server_build": build_info(binary), "threads": args.threads,
              "requests_per_block": args.requests, "rounds": args.rounds,
              "summary": summarize(samples), "samples": samples}
    return report_run(args.out, result, runs_table)


if __name__ == "__main__":
    main()
