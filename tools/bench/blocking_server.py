"""A server whose T3 reload blocks everything, as the C++ engine's does — a bench baseline only.

``python -m tools.bench.blocking_server [serve flags…]`` runs ``hydra-rpc serve`` with one
change: the model load of a reload runs *on the event-loop thread* instead of the loader
thread. Together with ``--reload-mode inplace`` (free the old model first, load when every
slot is idle) this is the C++ behaviour of docs/protocol.md §6.5: the reload waits for idle
slots, then nothing on any connection is answered until the new model is loaded.

It replaces one private method of the engine actor (``Engine._build_shadow``), so it breaks
loudly if the actor changes shape; it is never used outside ``hydra-rpc bench``.
"""
from __future__ import annotations

import asyncio
import sys
import time


def _install() -> None:
    from engine import actor
    from engine.reload import build_model

    if not hasattr(actor.Engine, "_build_shadow"):
        raise SystemExit("blocking_server: engine.actor.Engine has no _build_shadow any more; update the emulation")

    def build_on_loop(self, token, params) -> None:
        t0 = time.perf_counter()
        fut = asyncio.get_running_loop().create_future()
        try:
            fut.set_result(build_model(params))  # blocks the event loop: the point of this baseline
        except Exception as e:
            fut.set_exception(e)
        self._mailbox.put_nowait(("shadow_done", (token, fut, (time.perf_counter() - t0) * 1000), None))

    actor.Engine._build_shadow = build_on_loop


def main(argv: list[str]) -> int:
    _install()
    from hydra_rpc.cli import main as cli_main

    return cli_main(["serve", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
