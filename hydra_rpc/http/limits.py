"""What one HTTP request may hold: memory for its body, and time to send it.

* **body size** — read before the handler runs, refused from ``Content-Length`` or, for a chunked
  body, as soon as what arrived passes the limit (``413``). The default limit follows the context
  a request can fill: ``n_ctx_slot`` × 256 bytes, at least 1 MiB and at most the Hydra prompt cap
  (64 MiB); ``HYDRA_HTTP_MAX_BODY`` overrides it. A route marked :func:`streams_body` (a KV state
  PUT: up to the STATE_PUT cap, into the resident buffer) checks its own size and reads its body
  as it arrives, inside :func:`reading_body`;
* **deadlines** — while a body is read the connection's read deadlines run (the engine port's,
  ``http.server.connection``); while a handler works they do not.

The connections themselves (the shared budget, the deadlines between requests) are
``http.server``'s.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from codec.limits import HYDRA_MAX_PROMPT_BYTES
from engine.kv_layout import slot_context
from engine.model_params import ModelParams
from engine.params_table import MAX_CTX

from hydra_rpc.http.errors import ApiError
from hydra_rpc.http.server.messages import Request

BODY_BYTES_PER_TOKEN = 256
MIN_MAX_BODY = 1 << 20


def max_body_for(params: ModelParams) -> int:
    """The default request body limit for the slot context ``params`` ask for (llama-server's
    rule; a context the model sets, ``n_ctx`` 0, is taken as the largest there is)."""
    n_ctx_slot = slot_context(params.n_ctx, params.n_slots, params.kv_unified, n_ctx_train=MAX_CTX,
                              kv_unified_per_slot=params.n_ctx_slot_cap).n_ctx_slot
    return min(HYDRA_MAX_PROMPT_BYTES, max(MIN_MAX_BODY, n_ctx_slot * BODY_BYTES_PER_TOKEN))


def streams_body(handler: Any) -> Any:
    """Mark a route handler that reads its own body, as it arrives and under its own size cap."""
    handler.streams_body = True
    return handler


@contextlib.contextmanager
def reading_body(request: Request) -> Iterator[None]:
    """A handler reads its body in here: the read deadlines run meanwhile — unless every byte of
    it has arrived (most bodies come with their head), when reading it waits for nothing."""
    if request.body.complete:
        yield
        return
    request.conn.reading_body(True)
    try:
        yield
    finally:
        request.conn.reading_body(False)


async def read_body(request: Request, limit: int) -> None:
    """The whole body into memory before the handler runs: a declared size over ``limit`` is
    refused before a byte is read, a chunked one as soon as it passes."""
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, f"request body too large: {request.content_length} bytes, the limit is {limit}")
    request.body.set_limit(limit)
    if request.body_exists:
        with reading_body(request):
            await request.read()
