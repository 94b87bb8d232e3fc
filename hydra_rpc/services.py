"""What the engine port and the HTTP side share, built once at start-up.

One typed object, like uvicorn's ``ServerState``: the Hydra handlers, the HTTP routes and the
metrics collector take it instead of reaching into the application.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from engine.api import EngineApi
from engine.buffers import LeasedBuffer

from hydra_rpc.config import ServerConfig
from hydra_rpc.conn_budget import ConnectionBudget
from hydra_rpc.hydra.decode_results import DecodeResults

from hydra_rpc.observability.metrics import Metrics

if TYPE_CHECKING:
    from hydra_rpc.hydra.server import HydraServer


@dataclass
class Services:
    settings: ServerConfig
    engine: EngineApi
    budget: ConnectionBudget  # open connections of both ports together
    metrics: Metrics = field(default_factory=Metrics)
    # STATE_PUT payloads land here, on either port (resident and reused: one KV state is large)
    # (looked up when built, so that a test can track the buffers it hands out)
    put_buffer: LeasedBuffer = field(default_factory=lambda: LeasedBuffer())
    decode_results: DecodeResults = field(default_factory=DecodeResults)  # merged DECODE v3 results
    info_extra: Mapping[str, Any] = field(default_factory=dict)  # INFO keys of the process (ignored_args)
    hydra: HydraServer | None = None  # the engine port, once it listens (its connections, for /metrics)
