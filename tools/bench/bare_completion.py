"""The least a Python server does for a streamed completion, on the bindings this server uses:
the floor under its time to first token (a server of :mod:`tools.bench.ttft_gaps`).

    python -m tools.bench.bare_completion -m MODEL --port P [-t THREADS] [-c CTX] [other llama-server flags, ignored]

uvloop; an ``asyncio.Protocol`` reading requests with httptools (llhttp, as this server's
codec does); the body through ``json``; the prompt tokenized on the loop; decoded and sampled on
one inference thread reached as the engine reaches its own (a queue in, ``call_soon_threadsafe``
back); the common prefix with the previous prompt kept in the KV cache, as both servers keep it
(a recurrent model's state, which cannot be cut back, computed again from the start);
llama-server's default sampler chain made per request; each token as one SSE chunk of a chunked
body. One sequence, one request at a time: no validation, slots, snapshots, metrics or logs —
not a server, a floor. ``GET`` answers 200 (the benches' readiness probe).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import queue
import threading
import time
from typing import Any, Callable

import httptools

from engine.backend import BatchItem
from engine.host_cache import common_prefix
from engine.llama_backend.model import LoadedModel
from engine.sampling import SamplerParams
from tools.bench.common import decode_prompt

HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n{\"status\":\"ok\"}"


class InferenceThread:
    """``fn(*args)`` on one thread; ``done(result)`` back on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.jobs = loop, queue.SimpleQueue()
        threading.Thread(target=self._work, daemon=True).start()

    def call(self, done: Callable[[Any], None], fn: Callable, *args: Any) -> None:
        self.jobs.put((done, fn, args))

    def _work(self) -> None:
        while True:
            done, fn, args = self.jobs.get()
            try:
                result = fn(*args)
            except Exception as e:  # the request fails; the thread goes on to the next one
                result = e
            self.loop.call_soon_threadsafe(done, result)


class Completion:
    """One streamed completion: the prompt's decode, then one token per decode."""

    def __init__(self, server: "BareServer", transport: asyncio.Transport, body: dict[str, Any]) -> None:
        self.server, self.transport = server, transport
        self.left = int(body.get("max_tokens", 16))
        self.created, self.cid = int(time.time()), f"cmpl-{id(self):x}"
        self.head_sent = False
        tokens = server.model.tokenize(body["prompt"], add_special=True)
        self.sampler = server.model.make_sampler(SamplerParams())  # llama-server's defaults
        server.infer.call(self.token, server.prefill, tokens, self.sampler)

    def token(self, tok: int | Exception) -> None:
        if isinstance(tok, Exception):  # a bench waiting on this stream sees it end, not a hang
            if not self.head_sent:
                self.transport.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n"
                                     b"Connection: close\r\n\r\n")
            self.transport.close()
            self.sampler.free()
            return
        piece = self.server.model.token_to_piece(tok).decode("utf-8", "replace")
        event = {"id": self.cid, "object": "text_completion", "created": self.created, "model": "m",
                 "choices": [{"index": 0, "text": piece, "logprobs": None, "finish_reason": None}]}
        data = b"data: " + json.dumps(event).encode() + b"\n\n"
        out = b"%x\r\n%s\r\n" % (len(data), data)
        if not self.head_sent:
            out, self.head_sent = HEAD + out, True
        self.left -= 1
        if self.left > 0 and not self.server.model.is_eog(tok):
            self.transport.write(out)
            self.server.infer.call(self.token, self.server.next_token, tok, self.sampler)
            return
        done = b"data: [DONE]\n\n"
        self.transport.write(out + b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
        self.transport.close()
        self.sampler.free()


class BareServer:
    def __init__(self, model: LoadedModel, loop: asyncio.AbstractEventLoop) -> None:
        self.model, self.infer = model, InferenceThread(loop)
        self.held: list[int] = []  # what sequence 0 holds

    # ---- inference thread
    def prefill(self, tokens: list[int], sampler: Any) -> int:
        keep = min(common_prefix(self.held, tokens), len(tokens) - 1)
        if not self.model.seq_rm(0, keep, -1):  # a recurrent state cannot be cut back: start over
            self.model.seq_rm(0, -1, -1)
            keep = 0
        self.held = tokens[:keep]  # what the sequence surely holds should the decode fail
        decode_prompt(self.model, 0, tokens[keep:], keep)
        self.held = list(tokens)
        return self.model.sample(0, sampler)

    def next_token(self, tok: int, sampler: Any) -> int:
        self.model.decode([BatchItem(0, [tok], len(self.held))])
        self.held.append(tok)
        return self.model.sample(0, sampler)


class Connection(asyncio.Protocol):
    def __init__(self, server: BareServer) -> None:
        self.server, self.body = server, []
        self.parser = httptools.HttpRequestParser(self)

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, data: bytes) -> None:
        self.body.append(data)

    def on_message_complete(self) -> None:
        if self.parser.get_method() == b"GET":
            self.transport.write(OK)
            return
        Completion(self.server, self.transport, json.loads(b"".join(self.body)))


async def serve(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    model = LoadedModel(args.model, n_ctx=args.ctx, n_seq_max=1, n_threads=args.threads)
    server = BareServer(model, loop)
    await loop.create_server(lambda: Connection(server), "127.0.0.1", args.port)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.bare_completion", description=__doc__.split("\n")[0])
    ap.add_argument("-m", dest="model", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("-t", dest="threads", type=int, default=2)
    ap.add_argument("-c", dest="ctx", type=int, default=8192)
    args, _ = ap.parse_known_args(argv)
    import uvloop

    uvloop.run(serve(args))


if __name__ == "__main__":
    main()
