"""A real llama.cpp ggml-RPC client, run as a subprocess by the tests.

    python tests/ggml_client.py MODEL [ENDPOINT] [N_TOKENS]

With ENDPOINT the RPC server there is registered in the backend registry and every layer is
offloaded to it; without, the model runs locally. Prints one JSON line: greedy tokens and
the devices in use. (Registration is process-global and permanent, hence a subprocess.)
"""
from __future__ import annotations

import json
import sys

from engine.llama_backend import BatchItem, LoadedModel, SamplerParams, make_sampler


def main() -> None:
    path = sys.argv[1]
    endpoint = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "-" else None
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    devices: list[str] = []
    if endpoint:
        from engine.ggml_rpc_lib import list_devices, register_rpc_server

        register_rpc_server(endpoint)
        devices = [d["name"] for d in list_devices()]
    m = LoadedModel(path, n_ctx=256, n_seq_max=1, n_gpu_layers=99 if endpoint else 0, n_threads=1)
    toks = m.tokenize("The quick brown fox")
    m.decode([BatchItem(0, toks, 0, True)])
    s = make_sampler(SamplerParams(temperature=0), m)
    out = []
    pos = len(toks)
    for _ in range(n):
        t = s.sample(m, 0)
        out.append(t)
        m.decode([BatchItem(0, [t], pos, True)])
        pos += 1
    s.free()
    m.close()
    print(json.dumps({"tokens": out, "devices": devices}), flush=True)


if __name__ == "__main__":
    main()
