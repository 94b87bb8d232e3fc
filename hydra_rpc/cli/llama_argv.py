"""Parse llama-engine's command line (what a Hydra node agent starts its engine with).

Accepted like llama-server accepts it (common/arg.cpp ``common_params_parse_ex``): names and
short forms in any order, ``--key value``, bare flags and their ``--no-…`` forms, ``_`` for
``-`` in long names, and the ``LLAMA_ARG_*`` environment twins (read first; the command line
wins). Added here: ``--key=value``, the bare ``-fa`` of older llama.cpp (= ``on``), and the
older ``LLAMA_CHAT_TEMPLATE_KWARGS`` variable.

Unknown and refused arguments raise :class:`InvalidArgument` with llama-server's wording
("error: invalid argument: --foo"); the caller prints it and exits non-zero.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from engine.chat.prompt import REASONING_FORMATS
from engine.params_table import BY_CLI, CONVERSIONS, FALSEY, TRUTHY, Param, ParamError, stoi

from hydra_rpc.cli.llama_args import ACTIONS, APPLIED, OUTPUT_ARGS, ARGS, BY_NAME, NO_EFFECT, REFUSED, LlamaArg, status

# Variables older llama.cpp builds read (the current name wins when both are set).
LEGACY_ENV = {"LLAMA_CHAT_TEMPLATE_KWARGS": "--chat-template-kwargs"}
MAX_TEMPLATE_FILE = 1 << 20
MAX_GRAMMAR_FILE = 256 << 10  # the grammar check's own bound (engine.chat.grammar)


class InvalidArgument(ValueError):
    """A command line llama-server would refuse: print the message, exit non-zero."""


@dataclass(frozen=True)
class IgnoredArg:
    name: str
    value: str | None
    reason: str
    source: str  # "argv" or the environment variable

    def as_dict(self) -> dict[str, Any]:
        return {"arg": self.name, "value": self.value, "reason": self.reason, "source": self.source}


_BY_KEY = {p.key: p for p in BY_CLI.values()}


def _default(key: str) -> Any:
    return field(default=_BY_KEY[key].default)


@dataclass(frozen=True)
class LlamaEngineSettings:
    """What the command line asks of this engine. Field names are engine/params_table.py keys;
    defaults are llama-server's, except ``n_parallel``/``kv_unified`` (llama-server's auto
    resolved: 4 slots, unified) and ``rpc_port`` (None: llama-engine's ``port + 1``)."""

    # listening
    host: tuple[str, ...] = _default("host")
    port: int = _default("port")
    rpc_port: int | None = None
    ggml_rpc_port: int | None = None
    # model
    model: str | None = None
    alias: tuple[str, ...] = ()
    n_gpu_layers: int = _default("n_gpu_layers")
    rpc_servers: tuple[str, ...] = ()
    override_tensor: tuple[tuple[str, str], ...] = ()
    n_cpu_moe: int = 0
    cpu_moe: bool = False
    # device options: applied with a GPU backend (engine/gpu.py), listed as without effect otherwise
    split_mode: str = _default("split_mode")
    tensor_split: tuple[float, ...] = ()
    main_gpu: int = _default("main_gpu")
    devices: tuple[str, ...] = ()
    load_mode: str = _default("load_mode")
    repack: bool = True
    no_host: bool = False
    check_tensors: bool = False
    # context
    n_ctx: int | None = None  # None: not given (llama-server: the model's, or n_parallel × kv_unified_per_slot)
    n_parallel: int = 4
    kv_unified: bool = True
    kv_unified_per_slot: int = 0
    n_batch: int = _default("n_batch")
    ubatch_size: int = _default("ubatch_size")
    threads: int = _default("threads")  # <= 0: all cores
    threads_batch: int | None = None  # None: same as threads
    prio: int = 0
    prio_batch: int = 0
    flash_attn: str = _default("flash_attn")
    cache_type_k: str = _default("cache_type_k")
    cache_type_v: str = _default("cache_type_v")
    swa_full: bool = False
    offload_kqv: bool = True
    rope_scaling: str | None = None
    rope_scale: float | None = None
    rope_freq_base: float = 0.0
    rope_freq_scale: float = 0.0
    yarn_ext_factor: float = -1.0
    yarn_attn_factor: float = -1.0
    yarn_beta_fast: float = -1.0
    yarn_beta_slow: float = -1.0
    # T1 defaults, as tiers.classify names them ("sampling.temp", "n_predict", "antiprompt", ...)
    t1: dict[str, Any] = field(default_factory=dict)
    # chat
    chat_template: str | None = None  # the text, from --chat-template or --chat-template-file
    chat_template_file: str | None = None
    jinja: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning: str = "auto"
    reasoning_format: str = "auto"  # --reasoning-format: auto | deepseek | none
    grammar: str | None = None  # --grammar / --grammar-file: GBNF for every request that brings none
    json_schema: dict[str, Any] | None = None  # --json-schema / --json-schema-file: the same, as a schema
    reasoning_budget: int = -1  # --reasoning-budget: tokens in a think block (-1: no limit)
    reasoning_budget_message: str = ""
    # HTTP server
    cache_prompt: bool = True
    cache_reuse: int = _default("cache_reuse")
    cache_ram: int = _default("cache_ram")  # MiB, -1: no limit, 0: off
    slot_prompt_similarity: float = _default("slot_prompt_similarity")
    slot_save_path: str | None = None
    ctx_checkpoints: int = _default("ctx_checkpoints")
    checkpoint_min_step: int = _default("checkpoint_min_step")
    context_shift: bool = False
    timeout: int = _default("timeout")
    metrics: bool = False
    slots: bool = True
    # what was accepted without effect, and --help / --version
    ignored_args: tuple[IgnoredArg, ...] = ()
    action: str | None = None

    def hydra_port(self) -> int:
        """The Hydra binary port: ``--rpc-port``, else llama-engine's ``--port + 1``."""
        return self.rpc_port if self.rpc_port else self.port + 1


_FIELDS = {f.name for f in fields(LlamaEngineSettings)}


def parse_llama_argv(argv: Sequence[str], env: Mapping[str, str] | None = None) -> LlamaEngineSettings:
    """Settings for ``argv`` (without the program name) and ``env`` (default ``os.environ``)."""
    env = os.environ if env is None else env
    state = _State()
    for var, name in LEGACY_ENV.items():
        arg = BY_NAME[name][0]
        if var in env and arg.env not in env:
            state.apply(arg, True, env[var], var)
    for arg in ARGS:
        if arg.env is None:
            continue
        negative_var = arg.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1)
        if arg.negative and negative_var in env:
            state.apply(arg, False, None, negative_var)
        elif arg.env in env:
            state.apply_env(arg, env[arg.env])
    i = 0
    while i < len(argv):
        i = state.apply_argv(argv, i)
    return state.finish()


