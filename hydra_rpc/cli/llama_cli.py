"""One vocabulary for the model, the context and sampling: llama.cpp's (docs/llama-args.md).

``hydra-llama-engine`` reads llama-engine's whole command line with
:func:`~hydra_rpc.cli.llama_argv.parse_llama_argv`. ``hydra-rpc serve`` registers the same
arguments with argparse (for ``--help`` and its errors), collects the ones given, in order,
and hands them to the same parser. Both then build the engine from the settings here, so an
argument means the same in both.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from typing import Any

from engine.config import EngineConfig
from engine.executors import PRIO_NICE, set_thread_nice
from engine.model_params import ModelParams
from engine.reasoning_budget import MAX_BUDGET_MESSAGE, ReasoningBudget
from engine.rpc_allow import RpcAllowList
from engine.sampling import GrammarSpec

from hydra_rpc.cli.llama_args import APPLIED, ARGS, status
from hydra_rpc.cli.llama_argv import LlamaEngineSettings
from hydra_rpc.observability.logs import announce
from hydra_rpc.cli.usage import UsageError

#: serve's v1 names → (the llama.cpp argument they stand for now, what to say)
DEPRECATED = {
    "--ctx": ("--kv-unified-per-slot", "--ctx N (context per slot) is deprecated: use --ctx-size TOTAL, or "
                                       "--kv-unified-per-slot N for N tokens per slot"),
    "--slots": ("--parallel", "--slots N is deprecated: use --parallel N"),
    "--batch": ("--batch-size", "--batch N is deprecated: use --batch-size N"),
    "--rpc-servers": ("--rpc", "--rpc-servers is deprecated: use --rpc HOST:PORT,..."),
}


_RESERVED = {"--version", "--debug"}  # every hydra-rpc command's own


class _Collect(argparse.Action):
    """Keep the argument as it was given (``namespace.llama_argv``), for parse_llama_argv."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        given = getattr(namespace, "llama_argv", None) or []
        values = [] if values is None else [values] if isinstance(values, str) else list(values)
        if option_string in DEPRECATED:
            name, warning = DEPRECATED[option_string]
            namespace.deprecated = [*getattr(namespace, "deprecated", []), warning]
            option_string = name
        namespace.llama_argv = [*given, option_string, *values]


def add_llama_arguments(p: argparse.ArgumentParser, skip: set[str] = frozenset()) -> None:
    """The deprecated v1 names, then every llama-server argument none of whose names ``p``
    defines itself or ``skip`` names (help shown for the applied ones). Add them after ``p``'s own."""
    p.set_defaults(llama_argv=[], deprecated=[])
    d = p.add_argument_group("deprecated (v1) names")
    for name, (_, warning) in DEPRECATED.items():
        d.add_argument(name, action=_Collect, nargs=1, metavar="N" if name != "--rpc-servers" else "HOST:PORT",
                       help=warning)
    g = p.add_argument_group("model, context and sampling: llama.cpp's arguments",
                             "every llama-server argument is accepted, with llama.cpp's meaning; those without "
                             "effect here are listed at startup, see docs/llama-args.md")
    taken = set(p._option_string_actions) | _RESERVED | skip  # noqa: SLF001 - argparse has no public accessor
    for arg in ARGS:
        names = (*arg.names, *arg.negative)
        if taken & set(names):
            continue
        label, note = status(arg)
        nargs: Any = {"int": 1, "string": 1, "string2": 2}.get(arg.handler, 0)
        if arg.name == "--flash-attn":
            nargs = "?"  # a bare -fa (older llama.cpp) means on
        g.add_argument(*names, action=_Collect, nargs=nargs, metavar=arg.value_hint if nargs else None,
                       help=_help(arg.help, note) if label == APPLIED else argparse.SUPPRESS)


def _help(llama_help: str, note: str) -> str:
    """llama.cpp's first help line without its ``{…}`` default placeholders, and what it maps to."""
    text = re.sub(r"\s*\((default|env)[^()]*(\([^()]*\)[^()]*)*\)", "", llama_help.split("\n")[0])
    if "{" in text:
        text = text[:text.index("{")].removesuffix("'").removesuffix("default: ").rstrip(" ,(")
        text += ")" * (text.count("(") - text.count(")"))
    return f"{text} (here: {note})".replace("%", "%%")


def warn_deprecated(args: argparse.Namespace) -> None:
    for line in args.deprecated:
        print(f"hydra-rpc serve: warning: {line}", file=sys.stderr, flush=True)


