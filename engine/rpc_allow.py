"""Which ggml RPC servers a CONFIGURE (or a PREFILL ``hydra_config``) may point the engine at.

llama.cpp's RPC client trusts its server: a server that answers HELLO and then closes, or
answers a command with a wrong size, makes it abort the whole process ("Remote RPC server
crashed or returned malformed response"); probing it first does not help. So a Hydra client
may name only servers the operator listed at start-up (``--rpc``, ``--rpc-allow``);
any other ``rpc_servers`` value is not applied and comes back in ``rejected_keys`` with the
reason. An allowed server that misbehaves can still abort llama.cpp: the list says whom the
operator trusts, it does not make llama.cpp's client robust.
"""
from __future__ import annotations

from typing import Iterable


def endpoint_key(endpoint: str) -> tuple[str, int] | None:
    """``HOST:PORT`` (IPv6 may be bracketed) compared case-insensitively; None when malformed."""
    host, sep, port = endpoint.rpartition(":")
    host = host.strip("[]").lower()
    if not sep or not host or not port.isascii() or not port.isdigit() or not 0 < int(port) <= 65535:
        return None
    return host, int(port)


class RpcAllowList:
    def __init__(self, endpoints: Iterable[str] = ()):
        endpoints = list(endpoints)
        keys = [endpoint_key(e) for e in endpoints]
        bad = [e for e, k in zip(endpoints, keys) if k is None]
        if bad:
            raise ValueError(f"not HOST:PORT: {', '.join(bad)}")
        self.endpoints = frozenset(k for k in keys if k is not None)

    def refusal(self, servers: tuple[str, ...]) -> str | None:
        """Why a (typed, engine/params_table.py) ``rpc_servers`` value may not be applied, or
        None when it may. An empty list (no remote layers) is always allowed."""
        outside = [s for s in servers if endpoint_key(s) not in self.endpoints]
        if not outside:
            return None
        shown = ", ".join(s[:64] for s in outside[:4]) + (", ..." if len(outside) > 4 else "")
        return (f"not on the start-up allow-list (--rpc / --rpc-allow): {shown}; a ggml RPC server "
                "that misbehaves aborts llama.cpp, so clients may only name servers the operator trusts")