class _State:
    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.ignored: dict[str, IgnoredArg] = {}
        self.action: str | None = None

    # -- sources ---------------------------------------------------------------------------------
    def apply_env(self, arg: LlamaArg, text: str) -> None:
        if arg.handler == "void":
            if text in TRUTHY:  # llama.cpp: a falsey variable leaves the flag unset
                self.apply(arg, True, None, arg.env)
        elif arg.handler == "bool":
            if text not in TRUTHY + FALSEY:
                raise InvalidArgument(f'error while handling environment variable "{arg.env}": invalid boolean value')
            self.apply(arg, text in TRUTHY, None, arg.env)
        else:
            self.apply(arg, True, text, arg.env)

    def apply_argv(self, argv: Sequence[str], i: int) -> int:
        """Consume the argument at ``argv[i]`` (and its values); return the next index."""
        token = argv[i]
        name, eq, inline = token.partition("=") if token.startswith("--") else (token, "", "")
        if name.startswith("--"):
            name = name.replace("_", "-")  # as llama.cpp does
        if name not in BY_NAME or eq and BY_NAME[name][0].handler == "string2":
            raise InvalidArgument(f"error: invalid argument: {token}")
        arg, positive = BY_NAME[name]
        if arg.n_values == 0:
            if eq:  # --flag=true / --flag=off
                if inline not in TRUTHY + FALSEY:
                    raise InvalidArgument(f'error while handling argument "{name}": invalid boolean value')
                positive = positive == (inline in TRUTHY)
            self.apply(arg, positive, None, "argv", name)
            return i + 1
        if eq:
            self.apply(arg, positive, inline, "argv", name)
            return i + 1
        if arg.name == "--flash-attn" and _bare_flash_attn(argv, i):
            self.apply(arg, True, "on", "argv", name)
            return i + 1
        if i + arg.n_values >= len(argv):
            raise InvalidArgument(f'error while handling argument "{name}": expected value for argument')
        self.apply(arg, positive, " ".join(argv[i + 1:i + 1 + arg.n_values]), "argv", name)
        return i + 1 + arg.n_values

    # -- one argument ------------------------------------------------------------------------------
    def apply(self, arg: LlamaArg, positive: bool, text: str | None, source: str, given: str | None = None) -> None:
        given = given or arg.name
        label, note = status(arg)
        where = f'argument "{given}"' if source == "argv" else f'environment variable "{source}"'
        if label == REFUSED:
            why = f"{arg.name} is not supported by this engine: {note}"
            if source == "argv":
                raise InvalidArgument(f"error: invalid argument: {given}\n{why}")
            raise InvalidArgument(f"error while handling {where}: {why}")
        try:
            value = self.typed(arg, positive, text)
        except (ParamError, ValueError) as e:
            raise InvalidArgument(f"error while handling {where}: {e}") from None
        if arg.name in ACTIONS:
            self.action = self.action or arg.name.removeprefix("--")
        elif label == NO_EFFECT:
            self.ignored[arg.name] = IgnoredArg(given, text, note, source)
        else:
            assert label == APPLIED
            if arg.name in OUTPUT_ARGS:
                self.store_output_arg(arg.name, value)
            else:
                self.store(_param(arg), value)

    def typed(self, arg: LlamaArg, positive: bool, text: str | None) -> Any:
        param = _param(arg)
        if text is None:
            return positive
        if param is not None:
            return param.parse_cli(text)
        if arg.handler == "int":
            return stoi(text)
        return CONVERSIONS[arg.conversion](text) if arg.conversion else text

    def store(self, param: Param, value: Any) -> None:
        key = param.key
        if key == "chat_template_file":
            self.values["chat_template"] = _read_template(value)
        elif key == "slot_save_path" and not Path(value).is_dir():
            raise InvalidArgument(f'error while handling argument "--slot-save-path": not a directory: {value}')
        elif key == "rope_scale":  # llama.cpp stores only rope_freq_scale = 1/N
            self.values["rope_freq_scale"] = 1.0 / value
        into = self.values.setdefault("t1", {}) if param.tier == "T1" else self.values
        if param.repeat:
            value = into.get(key, ()) + (value if isinstance(value, tuple) else (value,))
        if key == "chat_template_kwargs":
            into.setdefault(key, {}).update(value)
        else:
            into[key] = value

    def store_output_arg(self, name: str, value: Any) -> None:
        """The flags that shape every answer: grammars and the reasoning format."""
        where = f'error while handling argument "{name}"'
        if name == "--reasoning-budget":  # an int, read as llama.cpp reads it
            if not -1 <= value < 2**31:
                raise InvalidArgument(f"{where}: the budget is -1 (no limit) or a number of tokens")
            self.values["reasoning_budget"] = value
            return
        if name == "--reasoning-budget-message":
            self.values["reasoning_budget_message"] = value
            return
        if name == "--reasoning-format":
            if value not in REASONING_FORMATS:
                raise InvalidArgument(f"{where}: unknown reasoning format '{value}' ({', '.join(REASONING_FORMATS)})")
            self.values["reasoning_format"] = value
            return
        text = _read_text(value, MAX_GRAMMAR_FILE) if name.endswith("-file") else value
        if name.startswith("--grammar"):
            self.values["grammar"], self.values["json_schema"] = text, None
            return
        try:
            schema = json.loads(text)
        except ValueError as e:
            raise InvalidArgument(f"{where}: not JSON: {e}") from None
        if not isinstance(schema, dict):
            raise InvalidArgument(f"{where}: a JSON schema is an object")
        self.values["json_schema"], self.values["grammar"] = schema, None

    def finish(self) -> LlamaEngineSettings:
        v = self.values
        if v.get("n_parallel", -1) == -1:  # llama-server's "auto"
            v["n_parallel"], v["kv_unified"] = 4, True
        else:
            v.setdefault("kv_unified", False)
        kwargs = v.setdefault("chat_template_kwargs", {})
        if v.get("reasoning") in ("on", "off"):
            kwargs["enable_thinking"] = v["reasoning"] == "on"
        kwargs.setdefault("preserve_reasoning", True)  # llama.cpp's default
        unknown = set(v) - _FIELDS
        assert not unknown, unknown
        return LlamaEngineSettings(**v, ignored_args=tuple(self.ignored.values()), action=self.action)


def _param(arg: LlamaArg) -> Param | None:
    return next((BY_CLI[n] for n in arg.names if n in BY_CLI), None)


def _bare_flash_attn(argv: Sequence[str], i: int) -> bool:
    """``-fa`` without a value (older llama.cpp): nothing follows, or another argument does."""
    if i + 1 >= len(argv):
        return True
    nxt = argv[i + 1]
    return nxt.startswith("-") and nxt != "-1"


def _read_template(path: str) -> str:
    return _read_text(path, MAX_TEMPLATE_FILE, "chat template file")


def _read_text(path: str, limit: int, what: str = "file") -> str:
    p = Path(path)
    try:
        if p.stat().st_size > limit:
            raise InvalidArgument(f"error: {what} '{path}' is larger than {limit} bytes")
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"error: failed to open file '{path}': {e}") from None
