"""``hydra-rpc call``: one Hydra request from the command line ("curl for Hydra").

    hydra-rpc call INFO
    hydra-rpc call STATE_META --key 0
    hydra-rpc call PREFILL --key 0 --json '{"messages":[{"role":"user","content":"hi"}]}'
    hydra-rpc call DECODE --key 0 --json '{"n_predict":32,"messages":null}'   # streams tokens

Prints the status name, the meta pretty-printed and a payload summary (stderr), and
streamed DECODE text (stdout). Exit code 0 only for OK.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys

from codec.dialects import decode_dialect, pin_stream_follows
from codec.enums import Op, Status, status_name
from codec.payloads import decode_token_frames

from .client import HydraClient, parse_meta


def _op(s: str) -> int:
    try:
        return Op[s.upper()]
    except KeyError:
        try:
            return int(s, 0)
        except ValueError:
            raise argparse.ArgumentTypeError(f"unknown op {s!r} (names: {', '.join(o.name for o in Op)})") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("op", type=_op, help="opcode name (INFO, STATE_META, PREFILL, DECODE, ...) or number")
    p.add_argument("--target", default="127.0.0.1:9503", help="HOST:PORT (default 127.0.0.1:9503)")
    p.add_argument("--key", default="", help="slot id (or Store key)")
    p.add_argument("--trace", default="hydra-rpc-call")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--json", help="payload: a JSON text (sent as given)")
    src.add_argument("--payload-file", help="payload: the bytes of this file ('-' for stdin)")
    src.add_argument("--text", help="payload: a UTF-8 string (e.g. SET_EXPERT_MODE solo)")
    p.add_argument("--raw", action="store_true", help="write the response payload bytes to stdout")
    p.add_argument("--out", help="write the response payload to this file")
    p.add_argument("--timeout", type=float, default=600.0)


def _payload(args) -> bytes:
    if args.json is not None:
        json.loads(args.json)  # fail early on a typo
        return args.json.encode()
    if args.text is not None:
        return args.text.encode()
    if args.payload_file == "-":
        return sys.stdin.buffer.read()
    if args.payload_file:
        with open(args.payload_file, "rb") as f:
            return f.read()
    return b""


def _summary(payload: bytes) -> str:
    head = payload[:32].hex(" ")
    return f"payload: {len(payload)} bytes" + (f"  [{head}{' …' if len(payload) > 32 else ''}]" if payload else "")


async def _call(args) -> int:
    host, _, port = args.target.rpartition(":")
    payload = _payload(args)
    c = await HydraClient.connect(host, int(port))
    try:
        async with asyncio.timeout(args.timeout):
            await c.send(args.op, args.key, payload, args.trace)
            hdr, meta_raw = await c.read_head()
            print(f"{status_name(hdr.status)} (0x{hdr.status:02x})", file=sys.stderr)
            meta = parse_meta(meta_raw)
            if meta is not None:
                print(json.dumps(meta, indent=2, ensure_ascii=False), file=sys.stderr)
            if pin_stream_follows(decode_dialect(payload) if args.op == Op.DECODE else None, hdr):
                n = 0  # PIN stream: pieces until the server closes
                async for piece in c.pin_pieces():
                    sys.stdout.buffer.write(piece)
                    sys.stdout.flush()
                    n += 1
                print(f"\n[{n} tokens streamed]", file=sys.stderr)
                return 0
            data = await c.reader.readexactly(hdr.payload_len) if hdr.payload_len else b""
    finally:
        await c.close()
    if args.out:
        with open(args.out, "wb") as f:
            f.write(data)
    if args.raw:
        sys.stdout.buffer.write(data)
    elif args.op == Op.DECODE and meta and "tokens_generated" in meta and len(data) == 9 * meta["tokens_generated"]:
        print(" ".join(f"{f.token_id}({f.logprob:.2f})" for f in decode_token_frames(data)))
    elif data and args.op == Op.DECODE:
        sys.stdout.buffer.write(data + b"\n")
    print(_summary(data), file=sys.stderr)
    return 0 if hdr.status == Status.OK else 1


def run(args) -> int:
    try:
        return asyncio.run(_call(args))
    except (OSError, asyncio.IncompleteReadError, TimeoutError) as e:
        print(f"hydra-rpc call: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
