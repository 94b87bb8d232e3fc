"""state-transfer: STATE_GET / STATE_PUT throughput and the server's peak RSS growth.

One slot's KV state is grown step by step (E1 PREFILL of more and more tokens; the cached
prefix is reused, so each step only computes the new tokens). At each size the harness
moves the state out (STATE_GET) and back in (STATE_PUT), interleaved with a raw loopback
copy of the same number of bytes to and from a plain-socket peer process
(``workers raw-peer``) — the same client code on this side, only the server differs.

Peak RSS growth: the server's VmHWM is reset (``/proc/PID/clear_refs``) before each
transfer and read after it; growth = peak − RSS before, against the state size. The server
runs with a fixed glibc mmap threshold, so every large buffer is a fresh mapping that is
returned on free: with glibc's default (a threshold that rises to 32 MiB after the first
big free) a transfer may reuse a buffer the previous one left resident and show no growth.
"""
from __future__ import annotations

import asyncio
import random
import struct

from codec import payloads as P
from codec.enums import Op, Status
from codec.framing import encode_request_header
from hydra_rpc.client import HydraClient

from .common import BenchContext, BenchError, Result, Row, interleaved, now, spread
from .procs import HydraServer, RawPeer
from .traffic import request_ok, wait_generation

NAME = "state-transfer"
OPS = ["raw-get", "get", "raw-put", "put"]
MiB = 1 << 20
SERVER_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}
BUDGET_BYTES = 256 * MiB
READ_CHUNK = 1 << 20


