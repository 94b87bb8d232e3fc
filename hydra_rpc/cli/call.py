"""``hydra-rpc call``: one Hydra request from the command line ("curl for Hydra").

    hydra-rpc call INFO | jq .model_name
    hydra-rpc call STATE_META --key 0
    hydra-rpc call PREFILL --key 0 --json '{"prompt":"The capital of France is"}' --out slot0.kv
    hydra-rpc call DECODE --key 0 --json '{"n_predict":32,"messages":null}'   # streams text
    hydra-rpc call --describe DECODE          # the request formats an opcode takes

stdout: the reply's meta as JSON, so it pipes into jq (a streamed DECODE: the text as it
arrives; --raw: the payload bytes). stderr: the status line and a payload summary; -v adds
every byte sent and received, with the header fields decoded.
Exit status: 0 OK, 1 any other status (or a CONFIGURE that applied none of its keys), 2 a
usage or connection error. --out writes only an OK reply: after an error reply the file is
left as it was.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from typing import Any, Callable

from codec.dialects import decode_dialect, pin_stream_follows
from codec.enums import Op, Status, op_name, status_name
from codec.errors import CodecError
from codec.framing import (
    REQUEST_HEADER,
    REQUEST_HEADER_SIZE,
    RESPONSE_HEADER,
    encode_request,
    encode_response_header,
)
from codec.payloads import decode_token_frames

from hydra_rpc.client import HydraClient, ReplyCut, parse_meta
from hydra_rpc.config import parse_hostport
from hydra_rpc.cli.usage import UsageError

HEX_PREVIEW = 32  # payload bytes shown in the summary
VERBOSE_BYTES = 256  # bytes of each part shown by -v


def _op(s: str) -> int:
    try:
        return Op[s.upper()]
    except KeyError:
        pass
    try:
        op = int(s, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"unknown opcode {s!r}; use a name ({', '.join(o.name for o in Op)}) "
                                         "or a number like 0x41") from None
    if not 0 <= op <= 0xFF:
        raise argparse.ArgumentTypeError(f"opcode {s} does not fit the u8 op field")
    return op


def _target(s: str) -> tuple[str, int]:
    try:
        return parse_hostport(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {s!r}; e.g. --target 127.0.0.1:9503") from None


class HelpAction(argparse.Action):
    """``call OP --help``: the usual help, then the request formats OP takes."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.print_help()
        op = getattr(namespace, "op", None)
        if op is not None:
            from hydra_rpc.cli.call_formats import describe

            print(f"\nRequest formats of {describe(op)}", end="")
        parser.exit()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.add_argument("op", type=_op, nargs="?",
                   help="opcode name (INFO, STATE_META, PREFILL, DECODE, ...) or number; `call OP --help` "
                        "also lists the formats OP takes")
    p.add_argument("--describe", type=_op, metavar="OP", help="print the request formats OP takes and exit")
    p.add_argument("--target", type=_target, default="127.0.0.1:9503", help="the engine port, HOST:PORT")
    p.add_argument("--key", default="", help="slot number (or Store key); empty means slot 0 for INFO and CONFIGURE")
    p.add_argument("--trace", default="hydra-rpc-call", help="trace id sent with the request")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--json", help="payload: a JSON text, checked and sent as given")
    src.add_argument("--payload-file", metavar="FILE", help="payload: the bytes of FILE ('-' reads stdin)")
    src.add_argument("--text", help="payload: a UTF-8 string (e.g. SET_EXPERT_MODE solo)")
    p.add_argument("--raw", action="store_true", help="write the reply payload bytes to stdout instead of the meta")
    p.add_argument("--out", metavar="FILE",
                   help="save an OK reply's payload to FILE (a reply with no payload: its meta JSON); after an "
                        "error reply FILE is left untouched and the exit status is 1")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="show the bytes sent and received on stderr, header fields decoded")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the whole reply")


def _payload(args: argparse.Namespace) -> bytes:
    if args.json is not None:
        try:
            json.loads(args.json)
        except ValueError as e:
            raise UsageError(f"--json is not valid JSON: {e}; quote it for the shell, e.g. "
                             "--json '{\"n_predict\":8}'") from None
        return args.json.encode()
    if args.text is not None:
        return args.text.encode()
    if args.payload_file == "-":
        return sys.stdin.buffer.read()
    if args.payload_file:
        try:
            with open(args.payload_file, "rb") as f:
                return f.read()
        except OSError as e:
            raise UsageError(f"cannot read --payload-file {args.payload_file}: {e.strerror or e}") from None
    return b""


def _err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _fields(layout, raw: bytes, names: dict[str, Callable[[int], str]]) -> str:
    """``name=value`` for every field of a codec header layout, some values named."""
    parsed = layout.parse(raw)
    return " ".join(f"{k}={names[k](v) if k in names else v}" for k, v in parsed.items() if not k.startswith("_"))


def _bytes(data: bytes) -> str:
    shown = data[:VERBOSE_BYTES].hex(" ")
    return shown + (f" … ({len(data) - VERBOSE_BYTES} more)" if len(data) > VERBOSE_BYTES else "")


def _show_request(frame: bytes, key: bytes, trace: bytes) -> None:
    head = frame[:REQUEST_HEADER_SIZE]
    names = {"magic": lambda v: f"0x{v:04X}", "op": lambda v: f"0x{v:02X}({op_name(v)})"}
    _err(f"> header  {head.hex(' ')}\n>         {_fields(REQUEST_HEADER, head, names)}")
    _err(f"> key     {key!r}\n> trace   {trace!r}")
    payload = frame[REQUEST_HEADER_SIZE + len(key) + len(trace):]
    _err(f"> payload {len(payload)} bytes" + (f": {_bytes(payload)}" if payload else ""))


