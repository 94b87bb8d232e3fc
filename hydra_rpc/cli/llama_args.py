"""llama-server's arguments (generated from llama.cpp) plus llama-engine's, each with its status here.

Every argument is one of:

* **applied** — mapped onto this engine (the typed value comes from engine/params_table.py);
* **accepted without effect** — parsed and type-checked like llama.cpp does, then listed once at
  startup and in INFO ``ignored_args`` with the reason;
* **refused** — llama-server's own behaviour for an unknown argument (a message naming it, a
  non-zero exit); also for arguments llama.cpp knows whose silent omission would change what
  clients get (API keys, TLS, adapters, grammars, downloads, router mode).

docs/llama-args.md is rendered from this module by ``scripts/gen_llama_args.py --docs-only``.
"""
from __future__ import annotations

from dataclasses import dataclass

from hydra_rpc.cli.llama_args_data import LLAMA_CPP_SOURCE, SERVER_ARGS

APPLIED, NO_EFFECT, REFUSED = "applied", "no effect", "refused"


@dataclass(frozen=True)
class LlamaArg:
    names: tuple[str, ...]
    handler: str  # void (bare flag) | bool (flag with a negative form) | int | string | string2
    negative: tuple[str, ...] = ()
    value_hint: str | None = None
    value_hint_2: str | None = None
    env: str | None = None
    examples: tuple[str, ...] = ("COMMON",)
    excludes: tuple[str, ...] = ()
    sampling: bool = False
    spec: bool = False
    conversion: str | None = None  # stoi | stoul | stof | stod: how llama.cpp reads a string value
    help: str = ""
    hydra: bool = False  # llama-engine's own (stripped before llama.cpp's parser)

    @property
    def name(self) -> str:
        """The first long name (the key of the status tables)."""
        return next((n for n in self.names if n.startswith("--")), self.names[0])

    @property
    def n_values(self) -> int:
        return {"int": 1, "string": 1, "string2": 2}.get(self.handler, 0)


HYDRA_ARGS = (
    LlamaArg(("--rpc-port",), "int", value_hint="PORT", hydra=True, help="Hydra binary RPC port"),
    LlamaArg(("--ggml-rpc-port",), "int", value_hint="PORT", hydra=True,
             help="embedded ggml-RPC server on its own port"),
    LlamaArg(("--rpc-engine",), "string", value_hint="HOST:PORT", hydra=True, help="COMBINED peer engine"),
    LlamaArg(("--peer-only",), "void", hydra=True, help="serve as a compute peer only"),
    LlamaArg(("--combined-ot-pattern",), "string", value_hint="REGEX", hydra=True,
             help="expert tensors kept on the COMBINED peer"),
    LlamaArg(("--combined-split-mode",), "string", value_hint="expert|layer", hydra=True, help="COMBINED split mode"),
    LlamaArg(("--combined-tensor-split",), "string", value_hint="R0/R1", hydra=True,
             help="COMBINED layer-split proportions"),
    LlamaArg(("--yarn-ext-ctx",), "int", value_hint="N", hydra=True, help="YaRN extended context (Hydra)"),
)

ARGS: tuple[LlamaArg, ...] = tuple(LlamaArg(**a) for a in SERVER_ARGS) + HYDRA_ARGS

# ---- the status of every argument -------------------------------------------------------------------

#: Applied arguments that shape every answer rather than the model (no CONFIGURE parameter).
OUTPUT_ARGS = frozenset({"--grammar", "--grammar-file", "--json-schema", "--json-schema-file", "--reasoning-format",
                         "--reasoning-budget", "--reasoning-budget-message"})

#: Arguments that are actions, not settings.
ACTIONS = {"--help": "print usage and exit 0", "--version": "print the version and exit 0"}

