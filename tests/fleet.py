"""The fleet's launch contract: the node agent's params (fleet-wide and one node's) and how it
turns them into llama-engine's command line (its ``BuildLlamaArgs``)."""
from __future__ import annotations

# The fleet's params (global + the RTX node's), as the node agent's config holds them.
FLEET_GLOBAL = {
    "flash-attn": "on", "cache-type-k": "q8_0", "cache-type-v": "q8_0", "kv-unified": True, "cont-batching": True,
    "cache-prompt": True, "cache-reuse": 64, "prio": 3, "prio-batch": 1, "rope-scaling": "yarn", "rope-scale": 5,
    "yarn-orig-ctx": 32768, "reasoning": "on", "jinja": True, "timeout": 1800,
    "chat-template-kwargs": '{"preserve_thinking": true}', "log-prefix": False, "metrics": True, "slots": True,
    "perf": True, "log-verbosity": 4, "context-shift": True,
}
FLEET_NODE = {
    "n-cpu-moe": 8, "n-gpu-layers": "all",
    "override-tensor": "token_embd\\.weight=CPU,output\\.weight=CPU,output_norm\\.weight=CPU",
    "ctx-size": 320000, "parallel": 2, "temp": 0.86, "repeat-penalty": 1.06, "top-k": 20, "top-p": 0.95,
    "slot-prompt-similarity": 0.4, "ggml-rpc-port": 9505, "rpc-engine": "localhost:9506",
}


def go_value(v) -> str:
    """Go's %v for the param values the agent supports (ints in decimal, floats shortest)."""
    if isinstance(v, float):
        return repr(v).removesuffix(".0")
    return str(v)


def node_agent_argv(host: str, port: int, rpc_port: int, params: dict) -> list[str]:
    """BuildLlamaArgs: host/port/rpc-port, then params sorted by name; true → bare flag, false omitted."""
    argv = ["--host", host, "--port", str(port), "--rpc-port", str(rpc_port)]
    for key in sorted(params):
        v = params[key]
        if v is True:
            argv.append(f"--{key}")
        elif v is not False:
            argv += [f"--{key}", go_value(v)]
    return argv