def _show_response_head(head: bytes, meta: bytes) -> None:
    names = {"status": lambda v: f"0x{v:02X}({status_name(v)})"}
    _err(f"< header  {head.hex(' ')}\n<         {_fields(RESPONSE_HEADER, head, names)}")
    if meta:
        _err(f"< meta    {meta[:VERBOSE_BYTES * 4].decode('utf-8', 'replace')}")


def _summary(op: int, meta: dict[str, Any] | None, data: bytes) -> str:
    text = f"payload: {len(data)} bytes"
    if not data:
        return text
    if op == Op.DECODE and meta and len(data) == 9 * meta.get("tokens_generated", -1):
        return text + ", token frames: " + " ".join(f"{f.token_id}({f.logprob:.2f})" for f in decode_token_frames(data))
    if op == Op.DECODE and meta and "tokens_generated" in meta:
        return text + f", text: {data.decode('utf-8', 'replace')!r}"
    return text + f"  [{data[:HEX_PREVIEW].hex(' ')}{' …' if len(data) > HEX_PREVIEW else ''}]"


def _write_out(path: str, data: bytes, meta: dict[str, Any] | None) -> None:
    """Save an OK reply. Through a temporary file and a rename: FILE is either what it was or
    the whole new reply, never half of one (e.g. on a full disk)."""
    body = data if data else (json.dumps(meta, indent=2, ensure_ascii=False) + "\n").encode() if meta else b""
    tmp = f"{path}.hydra-rpc-{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(body)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise UsageError(f"cannot write --out {path}: {e.strerror or e}") from None
    _err(f"saved {'the payload' if data else 'the meta'} ({len(body)} bytes) to {path}")


def _applied_nothing(op: int, meta: dict[str, Any] | None) -> str | None:
    """For a CONFIGURE that named keys and applied none of them (each rejected or unknown): the
    stderr lines saying why, else None. The server answers OK for it (as the C++ does), but a
    script that checks the exit status must not take it for a change."""
    if op != Op.CONFIGURE or not isinstance(meta, dict):
        return None
    rejected, unknown = meta.get("rejected_keys") or {}, meta.get("unrecognized_keys") or []
    if meta.get("params_applied") or meta.get("deferred_keys") or not (rejected or unknown):
        return None
    lines = ["CONFIGURE applied none of its keys:"]
    lines += [f"  rejected {k}: {why}" for k, why in rejected.items()]
    lines += [f"  unrecognized {k} (`hydra-rpc call --describe CONFIGURE` lists the keys)" for k in unknown]
    return "\n".join(lines)


async def _stream_pin(c: HydraClient, verbose: bool) -> int:
    """A PIN DECODE: text pieces to stdout as they arrive, until the server closes."""
    n = size = 0
    async for piece in c.pin_pieces():
        sys.stdout.buffer.write(piece)
        sys.stdout.flush()
        n, size = n + 1, size + len(piece)
    print(file=sys.stdout, flush=True)
    _err(f"[{n} pieces, {size} bytes streamed]" if verbose else f"[{n} tokens streamed]")
    return 0


async def _call(args: argparse.Namespace) -> int:
    host, port = args.target
    payload = _payload(args)
    key, trace = args.key.encode(), args.trace.encode()
    frame = encode_request(args.op, key, payload, trace)
    if args.verbose:
        _err(f"* connecting to {host}:{port}")
        _show_request(frame, key, trace)
    c = await HydraClient.connect(host, port)
    try:
        await c.send_raw(frame)
        hdr, meta_raw = await c.read_head()
        if args.verbose:
            # Every bit of the 12 header bytes is a field, so encoding the parsed header gives
            # back exactly the bytes received.
            _show_response_head(encode_response_header(hdr.status, hdr.meta_len, hdr.payload_len), meta_raw)
        _err(f"{status_name(hdr.status)} (0x{hdr.status:02x})")
        meta = parse_meta(meta_raw)
        if pin_stream_follows(decode_dialect(payload) if args.op == Op.DECODE else None, hdr):
            return await _stream_pin(c, args.verbose)
        data = await c.read_payload()
    finally:
        await c.close()
    if args.verbose and data:
        _err(f"< payload {_bytes(data)}")
    if args.raw:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    elif meta is not None:
        print(json.dumps(meta, indent=2, ensure_ascii=False), flush=True)
    _err(_summary(args.op, meta, data))
    if args.out and hdr.status == Status.OK:
        _write_out(args.out, data, meta)
    elif args.out:
        _err(f"not saved: the reply is {status_name(hdr.status)}, not OK; {args.out} is left untouched")
    if hdr.status != Status.OK:
        return 1
    nothing = _applied_nothing(args.op, meta)
    if nothing:
        _err(nothing)
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    if args.describe is not None:
        from hydra_rpc.cli.call_formats import describe

        sys.stdout.write(describe(args.describe))
        return 0
    if args.op is None:
        raise UsageError("name an opcode, e.g. `hydra-rpc call INFO` (`hydra-rpc call --describe OP` lists "
                         "what an opcode takes)")
    where = f"{args.target[0]}:{args.target[1]}"
    try:
        return asyncio.run(asyncio.wait_for(_call(args), args.timeout))
    except TimeoutError:
        raise UsageError(f"no complete reply from {where} within {args.timeout:g} s; a long DECODE or a model "
                         "reload may need a larger --timeout") from None
    except ConnectionRefusedError:
        raise UsageError(f"nothing listens on {where}; start the server (`hydra-rpc serve`) or fix "
                         "--target") from None
    except ReplyCut as e:
        raise UsageError(f"{where} closed the connection after {e.received} bytes of the reply "
                         "(is it a Hydra engine port?)") from None
    except (OSError, CodecError) as e:
        raise UsageError(f"cannot talk to {where}: {e}") from None