_APPLIED = {
    "--model": "the GGUF to load", "--ctx-size": "total KV context (n_ctx); per slot by llama-server's rule",
    "--kv-unified-per-slot": "per-slot context cap", "--parallel": "number of slots (n_seq_max)",
    "--kv-unified": "one KV buffer shared by all slots", "--batch-size": "n_batch", "--ubatch-size": "n_ubatch",
    "--threads": "n_threads", "--threads-batch": "n_threads_batch", "--prio": "the process's priority, as llama-server sets it",
    "--prio-batch": "the inference thread's priority (instead of nice 19)", "--flash-attn": "flash_attn_type (on|off|auto)",
    "--cache-type-k": "type_k", "--cache-type-v": "type_v", "--swa-full": "swa_full",
    "--kv-offload": "offload_kqv", "--repack": "use_extra_bufts", "--no-host": "no_host",
    "--check-tensors": "check_tensors", "--load-mode": "load_mode", "--gpu-layers": ("n_gpu_layers (N|auto|all): layers put on the GPU backend's devices and --rpc servers "
                     "(none on a CPU build without --rpc; INFO gpu_offload says how many)"),
    "--rpc": "ggml-RPC servers to offload to", "--override-tensor": "tensor buffer overrides",
    "--cpu-moe": "all MoE expert weights on the CPU", "--n-cpu-moe": "MoE expert weights of the first N layers on the CPU",
    "--rope-scaling": "rope_scaling_type", "--rope-scale": "rope_freq_scale = 1/N",
    "--rope-freq-base": "rope_freq_base", "--rope-freq-scale": "rope_freq_scale",
    "--yarn-ext-factor": "yarn_ext_factor", "--yarn-attn-factor": "yarn_attn_factor",
    "--yarn-beta-slow": "yarn_beta_slow", "--yarn-beta-fast": "yarn_beta_fast",
    "--temp": "T1 default sampling.temp", "--top-k": "T1 default sampling.top_k", "--top-p": "T1 default sampling.top_p",
    "--min-p": "T1 default sampling.min_p", "--repeat-penalty": "T1 default sampling.penalty_repeat",
    "--seed": "T1 default sampling.seed", "--predict": "T1 default n_predict", "--keep": "T1 default n_keep",
    "--reverse-prompt": "T1 default antiprompt", "--chat-template": "chat template (PREFILL messages, OpenAI endpoints)",
    "--chat-template-file": "chat template read from a file", "--jinja": "use the Jinja chat template",
    "--chat-template-kwargs": "extra chat template variables", "--reasoning": "template variable enable_thinking",
    "--reasoning-format": "where a think block goes: reasoning_content (auto, deepseek) or content (none)",
    "--grammar": "GBNF grammar of every request that brings none", "--grammar-file": "the same, read from a file",
    "--json-schema": "JSON schema of every request that brings no grammar",
    "--json-schema-file": "the same, read from a file",
    "--reasoning-budget": "at most N generated tokens in a think block, then the close tag is written (-1: no limit)",
    "--reasoning-budget-message": "written before the close tag when the budget is spent",
    "--cache-prompt": "the prompt cache: reuse prompt prefixes held by the slot, another slot or the RAM tier",
    "--cache-reuse": "reuse chunks of the slot's cached prompt by KV shifting (not on a model that cannot "
                     "shift: INFO prompt_cache.cache_reuse_refused says so)",
    "--slot-prompt-similarity": "a request naming no slot goes to the slot that holds most of its prompt",
    "--cache-ram": "RAM tier of the prompt cache: states of conversations whose slot was taken (MiB)",
    "--slot-save-path": "slot files (POST /slots/{id}?action=save|restore); the RAM tier spills there",
    "--context-shift": "shift the context when a slot is full (not on a recurrent or hybrid model: ctx_full)",
    "--ctx-checkpoints": "context checkpoints per slot, taken near a prompt's end on a recurrent, hybrid or "
                         "sliding-window model and restored when a new prompt diverges inside the slot's tokens",
    "--checkpoint-min-step": "when a slot's checkpoints are full, one this close to the one before it goes first",
    "--timeout": "idle keep-alive timeout of the HTTP side", "--metrics": "/metrics endpoint (501 without it)",
    "--slots": "/slots endpoint (501 with --no-slots)",
    "--host": "HTTP listen address", "--port": "HTTP port",
    "--rpc-port": "Hydra binary RPC port", "--ggml-rpc-port": "embedded ggml-RPC server on its own port",
}