async def read_into(reader: asyncio.StreamReader, n: int) -> bytearray:
    """Read exactly ``n`` bytes into one preallocated buffer (no join of many chunks)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        data = await reader.read(min(READ_CHUNK, n - got))
        if not data:
            raise asyncio.IncompleteReadError(bytes(view[:got]), n)
        view[got:got + len(data)] = data
        got += len(data)
    return buf


async def hydra_get(c: HydraClient, marks: dict | None = None) -> bytearray:
    t0 = now()
    await c.send(Op.STATE_GET, "0")
    hdr, meta = await c.read_head()
    if marks is not None:  # until the header: the server copying the state out of llama.cpp
        marks["head_s"] = round(now() - t0, 6)
    if hdr.status != Status.OK:
        raise BenchError(f"STATE_GET answered status {hdr.status}: {meta[:300]!r}")
    return await read_into(c.reader, hdr.payload_len)


async def hydra_put(c: HydraClient, blob: bytes, marks: dict | None = None) -> dict:
    # header and key, then the blob itself: no 256 MiB concatenation on this side
    t0 = now()
    c.writer.write(encode_request_header(Op.STATE_PUT, 1, len(blob), 0) + b"0")
    c.writer.write(memoryview(blob))
    await c.writer.drain()
    if marks is not None:  # after this only socket buffers and the server's restore remain
        marks["sent_s"] = round(now() - t0, 6)
    r = await c.read_response()
    if r.status != Status.OK or not (r.meta or {}).get("restored"):
        raise BenchError(f"STATE_PUT answered {r!r}")
    if marks is not None:  # the server's own share: header checks and llama_state_seq_set_data
        marks["restore_ms"] = r.meta.get("restore_ms")
    return r.meta


async def raw_get(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
    w.write(b"G" + struct.pack("<Q", n))
    await w.drain()
    await read_into(r, n)


async def raw_put(r: asyncio.StreamReader, w: asyncio.StreamWriter, blob: bytes) -> None:
    w.write(b"P" + struct.pack("<Q", len(blob)))
    w.write(memoryview(blob))
    await w.drain()
    await r.readexactly(1)


async def settle(srv: HydraServer) -> None:
    """Let the server drop what the previous transfer left behind before RSS is sampled.

    The engine actor keeps its last mailbox message — and with it the last STATE_GET's
    result — alive until the next message arrives, so a no-op CONFIGURE (which goes through
    the mailbox) is sent first; without it a GET right after a GET reuses the retained
    buffer's pages and shows no growth at all.
    """
    await request_ok(srv.host, srv.port, Op.CONFIGURE, "", b"{}")
    await asyncio.sleep(0.02)


async def _size_step(srv: HydraServer, c: HydraClient, reps: int, n_tokens: int) -> dict:
    blob = await hydra_get(c)  # warm-up, and the bytes every variant moves
    meta = await request_ok(srv.host, srv.port, Op.STATE_META, "0")
    state_size = meta.get("state_size") or len(blob)
    peer = RawPeer(len(blob))
    try:
        r, w = await asyncio.open_connection(peer.host, peer.port, limit=READ_CHUNK)
        try:
            await raw_get(r, w, len(blob))  # warm-up
            samples = []
            for rep, op in interleaved(reps, OPS):
                await settle(srv)
                srv.reset_peak()
                rss0 = srv.rss_kib() or 0
                marks: dict = {}
                t0 = now()
                if op == "get":
                    got = await hydra_get(c, marks)
                    if len(got) != len(blob):
                        raise BenchError(f"STATE_GET returned {len(got)} bytes, expected {len(blob)}")
                    del got
                elif op == "put":
                    await hydra_put(c, blob, marks)
                elif op == "raw-get":
                    await raw_get(r, w, len(blob))
                else:
                    await raw_put(r, w, blob)
                dt = now() - t0
                peak = srv.peak_kib()
                samples.append({"op": op, "rep": rep, "seconds": round(dt, 6), "mb_s": len(blob) / dt / 1e6, **marks,
                                "server_rss_growth_bytes": None if op.startswith("raw") or peak is None
                                else max(0, (peak - rss0) * 1024)})
        finally:
            w.close()
            await w.wait_closed()
    finally:
        peer.stop()
    return {"n_past": n_tokens, "state_bytes": state_size, "blob_bytes": len(blob), "samples": samples}


async def run(ctx: BenchContext) -> Result:
    res = Result(NAME)
    ms = ctx.models
    steps = ctx.pick(ms.state_tokens, ms.state_tokens_quick)
    res.config = {"model": ms.state, "cache_type": ms.state_cache_type or "f16 (default)", "n_past_steps": steps,
                  "reps": ctx.reps, "threads": ctx.threads, "server_env": SERVER_ENV}
    sizes = await _measure_sizes(ctx, steps)
    res.samples = {"sizes": sizes}
    _report(res, sizes)
    return res


async def _measure_sizes(ctx: BenchContext, steps: tuple[int, ...]) -> list[dict]:
    """For each context length of ``steps`` (ascending): prefill slot 0 to it and time the transfers."""
    ms = ctx.models
    sizes = []
    with HydraServer(["--model", ms.state, "--slots", "1", "--ctx", str(max(steps) + 256),
                      "--threads", str(ctx.threads)], env=SERVER_ENV) as srv:
        if ms.state_cache_type:
            t = ms.state_cache_type
            out = await request_ok(srv.host, srv.port, Op.CONFIGURE, "",
                                   P.dumps_compact({"cache_type_k": t, "cache_type_v": t}))
            await wait_generation(srv.host, srv.port, out["config_generation"])
        n_vocab = (await request_ok(srv.host, srv.port, Op.INFO)).get("n_vocab") or 256
        rnd = random.Random(7)
        tokens = [rnd.randrange(3, n_vocab) for _ in range(max(steps))]
        async with await HydraClient.connect(srv.host, srv.port) as c:
            for n in steps:
                t0 = now()
                r = await c.request(Op.PREFILL, "0", P.encode_e1_tokens(tokens[:n]), timeout=1800)
                if r.status != Status.OK:
                    raise BenchError(f"PREFILL of {n} tokens answered {r!r}")
                prefill_s = now() - t0
                step = await _size_step(srv, c, ctx.reps, n)
                step["prefill_s"] = round(prefill_s, 3)
                sizes.append(step)
    return sizes


def _report(res: Result, sizes: list[dict]) -> None:
    """Each size's spreads; the rows, for the largest state."""
    for s in sizes:
        s["summary"] = {op: {"mb_s": spread(x["mb_s"] for x in s["samples"] if x["op"] == op),
                             "rss_growth_x": spread(x["server_rss_growth_bytes"] / s["state_bytes"]
                                                    for x in s["samples"] if x["op"] == op
                                                    and x["server_rss_growth_bytes"] is not None)}
                        for op in OPS}
    res.summary = {f"{s['state_bytes'] / MiB:.1f} MiB": s["summary"] for s in sizes}
    big = sizes[-1]
    size_mib = big["state_bytes"] / MiB
    at_budget = big["state_bytes"] >= 0.99 * BUDGET_BYTES
    na = "" if at_budget else f"largest state here is {size_mib:.3g} MiB, the budget is set at 256 MiB"
    for op, name in (("get", "STATE_GET"), ("put", "STATE_PUT")):
        sm = big["summary"]
        v, raw = sm[op]["mb_s"]["median"], sm[f"raw-{op}"]["mb_s"]["median"]
        res.rows.append(Row(f"{name} throughput, {size_mib:.3g} MiB state", v, "MB/s", raw,
                            f"raw loopback {op.upper()}", "≥ 0.9× the raw copy at 256 MiB", note=na,
                            limit=0.9 if at_budget and raw else None, on="ratio").with_spread(sm[op]["mb_s"]))
    # where a PUT's time goes: its bytes in (and the reply out) against the raw copy, and the
    # restore (header checks + llama_state_seq_set_data, which takes the whole state in one
    # call, so it cannot start before the last byte is in)
    puts = [x for x in big["samples"] if x["op"] == "put" and x.get("restore_ms") is not None]
    if puts:
        moved = spread(big["blob_bytes"] / (x["seconds"] - x["restore_ms"] / 1000) / 1e6 for x in puts)
        restore = spread(x["restore_ms"] for x in puts)
        res.summary["put_split"] = {"transfer_mb_s": moved, "restore_ms": restore}
        res.rows.append(Row(f"STATE_PUT without its restore, {size_mib:.3g} MiB state", moved["median"], "MB/s",
                            big["summary"]["raw-put"]["mb_s"]["median"], "raw loopback PUT",
                            note=f"the restore into llama.cpp after the last byte: {restore['median'] or 0:.0f} ms "
                                 f"(min–max {restore['min'] or 0:.0f}–{restore['max'] or 0:.0f})").with_spread(moved))
    for op, name in (("get", "STATE_GET"), ("put", "STATE_PUT")):
        g = big["summary"][op]["rss_growth_x"]["median"]
        res.rows.append(Row(f"{name} peak server RSS growth, {size_mib:.3g} MiB state", g, "× state", None, "",
                            "≤ 1.2 × state size", None if g is None else g <= 1.2
                            ).with_spread(big["summary"][op]["rss_growth_x"]))
