"""llama-engine's ``--ggml-rpc-port``: llama.cpp's ggml rpc-server listening on a port of its own.

It runs as a child process (``python -m engine.ggml_rpc_lib``), so a malformed ggml-RPC
request that aborts llama.cpp's server ends that child, never the Hydra and HTTP ports. It
is not restarted; the shared-port passthrough (``--ggml-rpc-upstream``, ``--ggml-rpc-embedded``)
is separate. The child is killed on shutdown, and by the kernel if we die.
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import signal
import sys

log = logging.getLogger("hydra_rpc.ggml_rpc_port")
READY = b"HYDRA_GGML_RPC_READY "  # what engine.ggml_rpc_lib prints once it listens
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: the kernel kills it when we die, even by SIGKILL (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: shutdown still kills it
        pass


class GgmlRpcPort:
    def __init__(self, proc: asyncio.subprocess.Process, host: str, port: int):
        self.proc, self.host, self.port = proc, host, port
        self._drain = asyncio.create_task(self._forward_output())

    @classmethod
    async def start(cls, host: str, port: int, threads: int = 1, timeout: float = 30.0) -> "GgmlRpcPort":
        """Start the server and wait until it listens; OSError when it cannot."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "engine.ggml_rpc_lib", "--host", host, "--port", str(port), "--threads",
            str(threads), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, preexec_fn=_die_with_parent)
        try:
            async with asyncio.timeout(timeout):
                while line := await proc.stdout.readline():
                    if line.startswith(READY):
                        h, _, p = line[len(READY):].decode().strip().rpartition(":")
                        log.info("ggml-RPC server on %s:%s (child process %d)", h, p, proc.pid)
                        return cls(proc, h, int(p))
        except TimeoutError:
            pass
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        raise OSError(f"the ggml-RPC server did not start on {host}:{port} (port in use?)")

    async def _forward_output(self) -> None:
        """Keep the child's pipe drained (llama.cpp prints to it) and say when it ends."""
        while line := await self.proc.stdout.readline():
            log.debug("ggml-RPC server: %s", line.decode("utf-8", "replace").rstrip()[:200])
        rc = await self.proc.wait()
        if rc not in (0, -2, -9, -15):
            log.error("the ggml-RPC server on port %d exited with status %d", self.port, rc)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()
        await self._drain