_NO_GPU = ("device option: the installed llama.cpp build has no GPU backend, so it runs on the CPU (and on "
           "ggml-RPC servers given with --rpc); applied with a GPU build (README: GPU nodes)")
_FIT = ("device option: llama-server's memory fitting (common/fit) is not implemented; -ngl N|all and -ot place "
        "the layers")
_CPU_FFN = ("device option: dense FFN weights stay where -ngl puts their layer (-ot with an ffn pattern and =CPU "
            "moves them)")
_OP_OFFLOAD = "device option: left at llama.cpp's default (host tensor ops are offloaded to the device)"

#: Device options applied when the installed build has a GPU backend (engine/gpu.py), else
#: accepted without effect (reason ``_NO_GPU``).
GPU_APPLIED = {
    "--split-mode": "split_mode (none|layer|row|tensor) on the GPU backend's devices",
    "--tensor-split": "tensor_split: the share of layers (or rows) per offload device",
    "--main-gpu": "main_gpu: the device used with --split-mode none",
    "--device": "the offload devices by registry name (CUDA0, Vulkan0, ROCm0, RPC0; none: no offload)",
}
_SAMPLER = "sampler not in this engine's chain (temperature, top-k, top-p, min-p, repeat penalty, seed)"
_SPEC = "speculative decoding is not implemented"
_MM = "multimodal input is not supported (text only)"
_LOG = "hydra-rpc logs through its own logger (--log-format / --log-level)"
_THREADS = "CPU affinity and polling are left to the OS and ggml"
_ROUTER = "router mode (several models behind one server) is not implemented"
_PARSE = "not implemented: think blocks and tool calls are parsed as the template and --reasoning-format say"
_WEB = "no web UI, static files, CORS, MCP or built-in tools"
_COMBINED = "COMBINED (peer) mode is not implemented: this engine always runs SOLO"
_NO_DOWNLOADS = "no downloads"
# removed from llama.cpp itself: llama-server refuses them with this message too
_REMOVED = {a.name: a.help for a in ARGS if a.help.startswith("the argument has been removed")}