def model_params(s: LlamaEngineSettings, model_path: str) -> ModelParams:
    """The engine's model and context from llama.cpp's settings (llama-server's meanings)."""
    n_ctx = s.n_ctx
    if n_ctx is None:  # llama-server: -c not given sizes the pool from --kv-unified-per-slot, else the model's
        n_ctx = s.n_parallel * s.kv_unified_per_slot if s.kv_unified_per_slot > 0 else 0
    return ModelParams(
        model_path, n_ctx=n_ctx, n_slots=s.n_parallel, kv_unified=s.kv_unified, n_ctx_slot_cap=s.kv_unified_per_slot,
        n_batch=s.n_batch, ubatch_size=s.ubatch_size, n_threads=s.threads if s.threads > 0 else None,
        n_threads_batch=s.threads_batch if s.threads_batch and s.threads_batch > 0 else None,
        flash_attn=s.flash_attn, cache_type_k=s.cache_type_k, cache_type_v=s.cache_type_v,
        rope_scaling=s.rope_scaling, rope_freq_base=s.rope_freq_base, rope_freq_scale=s.rope_freq_scale,
        yarn_ext_factor=s.yarn_ext_factor, yarn_attn_factor=s.yarn_attn_factor, yarn_beta_fast=s.yarn_beta_fast,
        yarn_beta_slow=s.yarn_beta_slow, swa_full=s.swa_full, offload_kqv=s.offload_kqv,
        n_gpu_layers=s.n_gpu_layers, rpc_servers=s.rpc_servers, override_tensor=s.override_tensor,
        split_mode=s.split_mode, tensor_split=s.tensor_split, main_gpu=s.main_gpu, devices=s.devices,
        n_cpu_moe=s.n_cpu_moe, cpu_moe=s.cpu_moe, load_mode=s.load_mode, repack=s.repack, no_host=s.no_host,
        check_tensors=s.check_tensors, chat_template=s.chat_template, jinja=s.jinja,
        chat_template_kwargs=json.dumps(s.chat_template_kwargs, sort_keys=True), cache_prompt=s.cache_prompt,
        cache_reuse=s.cache_reuse, context_shift=s.context_shift)


def t1_defaults(s: LlamaEngineSettings) -> dict[str, Any]:
    """The T1 defaults (sampling, n_predict, …) the command line sets, as CONFIGURE names them."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in s.t1.items()}


def engine_config(s: LlamaEngineSettings, model_path: str, rpc_allow: Sequence[str] = (), **kw: Any) -> EngineConfig:
    """The engine for these settings (``kw``: EngineConfig's own fields, e.g. aliases). A
    CONFIGURE ``rpc_servers`` may name the ``--rpc`` servers and those of ``rpc_allow``
    (``HOST:PORT,...`` each). Raises UsageError for one that is not HOST:PORT."""
    nice = PRIO_NICE[s.prio_batch] if s.prio_batch else None
    extra = [e.strip() for a in rpc_allow for e in a.split(",") if e.strip()]
    try:
        allow = RpcAllowList((*s.rpc_servers, *extra))
    except ValueError as e:
        raise UsageError(f"--rpc / --rpc-allow: {e}; give HOST:PORT,...") from None
    return EngineConfig(model=model_params(s, model_path), defaults=t1_defaults(s), token_budget=s.n_batch,
                        thread_nice=nice, slot_prompt_similarity=s.slot_prompt_similarity, cache_ram_mib=s.cache_ram,
                        slot_save_path=s.slot_save_path, ctx_checkpoints=s.ctx_checkpoints,
                        checkpoint_min_step=s.checkpoint_min_step, rpc_allow=allow, reasoning_format=s.reasoning_format,
                        default_grammar=default_grammar(s), reasoning_budget=reasoning_budget(s), **kw)


def reasoning_budget(s: LlamaEngineSettings) -> ReasoningBudget | None:
    if s.reasoning_budget < 0:
        return None
    if len(s.reasoning_budget_message.encode("utf-8")) > MAX_BUDGET_MESSAGE:
        raise UsageError(f"--reasoning-budget-message: at most {MAX_BUDGET_MESSAGE} bytes")
    return ReasoningBudget(s.reasoning_budget, s.reasoning_budget_message)


def default_grammar(s: LlamaEngineSettings) -> GrammarSpec | None:
    """``--grammar[-file]`` or ``--json-schema[-file]``, checked now: a bad one stops the start."""
    from engine.chat.grammar import schema_to_gbnf
    from engine.llama_backend.grammar_sampler import check_grammar_spec

    try:
        if s.grammar is not None:
            spec = GrammarSpec(s.grammar, after_think=False) if s.grammar.strip() else None
            if spec is not None:
                check_grammar_spec(spec)
            return spec
        if s.json_schema is not None:
            return GrammarSpec(schema_to_gbnf(s.json_schema))
    except ValueError as e:
        raise UsageError(f"--grammar / --json-schema: {e}") from None
    return None


def apply_process_priority(s: LlamaEngineSettings) -> None:
    """``--prio``: the process's priority, as llama-server sets it (from the main thread, before
    any other starts, so they inherit it); a failure is a warning, as there."""
    if s.prio:
        error = set_thread_nice(PRIO_NICE[s.prio])
        if error:
            announce(f"warning: failed to set process priority {s.prio} (nice {PRIO_NICE[s.prio]}): {error}",
                     level="WARNING")


def announce_ignored(s: LlamaEngineSettings, prog: str) -> None:
    """Every argument accepted without effect, once (INFO ``ignored_args`` lists them too)."""
    for a in s.ignored_args:
        value = "" if a.value is None else f" {a.value!r}"
        where = "" if a.source == "argv" else f" (from {a.source})"
        announce(f"{prog}: {a.name}{value}{where} has no effect here: {a.reason}", level="WARNING",
                 arg=a.name, reason=a.reason)
