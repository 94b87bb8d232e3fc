"""A deliberately broken Hydra server: the fuzzer's known-bad target.

It behaves like a careful server except for the three C++ engine failure classes of
docs/protocol.md §3, so a fuzzer run against it must find exactly these:

1. **desync** — an unknown opcode is answered ``ERROR(0,0)`` *without reading its payload*:
   the payload bytes are then parsed as the next request header;
2. **hang** — a payload_len above 1 GiB on an opcode that reads its payload makes the
   handler give up silently: no reply, the connection is never closed (the WS/NEW thread
   pool swallows the allocation exception);
3. **crash** — a DECODE v3 frame whose control-header hash does not match aborts the
   process (SIGABRT, like an uncaught exception in a detached std::thread).

With ``--fragile-config`` it also dies like llama.cpp on a CONFIGURE or PREFILL
``hydra_config`` whose ``flash_attn`` is not one of its values (``{"flash_attn": 7}``).

With ``--tracebacks`` a CONFIGURE whose body is JSON but not an object raises inside the
handler; the connection loop logs the traceback (to stderr, so ``target.log``) and answers
ERROR as if nothing happened — a bug only the log shows.

With ``--greedy-config`` a CONFIGURE ``{"n_ctx": N}`` (1 ≤ N ≤ 2^24) is accepted like our
server accepts it (``deferred_keys``, tier T2, a reload) and N × 8 bytes are allocated and
kept: memory the request asked for, not a leak.

Standalone on purpose (stdlib + xxhash, no project imports), so nothing the fuzzer tests
leaks into it. Usage: ``python tests/broken_server.py --port 0`` prints
``broken-server listening on HOST:PORT``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import struct
import sys
import traceback

import xxhash

REQ = struct.Struct("<HBBHQH")
MAGIC = 0x4859
OK, NOT_FOUND, ERROR, BAD_REQUEST, NOT_IMPLEMENTED = 0, 1, 2, 5, 6
KNOWN = {0x30, 0x31, 0x32, 0x40, 0x41, 0x42, 0x43, 0x44, 0x45, 0x46}
NO_PAYLOAD = {0x30, 0x32, 0x41}
HANG_ABOVE = 1 << 30
MAX_DRAIN = 64 << 20
N_SLOTS = 4


def response(status: int, meta: dict | None = None, payload: bytes = b"") -> bytes:
    m = json.dumps(meta, separators=(",", ":")).encode() if meta is not None else b""
    return struct.pack("<IQ", status | (len(m) << 8), len(payload)) + m + payload


def slot_of(key: bytes) -> int | None:
    try:
        s = int(key.decode("ascii").strip() or "0")
    except (UnicodeDecodeError, ValueError):
        return None
    return s if 0 <= s < N_SLOTS else None


def abort_like_cpp() -> None:
    # No core file for a deliberate abort; then die by SIGABRT as std::terminate does.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.abort()


FRAGILE_CONFIG = False
TRACEBACKS = False
GREEDY_CONFIG = False
KEPT: list[bytes] = []  # --greedy-config: the "KV cache" a CONFIGURE n_ctx asked for
MAX_CTX = 1 << 24
FLASH_ATTN_VALUES = ("on", "off", "auto", -1, 0, 1, True, False)


def config_of(op: int, payload: bytes) -> dict:
    try:
        body = json.loads(payload or b"{}")
    except ValueError:
        return {}
    if op == 0x42 and isinstance(body, dict):
        body = body.get("hydra_config")
    return body if isinstance(body, dict) else {}


def answer(op: int, key: bytes, payload: bytes) -> bytes:
    if FRAGILE_CONFIG and op in (0x40, 0x42):
        fa = config_of(op, payload).get("flash_attn", "auto")
        if not any(fa == v and type(fa) is type(v) for v in FLASH_ATTN_VALUES):
            abort_like_cpp()  # llama.cpp asserts on the flash_attn_type enum
    if op == 0x41:
        return response(OK, {"engine": "broken-server", "version": "E1", "capabilities": []})
    if op == 0x40 and (TRACEBACKS or GREEDY_CONFIG):
        try:
            body = json.loads(payload or b"{}")
        except ValueError:
            body = {}
        if TRACEBACKS:
            body.keys()  # AttributeError for a list, a number, a string: the planted bug
        n_ctx = body.get("n_ctx") if GREEDY_CONFIG and isinstance(body, dict) else None
        if type(n_ctx) is int and 1 <= n_ctx <= MAX_CTX:
            KEPT[:] = [b"\x01" * (n_ctx * 8)]  # touched, so it counts in the peak RSS
            return response(OK, {"success": True, "tier": "T2", "params_applied": {}, "deferred_keys": ["n_ctx"],
                                 "rejected_keys": {}, "reload": "loading"})
    slot = slot_of(key)
    if slot is None and op != 0x40 and op != 0x44 and op != 0x45:
        return response(NOT_FOUND, {"error": "invalid slot ID"})
    if op == 0x32:
        return response(OK, {"slot_id": slot, "n_past": 0, "state_size": 0, "is_processing": False,
                             "is_transferring": False})
    if op == 0x30:
        return response(NOT_FOUND, {"error": "slot has no state"})
    if op == 0x43 and len(payload) >= 12:
        hdr_len, hdr_hash = struct.unpack_from("<IQ", payload)
        if 0 < hdr_len <= 32768 and 12 + hdr_len <= len(payload) and payload[12:13] == b"{":
            if xxhash.xxh3_64_intdigest(payload[12:12 + hdr_len]) != hdr_hash:
                abort_like_cpp()  # failure class 3
            return response(BAD_REQUEST, {"error": "merged decode is not supported here"})
    if op == 0x46:
        return response(NOT_IMPLEMENTED, {"error": "not implemented", "success": False})
    if op in (0x42, 0x43, 0x31):
        return response(ERROR, {"error": "this test server runs no model"})
    return response(OK, {"success": True})


async def read_exact(reader: asyncio.StreamReader, n: int) -> bytes:
    return await reader.readexactly(n) if n else b""


async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            try:
                head = await reader.readexactly(16)
            except asyncio.IncompleteReadError:
                return
            magic, op, _flags, key_len, payload_len, trace_len = REQ.unpack(head)
            if magic != MAGIC:
                return  # bad magic: close without a reply
            key = await read_exact(reader, key_len)
            await read_exact(reader, trace_len)
            if op not in KNOWN:
                writer.write(response(ERROR))  # failure class 1: the payload stays unread
                await writer.drain()
                continue
            if op not in NO_PAYLOAD and payload_len > HANG_ABOVE:
                await asyncio.Event().wait()  # failure class 2: the exception was swallowed
            if op in NO_PAYLOAD and payload_len > MAX_DRAIN:
                writer.write(response(ERROR, {"error": "payload too large to drain"}))
                await writer.drain()
                return
            payload = await read_exact(reader, payload_len)
            try:
                reply = answer(op, key, b"" if op in NO_PAYLOAD else payload)
            except Exception:  # --tracebacks: logged, then answered as if all was well
                print(f"ERROR request op=0x{op:02x} failed", file=sys.stderr, flush=True)
                traceback.print_exc(file=sys.stderr)
                sys.stderr.flush()
                reply = response(ERROR, {"error": "internal error"})
            writer.write(reply)
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def main(host: str, port: int) -> None:
    server = await asyncio.start_server(serve, host, port, reuse_address=True, limit=1 << 20)
    h, p = server.sockets[0].getsockname()[:2]
    print(f"broken-server listening on {h}:{p}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--fragile-config", action="store_true")
    ap.add_argument("--tracebacks", action="store_true")
    ap.add_argument("--greedy-config", action="store_true")
    args = ap.parse_args()
    FRAGILE_CONFIG = args.fragile_config
    TRACEBACKS = args.tracebacks
    GREEDY_CONFIG = args.greedy_config
    try:
        asyncio.run(main(args.host, args.port))
    except KeyboardInterrupt:
        pass