_NO_EFFECT = {
    **dict.fromkeys(["--fit", "--fit-target", "--fit-ctx"], _FIT),
    "--n-cpu-ffn": _CPU_FFN, "--op-offload": _OP_OFFLOAD,
    **dict.fromkeys(["--top-nsigma", "--xtc-probability", "--xtc-threshold", "--typical", "--repeat-last-n",
                     "--presence-penalty", "--frequency-penalty", "--dry-multiplier", "--dry-base",
                     "--dry-allowed-length", "--dry-penalty-last-n", "--dry-sequence-breaker", "--adaptive-target",
                     "--adaptive-decay", "--dynatemp-range", "--dynatemp-exp", "--mirostat", "--mirostat-lr",
                     "--mirostat-ent", "--backend-sampling", "--samplers", "--sampler-seq"], _SAMPLER),
    **dict.fromkeys(["--mmproj-auto", "--mmproj-offload", "--mmproj-device", "--image-min-tokens", "--image-max-tokens",
                     "--mtmd-batch-max-tokens", "--video-fps", "--video-timestamp-interval", "--video-ffmpeg-dir",
                     "--media-path"], _MM),
    **dict.fromkeys(["--log-disable", "--log-file", "--log-jsonl", "--log-prompts-dir", "--log-colors",
                     "--log-prefix", "--log-timestamps"], _LOG),
    **dict.fromkeys(["--verbose", "--verbosity"], "hydra-llama-engine maps it onto --log-level (-v: DEBUG; -lv N: "
                                                  "<= 1 ERROR, 2 WARNING, 3 INFO, >= 4 DEBUG, with llama.cpp's own "
                                                  "lines); serve: use --log-level"),
    **dict.fromkeys(["--cpu-mask", "--cpu-range", "--cpu-strict", "--poll", "--cpu-mask-batch", "--cpu-range-batch",
                     "--cpu-strict-batch", "--poll-batch", "--numa"], _THREADS),
    "--cache-idle-slots": "the prompt cache saves a slot's state when another conversation takes it, not before",
    **dict.fromkeys(["--reasoning-effort", "--reasoning-preserve", "--skip-chat-parsing", "--prefill-assistant"],
                    _PARSE),
    **dict.fromkeys(["--path", "--cors-origins", "--cors-methods", "--cors-headers", "--cors-credentials", "--ui-config",
                     "--ui-config-file", "--ui-mcp-proxy", "--tools", "--tools-runtime", "--mcp-servers-config",
                     "--mcp-servers-json", "--agent", "--ui", "--props"], _WEB),
    **dict.fromkeys(["--models-max", "--models-autoload"], _ROUTER),
    **dict.fromkeys(["--hf-token", "--offline"], _NO_DOWNLOADS),
    **dict.fromkeys(["--rpc-engine", "--peer-only", "--combined-ot-pattern", "--combined-split-mode",
                     "--combined-tensor-split"], _COMBINED),
    **dict.fromkeys(["--lookup-cache-static", "--lookup-cache-dynamic", "--spec-draft-type-k", "--spec-draft-type-v"],
                    _SPEC),
    **{a.name: _SPEC for a in ARGS if a.spec and a.name not in _REMOVED},
    "--cont-batching": "always on: slots are decoded together in cooperative steps",
    "--defrag-thold": "deprecated in llama.cpp, where it has no effect either",
    "--perf": "timings are measured by hydra-rpc's metrics", "--escape": "only affects llama-cli prompts",
    "--special": "special tokens are rendered as the detokenizer does by default",
    "--warmup": "no warmup run: the first request pays for it", "--spm-infill": "there is no /infill endpoint",
    "--ignore-eos": "generation stops at end of stream unless a request sets n_predict",
    "--pooling": "there is no embeddings endpoint", "--embd-normalize": "there is no embeddings endpoint",
    "--lazy-mode": "left at llama.cpp's default (auto)", "--lora-init-without-apply": "LoRA adapters are not supported",
    "--tags": "informational in llama-server too",
    "--alias": "the API names the resident model by its GGUF name (serve's --model-alias names models to load)", "--reuse-port": "sockets are bound without SO_REUSEPORT",
    "--sse-ping-interval": "streams are not pinged", "--threads-http": "HTTP is served by one asyncio event loop",
    "--sleep-idle-seconds": "the model stays loaded",
    # llama-engine strips it before llama.cpp's parser: applying it would put other positions in the
    # KV cache than the C++ engines of the fleet have (the cache holds K after RoPE).
    "--yarn-orig-ctx": "llama-engine discards it; applying it would make this engine's KV differ from the fleet's",
    "--yarn-ext-ctx": "llama-engine discards it",
}

_REFUSED = {
    **dict.fromkeys(["--mmproj", "--mmproj-url"], "a multimodal projector cannot be loaded: " + _MM),
    "--logit-bias": "a bias on every output is not implemented; a request's own logit_bias is",
    **dict.fromkeys(["--lora", "--lora-scaled", "--control-vector", "--control-vector-scaled",
                     "--control-vector-layer-range", "--override-kv"],
                    "adapters, control vectors and metadata overrides change the model and are not supported"),
    **dict.fromkeys(["--model-url", "--docker-repo", "--hf-repo", "--hf-file"],
                    "downloads are not supported: pass --model with a local GGUF file"),
    **dict.fromkeys(["--embd-gemma-default", "--fim-qwen-1.5b-default", "--fim-qwen-3b-default", "--fim-qwen-7b-default",
                     "--fim-qwen-7b-spec", "--fim-qwen-14b-spec", "--fim-qwen-30b-default", "--gpt-oss-20b-default",
                     "--gpt-oss-120b-default", "--vision-gemma-4b-default", "--vision-gemma-12b-default",
                     "--spec-default"], "a preset that downloads a model: pass --model with a local GGUF file"),
    **dict.fromkeys(["--cache-list", "--completion-bash", "--list-devices"], "a llama.cpp utility that prints and exits"),
    **dict.fromkeys(["--api-key", "--api-key-file"], "API keys are not implemented: ignoring one would serve without auth"),
    **dict.fromkeys(["--ssl-key-file", "--ssl-cert-file"], "TLS is not implemented: ignoring it would serve plain HTTP"),
    **dict.fromkeys(["--embedding", "--rerank"], "embedding- and reranking-only servers are not implemented"),
    **dict.fromkeys(["--models-dir", "--models-preset"], _ROUTER),
    "--api-prefix": "every endpoint under a prefix is not implemented; ignoring it would move the API",
    **_REMOVED,
}


