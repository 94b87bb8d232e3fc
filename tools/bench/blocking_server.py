"""A server whose T3 reload blocks everything, as the C++ engine's does — a bench baseline only.

``python -m tools.bench.blocking_server [serve flags…]`` runs ``hydra-rpc serve`` with one
change: the model load of a reload runs *on the event-loop thread* instead of the loader
thread. Together with ``--reload-mode inplace`` (free the old model first, load when every
slot is idle) this is the C++ behaviour of docs/protocol.md §6.5: the reload waits for idle
slots, then nothing on any connection is answered until the new model is loaded.

It replaces one private method of the engine's reloader (``Reloader._build``), so it breaks
loudly if the reloader changes shape; it is never used outside ``hydra-rpc bench``.
"""
from __future__ import annotations

import asyncio
import sys
import time


def _install() -> None:
    from engine import reloader

    if not hasattr(reloader.Reloader, "_build"):
        raise SystemExit("blocking_server: engine.reloader.Reloader has no _build any more; update the emulation")

    def build_on_loop(self, ticket) -> None:
        t0 = time.perf_counter()
        fut = asyncio.get_running_loop().create_future()
        try:
            fut.set_result(self.factory.build(ticket.params))  # blocks the event loop: the point of this baseline
        except Exception as e:
            fut.set_exception(e)
        self.host.post(reloader.BuildDone(ticket, fut, (time.perf_counter() - t0) * 1000))

    reloader.Reloader._build = build_on_loop


def main(argv: list[str]) -> int:
    _install()
    from hydra_rpc.cli import main as cli_main

    return cli_main(["serve", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
