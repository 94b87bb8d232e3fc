"""Wiring: engine + Hydra server (+ HTTP side) in one process, one event loop."""
from __future__ import annotations

import logging
from typing import Any, Mapping

from engine.api import EngineApi
from engine.config import EngineConfig

from hydra_rpc.config import ServerConfig
from hydra_rpc.conn_budget import ConnectionBudget, open_fds, raise_nofile_limit
from hydra_rpc.hydra.decode_results import DecodeResults
from hydra_rpc.hydra.decode_v3 import DecodeV3
from hydra_rpc.hydra.handlers import Handlers
from hydra_rpc.hydra.server import HydraServer
from hydra_rpc.observability.metrics import Metrics
from hydra_rpc.services import Services

log = logging.getLogger("hydra_rpc.app")


class App:
    """The process's servers around one engine. ``services`` is what they share."""

    def __init__(self, server_cfg: ServerConfig, engine_cfg: EngineConfig, http_host: str | None = None,
                 http_port: int | None = None, info_extra: Mapping[str, Any] | None = None):
        self.server_cfg, self.engine_cfg = server_cfg, engine_cfg
        self.http_host, self.http_port = http_host, http_port  # http_port None: no HTTP side
        self.nofile = raise_nofile_limit()  # the open-files limit in force
        budget = ConnectionBudget.for_fd_limit(server_cfg.max_connections, self.nofile, open_fds())
        results = DecodeResults(server_cfg.decode_result_ttl_s, server_cfg.decode_result_max,
                                server_cfg.decode_budget_s)
        self.services = Services(server_cfg, EngineApi(engine_cfg), budget, Metrics(server_cfg.metrics_underscore),
                                 decode_results=results, info_extra=dict(info_extra or {}))
        self.server: HydraServer | None = None
        self.http: Any = None  # the HTTP side, once started
        self.ggml_rpc: Any = None  # the --ggml-rpc-port server

    @property
    def engine(self) -> EngineApi:
        return self.services.engine

    @property
    def budget(self) -> ConnectionBudget:
        return self.services.budget

    async def start(self) -> None:
        """HTTP first (so ``/health`` says 503 while the first model loads), then the
        engine, then the Hydra port."""
        s = self.services
        s.engine.check()  # fail fast, before any port is bound
        if self.http_port is not None:
            from hydra_rpc.http.app import start_http

            self.http = await start_http(s, self.http_host or self.server_cfg.host, self.http_port)
        await s.engine.start()
        handlers = Handlers(s, decode_v3=DecodeV3(s).handle)
        self.server = s.hydra = HydraServer(self.server_cfg, handlers.table(), on_request=s.metrics.observe_request,
                                            budget=s.budget)
        if self.server_cfg.ggml_rpc_embedded or self.server_cfg.ggml_rpc_port is not None:
            await self.server.passthrough.start_embedded()
        if self.server_cfg.ggml_rpc_port is not None:
            from hydra_rpc.ggml.port import GgmlRpcPort

            self.ggml_rpc = await GgmlRpcPort.start(self.server.passthrough, self.http_host or self.server_cfg.host,
                                                    self.server_cfg.ggml_rpc_port, self.server_cfg.first_bytes_timeout)
        await self.server.start()

    @property
    def address(self) -> tuple[str, int]:
        return self.server.address

    async def shutdown(self, force: bool = False) -> None:
        """Stop accepting, finish in-flight requests (bounded), stop HTTP, stop the engine."""
        if self.ggml_rpc is not None:
            await self.ggml_rpc.stop()
        if self.server is not None:
            await self.server.shutdown(force=force)
            await self.server.passthrough.close()
        if self.http is not None:
            await self.http.cleanup()
        await self.engine.stop(timeout=2.0 if force else 10.0)
