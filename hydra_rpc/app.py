"""Wiring: engine + Hydra server (+ HTTP side) in one process, one event loop."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from engine.actor import Engine, EngineConfig

from hydra_rpc.config import ServerConfig
from hydra_rpc.conn_budget import ConnectionBudget, open_fds, raise_nofile_limit
from hydra_rpc.hydra.decode_v3 import DecodeV3
from hydra_rpc.hydra.handlers import Handlers
from hydra_rpc.hydra.server import HydraServer

log = logging.getLogger("hydra_rpc.app")


@dataclass
class App:
    server_cfg: ServerConfig
    engine_cfg: EngineConfig
    http_host: str | None = None
    http_port: int | None = None  # None: no HTTP side
    engine: Engine | None = None
    server: HydraServer | None = None
    http: object | None = None
    extras: dict = field(default_factory=dict)
    info_extra: dict = field(default_factory=dict)  # INFO keys of the process (ignored_args)
    ggml_rpc: object | None = None  # the --ggml-rpc-port server
    budget: ConnectionBudget = field(init=False)  # open connections of both ports
    nofile: int = field(init=False)  # the open-files limit in force

    def __post_init__(self) -> None:
        self.nofile = raise_nofile_limit()
        self.budget = ConnectionBudget.for_fd_limit(self.server_cfg.max_connections, self.nofile, open_fds())

    async def start(self) -> None:
        """HTTP first (so ``/health`` says 503 while the first model loads), then the
        engine, then the Hydra port."""
        self.engine = Engine(self.engine_cfg)
        self.engine.check()  # fail fast, before any port is bound
        try:
            from hydra_rpc.observability.metrics import Metrics
        except ImportError:
            metrics = None
        else:
            metrics = self.extras.setdefault("metrics", Metrics())
        if self.http_port is not None:
            from hydra_rpc.http.app import start_http

            self.http = await start_http(self, self.http_host or self.server_cfg.host, self.http_port)
        await self.engine.start()
        dv3 = DecodeV3(self.engine)
        handlers = Handlers(self.engine, decode_v3=dv3.handle, info_extra=self.info_extra)
        self.extras["put_buffer"] = handlers.put_buffer  # HTTP PUT /slots/{id}/state shares it
        self.extras["decode_results"] = dv3.results
        self.server = HydraServer(self.server_cfg, handlers.table(),
                                  on_request=metrics.observe_request if metrics else None, budget=self.budget)
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
        if self.engine is not None:
            await self.engine.stop(timeout=2.0 if force else 10.0)