def status(arg: LlamaArg, gpu: bool | None = None) -> tuple[str, str]:
    """(applied | no effect | refused, what it maps to or why). ``gpu``: whether the installed
    llama.cpp build has a GPU backend (None: ask it, engine/gpu.py); it decides the device
    options of ``GPU_APPLIED``."""
    n = arg.name
    if n in GPU_APPLIED:
        if gpu is None:
            from engine.gpu import gpu_backend

            gpu = gpu_backend()
        return (APPLIED, GPU_APPLIED[n]) if gpu else (NO_EFFECT, _NO_GPU)
    for table, label in ((ACTIONS, APPLIED), (_APPLIED, APPLIED), (_REFUSED, REFUSED), (_NO_EFFECT, NO_EFFECT)):
        if n in table:
            return label, table[n]
    return REFUSED, "not classified"  # a new llama.cpp argument: refused until someone decides


#: name or negative name → (argument, whether the name is the positive form)
BY_NAME: dict[str, tuple[LlamaArg, bool]] = {}
for _a in ARGS:
    for _n in _a.names:
        BY_NAME[_n] = (_a, True)
    for _n in _a.negative:
        BY_NAME[_n] = (_a, False)


def render_status_markdown() -> str:
    """docs/llama-args.md: every llama-server argument (and llama-engine's) with its status."""
    counts = {APPLIED: 0, NO_EFFECT: 0, REFUSED: 0}
    rows = []
    for a in ARGS:
        label, note = status(a, gpu=False)  # the table is the same on every machine: a CPU build's
        if a.name in GPU_APPLIED:
            note = f"CPU build: no effect (no GPU backend). GPU build: applied, {GPU_APPLIED[a.name]}"
        counts[label] += 1
        names = ", ".join(f"`{n}`" for n in (*a.names, *a.negative))
        value = " ".join(f"`{v}`" for v in (a.value_hint, a.value_hint_2) if v)
        env = f"`{a.env}`" if a.env else ""
        rows.append("| " + " | ".join(_cell(c) for c in (names, value, env, label, note)) + " |")
    return "\n".join([
        "# llama-server arguments in hydra-llama-engine",
        "",
        "<!-- GENERATED by scripts/gen_llama_args.py from hydra_rpc/cli/llama_args.py; do not edit -->",
        "",
        f"The argument table of llama-server from llama.cpp's `common/arg.cpp` as vendored in {LLAMA_CPP_SOURCE},",
        "then llama-engine's own arguments (the last rows). `hydra-llama-engine` accepts the same command line:",
        "",
        "* **applied**: mapped onto this engine;",
        "* **no effect**: accepted and type-checked like llama.cpp does, listed at startup and in INFO",
        "  `ignored_args` with the reason;",
        "* **refused**: the process exits non-zero with `error: invalid argument: NAME` and the reason, as",
        "  llama-server does for an argument it does not know.",
        "",
        "The status is a CPU build's (the default install). With a GPU build of llama.cpp (`LCP_CMAKE_ARGS`,",
        "README: GPU nodes), `--n-gpu-layers` offloads and the device options marked \"GPU build: applied\"",
        "are applied; INFO and `/props` report `backend_devices` and `gpu_offload` (layers offloaded).",
        "",
        "Values are typed as llama.cpp types them (engine/params_table.py). `--key=value`, `_` for `-` in",
        "long names and the `LLAMA_ARG_*` variables (the command line wins) are accepted too.",
        "",
        f"{counts[APPLIED]} applied, {counts[NO_EFFECT]} without effect, {counts[REFUSED]} refused.",
        "",
        "| Names | Value | Environment | Status | Maps to / reason |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ])


def _cell(text: str) -> str:
    """Markdown table cell: ``|`` splits cells even inside backticks."""
    return text.replace("|", "\\|").replace("\n", " ")
