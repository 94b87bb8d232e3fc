"""Server configuration: one dataclass, filled from the command line or by tests."""
from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field

from codec.limits import Limits


def parse_hostport(s: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 may be bracketed) → (host, port); ValueError otherwise."""
    host, sep, port = s.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {s!r}")
    return host.strip("[]"), int(port)


def hostport_arg(s: str) -> tuple[str, int]:
    """``parse_hostport`` for argparse ``type=``."""
    import argparse

    try:
        return parse_hostport(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _env(name: str, kind: type, default):
    """An operator's setting from the environment (docs/http.md, docs/protocol.md), read here
    only, when the configuration is built."""
    raw = os.environ.get(name)
    return default if raw in (None, "") else kind(raw)


def _env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    return default if raw is None else raw not in ("0", "false", "no", "off")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 9503
    loop: str = "uvloop"  # uvloop | asyncio
    # Connections
    max_connections: int = 1024
    allow: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = field(default_factory=list)
    first_bytes_timeout: float = 10.0  # silent new connection → closed
    # Read deadlines, counted only while the server waits for the client (hydra_rpc.hydra.deadlines):
    idle_timeout: float = 120.0  # no new request on a persistent connection (as the C++)
    stall_timeout: float = 30.0  # no byte of a started frame for this long
    min_rate: float = 1024.0  # bytes/s a started frame must average over every min_rate_window (0: off)
    min_rate_window: float = 10.0
    shutdown_timeout: float = 10.0  # graceful shutdown: in-flight requests get this long
    limits: Limits = field(default_factory=Limits)
    # ggml-RPC passthrough (off unless configured: upstream rpc-server is "fragile and insecure")
    ggml_rpc_upstream: tuple[str, int] | None = None
    ggml_rpc_embedded: bool = False
    ggml_rpc_embedded_threads: int = 1
    ggml_rpc_sessions: int = 4  # embedded: concurrent ggml sessions (a child process each)
    ggml_connect_timeout: float = 5.0
    ggml_rpc_port: int | None = None  # llama-engine's --ggml-rpc-port: the guarded passthrough on its own port
    # HTTP side (llama-server's --metrics, --slots, --timeout)
    http_metrics: bool = True
    http_slots: bool = True
    http_timeout: float = 75.0  # seconds an idle keep-alive connection stays open
    # HYDRA_HTTP_MAX_BODY: a request body's limit in bytes (None: from the slot context)
    http_max_body: int | None = field(default_factory=lambda: _env("HYDRA_HTTP_MAX_BODY", int, None))
    # HYDRA_METRICS_UNDERSCORE: llama-server's families also as llamacpp_* (what dashboards query)
    metrics_underscore: bool = field(default_factory=lambda: _env_flag("HYDRA_METRICS_UNDERSCORE", True))
    # Merged DECODE v3 results (docs/protocol.md): kept this long, this many, each job given this long
    decode_result_ttl_s: float = field(default_factory=lambda: _env("HYDRA_DECODE_RESULT_TTL_S", float, 300.0))
    decode_result_max: int = field(default_factory=lambda: _env("HYDRA_DECODE_RESULT_MAX", int, 1024))
    decode_budget_s: float = field(default_factory=lambda: _env("HYDRA_DECODE_BUDGET_S", float, 120.0))
    # Logging
    log_format: str = "text"  # text | json
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if self.min_rate > 0 and self.min_rate_window <= 0:
            raise ValueError("min_rate needs a min_rate_window > 0")

    def peer_allowed(self, ip: str) -> bool:
        if not self.allow:
            return True
        try:
            addr = ipaddress.ip_address(ip)
        except ValueError:
            return False
        return any(addr in net for net in self.allow)
