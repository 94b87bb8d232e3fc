"""The engine's start-up settings, and what a STATE_GET hands back (``engine.actor``)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .backend import BackendFactory
from .model_params import ModelParams
from .rpc_allow import RpcAllowList
from .reasoning_budget import ReasoningBudget
from .sampling import GrammarSpec
from .status import ModelIdentity

#: Variables llama.cpp reads from the process environment itself, whose effect the engine
#: reports (``LLAMA_ATTN_ROT_DISABLE``: INFO ``kv_cache.attn_rotation``). They are captured with
#: the settings so that no engine module reads the environment behind the configuration's back.
LLAMA_ENV_VARS = ("LLAMA_ATTN_ROT_DISABLE",)


def llama_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The ``LLAMA_ENV_VARS`` that ``environ`` sets."""
    return {k: environ[k] for k in LLAMA_ENV_VARS if k in environ}


@dataclass
class EngineConfig:
    model: ModelParams
    aliases: dict[str, str] = field(default_factory=dict)
    # thread priorities (engine/executors.py): the event loop under SCHED_RR where permitted;
    # inference and loader at nice 0, or ``thread_nice``, or nice 19 with ``low_priority``
    loop_realtime: bool = False
    low_priority: bool = False
    thread_nice: int | None = None
    adapt_threads: bool = True  # fewer compute threads while other processes or a load need cores
    # seconds of model work a step may take; it ends sooner when the mailbox has mail, and
    # hands its tokens to their streams as it goes (engine.stepper)
    time_slice: float = 0.05
    token_budget: int = 512  # tokens per batched decode (prefill chunks + decode tokens)
    erase_timeout: float = 300.0  # s an erase of a busy slot waits for it (engine/erase.py)
    slot_queue: int = 8  # generation jobs waiting per busy slot; 0 = answer BUSY at once
    reload_policy: str = "serve-old"  # serve-old | reject
    reload_mode: str = "shadow"  # shadow | inplace
    drain_timeout: float = 300.0
    resolve_model: Callable[[str], Any] = str
    defaults: dict[str, Any] = field(default_factory=dict)  # T1 parameters
    # ggml RPC servers a CONFIGURE ``rpc_servers`` may name (engine.rpc_allow)
    rpc_allow: RpcAllowList = field(default_factory=RpcAllowList)
    # None: llama.cpp's (engine.llama_backend.factory.LlamaFactory, given ``llama_env``)
    backend: BackendFactory = None  # type: ignore[assignment]  # filled by __post_init__
    # how the drain timeout is scheduled (None: the event loop's call_later)
    call_later: Callable[[float, Callable[[], None]], Any] | None = None
    # the prompt cache's start-up settings (llama-server's flags of the same names; engine/prompt_cache.py,
    # docs/http.md); cache_prompt and cache_reuse are ModelParams (CONFIGURE may change them)
    slot_prompt_similarity: float = 0.1  # a job naming no slot goes where its prompt is cached (0: LRU only)
    cache_ram_mib: int = 8192  # RAM tier for the states of replaced conversations (-1: no limit, 0: off)
    slot_save_path: str | None = None  # directory of slot files (save/restore); None: refused
    ctx_checkpoints: int = 32  # context checkpoints per slot (--ctx-checkpoints; engine.checkpoints)
    checkpoint_min_step: int = 8192  # --checkpoint-min-step
    # chat output: --reasoning-format (auto | deepseek | none), and a grammar every request gets
    # unless it brings its own (--grammar, --grammar-file, --json-schema, --json-schema-file)
    reasoning_format: str = "auto"
    default_grammar: GrammarSpec | None = None
    reasoning_budget: ReasoningBudget | None = None  # --reasoning-budget N (≥ 0), --reasoning-budget-message
    # what llama.cpp will read from this process's environment (LLAMA_ENV_VARS), as it was when the
    # settings were read: the CLI builds the config at start, before any context exists
    llama_env: dict[str, str] = field(default_factory=lambda: llama_environment(os.environ))

    def __post_init__(self) -> None:
        if self.backend is None:
            # imported here, not above: llama-cpp-python loads only in an engine that uses it
            from .llama_backend.factory import LlamaFactory

            self.backend = LlamaFactory(self.llama_env)


@dataclass
class StateOut:
    n_past: int
    tokens: list[int]
    state: memoryview
    identity: ModelIdentity
    config_generation: int
    release: Callable[[], None] = lambda: None  # call when ``state`` has been sent
