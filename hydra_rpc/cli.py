"""``hydra-rpc`` command line: serve, call, inspect, fuzz, bench."""
from __future__ import annotations

import argparse
import sys


def _not_built(name: str):
    def run(args) -> int:
        print(f"hydra-rpc {name}: not built yet", file=sys.stderr)
        return 2

    return run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hydra-rpc", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    registry = {
        "serve": ("hydra_rpc.serve_cmd", "run the engine server"),
        "call": ("hydra_rpc.call_cmd", "send one Hydra request (curl for Hydra)"),
        "inspect": ("tools.inspector.cli", "decode Hydra / ggml-RPC traffic"),
        "fuzz": ("tools.fuzzer.cli", "fuzz a Hydra port"),
        "bench": ("tools.bench.cli", "run the benchmarks"),
    }
    for name, (module, help_) in registry.items():
        sp = sub.add_parser(name, help=help_, add_help=True)
        try:
            mod = __import__(module, fromlist=["add_arguments", "run"])
        except ImportError:
            sp.set_defaults(func=_not_built(name))
            continue
        mod.add_arguments(sp)
        sp.set_defaults(func=mod.run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
