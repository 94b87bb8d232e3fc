"""llama-server's argument table (generated from arg.cpp), the status of each argument, the generator."""
from __future__ import annotations

import importlib.util
import json
import sys
from types import SimpleNamespace
from pathlib import Path

import pytest

from engine.executors import PRIO_NICE
from engine.params_table import BY_CLI
from hydra_rpc.cli import llama_args
from hydra_rpc.cli.llama_argv import parse_llama_argv
from hydra_rpc.cli.llama_args import APPLIED, ARGS, BY_NAME, NO_EFFECT, REFUSED, render_status_markdown, status
from hydra_rpc.cli.llama_args_data import ARG_CPP_SHA256, LLAMA_CPP_SOURCE, SERVER_ARGS

REPO = Path(__file__).resolve().parent.parent
FLEET_PARAMS = [  # every key of the fleet's global and node params
    "flash-attn", "cache-type-k", "cache-type-v", "kv-unified", "cont-batching", "cache-prompt", "cache-reuse", "prio",
    "prio-batch", "rope-scaling", "rope-scale", "yarn-orig-ctx", "reasoning", "jinja", "timeout", "chat-template-kwargs",
    "log-prefix", "metrics", "slots", "perf", "log-verbosity", "context-shift", "host", "port", "rpc-port", "model",
    "chat-template-file", "n-cpu-moe", "n-gpu-layers", "override-tensor", "ctx-size", "parallel", "temp",
    "repeat-penalty", "top-k", "top-p", "slot-prompt-similarity", "ggml-rpc-port", "rpc-engine",
]
APPLIED_AT_LEAST = [  # the fleet's arguments that must take effect
    "model", "ctx-size", "parallel", "threads", "threads-batch", "batch-size", "ubatch-size", "n-gpu-layers",
    "flash-attn", "cache-type-k", "cache-type-v", "kv-unified", "rope-scaling", "rope-scale", "rope-freq-base",
    "yarn-ext-factor", "yarn-attn-factor", "yarn-beta-fast", "yarn-beta-slow", "override-tensor", "n-cpu-moe", "temp",
    "top-k", "top-p", "min-p", "repeat-penalty", "seed", "chat-template-file", "jinja", "chat-template-kwargs",
    "cache-prompt", "context-shift", "timeout", "metrics", "slots", "prio", "prio-batch", "ggml-rpc-port", "rpc",
    "rpc-port", "host", "port",
]


def test_generated_data_is_well_formed():
    assert LLAMA_CPP_SOURCE == "llama-cpp-python==0.3.36" and len(ARG_CPP_SHA256) == 64
    assert len(SERVER_ARGS) > 200
    seen = set()
    for a in ARGS:
        assert a.names and all(n.startswith("-") for n in (*a.names, *a.negative)), a
        assert not seen & set(a.names + a.negative), a.names
        seen |= set(a.names + a.negative)
        assert a.handler in ("void", "bool", "int", "string", "string2")
        assert (a.handler == "bool") == bool(a.negative), a.name
        assert (a.value_hint is not None) == (a.n_values > 0), a.name
        assert a.env is None or a.env.isupper() and " " not in a.env
        assert a.hydra or "SERVER" in a.examples or "COMMON" in a.examples and "SERVER" not in a.excludes
    # llama-server's own parse rules survive generation: -np is the server's, -p is not a server argument
    assert BY_NAME["-np"][0].help.startswith("number of server slots") and "-p" not in BY_NAME
    assert BY_NAME["--no-kv-unified"] == (BY_NAME["-kvu"][0], False)
    assert BY_NAME["--ctx-size"][0].env == "LLAMA_ARG_CTX_SIZE"
    assert BY_NAME["-sps"][0].conversion == "stof" and BY_NAME["--poll"][0].conversion == "stoul"
    assert BY_NAME["--spec-draft-ngl"][0].conversion is None  # also takes "auto" / "all"


@pytest.mark.parametrize("key", FLEET_PARAMS)
def test_the_fleets_params_are_known_and_not_refused(key):
    arg, _ = BY_NAME[f"--{key}"]
    assert status(arg)[0] in (APPLIED, NO_EFFECT), key


# Each applied argument with a value other than its default, and where that value must arrive in
# what `hydra-llama-engine` builds from the command line: the engine's config (model, context,
# sampling defaults), the server's config, the process priority it sets. ``B`` is that build.
EFFECTS = {
    "model": (["--model", "{model_b}"], lambda b: b.engine.model.model_path, "{model_b}"),
    "ctx-size": (["--ctx-size", "8192"], lambda b: b.engine.model.n_ctx, 8192),
    "parallel": (["-np", "3"], lambda b: b.engine.model.n_slots, 3),
    "threads": (["--threads", "3"], lambda b: b.engine.model.n_threads, 3),
    "threads-batch": (["-tb", "2"], lambda b: b.engine.model.n_threads_batch, 2),
    "batch-size": (["-b", "256"], lambda b: (b.engine.model.n_batch, b.engine.token_budget), (256, 256)),
    "ubatch-size": (["-ub", "128"], lambda b: b.engine.model.ubatch_size, 128),
    "n-gpu-layers": (["-ngl", "7"], lambda b: b.engine.model.n_gpu_layers, 7),
    "flash-attn": (["-fa", "on"], lambda b: b.engine.model.flash_attn, "on"),
    "cache-type-k": (["-ctk", "q8_0"], lambda b: b.engine.model.cache_type_k, "q8_0"),
    "cache-type-v": (["-ctv", "q8_0"], lambda b: b.engine.model.cache_type_v, "q8_0"),
    # with the slot count given, llama-server's default is a KV buffer per slot (auto: unified)
    "kv-unified": (["-np", "2", "--kv-unified"], lambda b: b.engine.model.kv_unified, True, ["-np", "2"]),
    "rope-scaling": (["--rope-scaling", "yarn"], lambda b: b.engine.model.rope_scaling, "yarn"),
    "rope-scale": (["--rope-scale", "4"], lambda b: b.engine.model.rope_freq_scale, 0.25),
    "rope-freq-base": (["--rope-freq-base", "20000"], lambda b: b.engine.model.rope_freq_base, 20000.0),
    "yarn-ext-factor": (["--yarn-ext-factor", "0.5"], lambda b: b.engine.model.yarn_ext_factor, 0.5),
    "yarn-attn-factor": (["--yarn-attn-factor", "0.5"], lambda b: b.engine.model.yarn_attn_factor, 0.5),
    "yarn-beta-fast": (["--yarn-beta-fast", "16"], lambda b: b.engine.model.yarn_beta_fast, 16.0),
    "yarn-beta-slow": (["--yarn-beta-slow", "2"], lambda b: b.engine.model.yarn_beta_slow, 2.0),
    "override-tensor": (["-ot", r"blk\.0\..*=CPU"], lambda b: b.engine.model.override_tensor, ((r"blk\.0\..*", "CPU"),)),
    "n-cpu-moe": (["--n-cpu-moe", "2"], lambda b: b.engine.model.n_cpu_moe, 2),
    "temp": (["--temp", "0.5"], lambda b: b.engine.defaults.get("sampling.temp"), 0.5),
    "top-k": (["--top-k", "7"], lambda b: b.engine.defaults.get("sampling.top_k"), 7),
    "top-p": (["--top-p", "0.5"], lambda b: b.engine.defaults.get("sampling.top_p"), 0.5),
    "min-p": (["--min-p", "0.2"], lambda b: b.engine.defaults.get("sampling.min_p"), 0.2),
    "repeat-penalty": (["--repeat-penalty", "1.3"], lambda b: b.engine.defaults.get("sampling.penalty_repeat"), 1.3),
    "seed": (["--seed", "1234"], lambda b: b.engine.defaults.get("sampling.seed"), 1234),
    "chat-template-file": (["--chat-template-file", "{template}"], lambda b: b.engine.model.chat_template, "{{ 1 }}"),
    "jinja": (["--no-jinja"], lambda b: b.engine.model.jinja, False),
    "chat-template-kwargs": (["--chat-template-kwargs", '{"enable_thinking":false}'],
                             lambda b: json.loads(b.engine.model.chat_template_kwargs).get("enable_thinking"), False),
    "cache-prompt": (["--no-cache-prompt"], lambda b: b.engine.model.cache_prompt, False),
    "context-shift": (["--context-shift"], lambda b: b.engine.model.context_shift, True),
    "timeout": (["--timeout", "77"], lambda b: b.server.http_timeout, 77.0),
    "metrics": (["--metrics"], lambda b: b.server.http_metrics, True),
    "slots": (["--no-slots"], lambda b: b.server.http_slots, False),
    "prio": (["--prio", "2"], lambda b: b.nice, PRIO_NICE[2]),
    "prio-batch": (["--prio-batch", "1"], lambda b: b.engine.thread_nice, PRIO_NICE[1]),
    "ggml-rpc-port": (["--ggml-rpc-port", "9599"], lambda b: b.server.ggml_rpc_port, 9599),
    "rpc": (["--rpc", "127.0.0.1:50052"], lambda b: b.engine.model.rpc_servers, ("127.0.0.1:50052",)),
    "rpc-port": (["--rpc-port", "9598"], lambda b: b.server.port, 9598),
    "host": (["--host", "127.0.0.2"], lambda b: (b.server.host, b.kw["http_host"]), ("127.0.0.2", "127.0.0.2")),
    "port": (["--port", "8181"], lambda b: (b.kw["http_port"], b.server.port), (8181, 8182)),
}


@pytest.fixture
def build(monkeypatch, tmp_path, tiny_model_path):
    """``build(*argv)``: what hydra-llama-engine's ``build_app`` makes of ``--model tiny argv``
    (the App it would start is only recorded, the process priority only noted)."""
    import hydra_rpc.app
    from hydra_rpc.cli import llama_cli
    from hydra_rpc.cli import llama_engine as llama_engine_cmd

    made = {}

    class RecordedApp:
        def __init__(self, server, engine, **kw):
            made.update(server=server, engine=engine, kw=kw)

    monkeypatch.setattr(hydra_rpc.app, "App", RecordedApp)
    monkeypatch.setattr(llama_cli, "set_thread_nice", lambda nice: made.__setitem__("nice", nice))
    monkeypatch.setattr(llama_engine_cmd, "announce_ignored", lambda s, prog: None)

    def run(*argv: str) -> SimpleNamespace:
        made.clear()
        made["nice"] = None
        llama_engine_cmd.build_app(parse_llama_argv(["--model", tiny_model_path, *argv], env={}))
        return SimpleNamespace(**made)

    return run


@pytest.mark.parametrize("key", APPLIED_AT_LEAST)
def test_applied(key, build, tmp_path, tiny_model_b_path):
    """Each argument the table calls applied changes what the server is built with."""
    assert status(BY_NAME[f"--{key}"][0])[0] == APPLIED
    template = tmp_path / "t.jinja"
    template.write_text("{{ 1 }}")
    fill = {"model_b": tiny_model_b_path, "template": str(template)}
    argv, effect, want, *base = EFFECTS[key]
    base = base[0] if base else []
    argv = [fill[a.strip("{}")] if a.startswith("{") and a.strip("{}") in fill else a for a in argv]
    if isinstance(want, str) and want.startswith("{") and want.strip("{}") in fill:
        want = fill[want.strip("{}")]
    assert effect(build(*base)) != want, f"--{key}: the default already gives {want!r}; the check proves nothing"
    assert effect(build(*argv)) == want


def test_every_argument_has_one_status_with_a_note():
    tables = [llama_args.ACTIONS, llama_args._APPLIED, llama_args._NO_EFFECT, llama_args._REFUSED,
              llama_args.GPU_APPLIED]  # the device options: applied or not by the build (test_gpu_offload.py)
    names = {a.name for a in ARGS}
    for table in tables:
        assert set(table) <= names, set(table) - names  # no stale names
    for a in ARGS:
        assert sum(a.name in t for t in tables) == 1, a.name
        label, note = status(a)
        assert label in (APPLIED, NO_EFFECT, REFUSED) and note and note != "not classified"


def test_applied_arguments_have_a_typed_parameter_and_our_spellings_are_llamas():
    for a in ARGS:
        if status(a)[0] == APPLIED and a.name not in {*llama_args.ACTIONS, *llama_args.OUTPUT_ARGS}:
            assert any(n in BY_CLI for n in a.names), a.name
    for name in BY_CLI:
        assert name in BY_NAME, name  # the params table uses llama.cpp's (or llama-engine's) names only


def test_docs_table_is_up_to_date():
    assert (REPO / "docs" / "llama-args.md").read_text() == render_status_markdown()


# ---- the generator ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_llama_args", REPO / "scripts" / "gen_llama_args.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_llama_args"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gen_llama_args"]


SNIPPET = r'''
static std::initializer_list<enum llama_example> mm_examples = { LLAMA_EXAMPLE_MTMD, LLAMA_EXAMPLE_SERVER };
common_params_context common_params_parser_init(common_params & params, llama_example ex, void(*print_usage)(int, char **)) {
    if (ex == LLAMA_EXAMPLE_SERVER) { params.n_parallel = -1; }
    std::string s;
    for (const auto & x : params.xs) { s += x; }
    if (!s.empty()) { s.pop_back(); }
    auto add_opt = [&](common_arg arg) { ctx_arg.options.push_back(std::move(arg)); };
    add_opt(common_arg(
        {"-c", "--ctx-size"}, "N",
        string_format("size (default: %d, min %" PRIu32 ")", params.n_ctx, 4u),
        [](common_params & params, int value) { params.n_ctx = value; }
    ).set_env("LLAMA_ARG_CTX_SIZE"));
    // add_opt(common_arg({"--commented-out"}, "x", [](common_params &) {}));
    add_opt(common_arg(
        {"-kvu", "--kv-unified"}, {"-no-kvu", "--no-kv-unified"},
        "a \"quoted\" help " "continued",
        [](common_params & params, bool value) { const std::regex r{ R"([,)/]+)" }; params.kv_unified = value; }
    ).set_examples({LLAMA_EXAMPLE_SERVER, LLAMA_EXAMPLE_BENCH}).set_env("LLAMA_ARG_KV_UNIFIED"));
    add_opt(common_arg({"--range"}, "START", "END", "two values",
        [](common_params & params, const std::string & a, const std::string & b) {}));
    add_opt(common_arg({"-p", "--prompt"}, "P", "not for the server",
        [](common_params & params, const std::string & v) {}).set_excludes({LLAMA_EXAMPLE_SERVER}));
    add_opt(common_arg({"--mm"}, "F", "mm", [](common_params & params, const std::string & v) {}).set_examples(mm_examples));
    add_opt(common_arg({"--cli-only"}, "cli", [](common_params & params) {}).set_examples({LLAMA_EXAMPLE_CLI}));
    if (ex == LLAMA_EXAMPLE_SERVER) {
        add_opt(common_arg({"-np", "--parallel"}, "N", "server slots", [](common_params & params, int v) {}));
    } else {
        add_opt(common_arg({"-np", "--parallel"}, "N", "sequences", [](common_params & params, int v) {}));
    }
    add_opt(common_arg({"--sampler"}, ex == LLAMA_EXAMPLE_SERVER ? "S" : "T",
        ex == LLAMA_EXAMPLE_COMPLETION ? "completion help" : "other help",
        [](common_params & params, const std::string & v) {}).set_sampling().set_spec());
    add_opt(common_arg({"--ratio"}, "R", "r", [](common_params & params, const std::string & v) { params.r = std::stof(v); }));
    return ctx_arg;
}
'''


def test_generator_parses_the_shapes_arg_cpp_uses(gen):
    args = {a.names[-1]: a for a in gen.parse_arg_cpp(SNIPPET)}
    assert list(args) == ["--ctx-size", "--kv-unified", "--range", "--mm", "--parallel", "--sampler", "--ratio"]
    assert args["--ratio"].conversion == "stof" and args["--mm"].conversion is None
    c = args["--ctx-size"]
    assert (c.handler, c.value_hint, c.env, c.help) == ("int", "N", "LLAMA_ARG_CTX_SIZE", "size (default: {n_ctx}, min {4u})")
    k = args["--kv-unified"]
    assert (k.handler, k.negative, k.help) == ("bool", ["-no-kvu", "--no-kv-unified"], 'a "quoted" help continued')
    assert args["--range"].handler == "string2" and args["--range"].value_hint_2 == "END"
    assert args["--mm"].examples == ["LLAMA_EXAMPLE_MTMD", "LLAMA_EXAMPLE_SERVER"]
    assert args["--parallel"].help == "server slots"
    assert args["--sampler"].sampling and args["--sampler"].spec and args["--sampler"].help == "other help"
    data = gen.render_data(list(args.values()), "0" * 64)
    namespace: dict = {}
    exec(compile(data, "data", "exec"), namespace)
    assert [a["names"][-1] for a in namespace["SERVER_ARGS"]] == list(args)


@pytest.mark.parametrize("bad", [
    "if (verbose) { add_opt(common_arg({\"--x\"}, \"x\", [](common_params & params) {})); }",
    "add_opt(common_arg({\"--x\"}, \"x\", [](common_params & params) {}).set_colour(1));",
    "add_opt(make_arg());",
])
def test_generator_fails_loudly_on_unknown_shapes(gen, bad):
    text = ("common_params_context common_params_parser_init(common_params & params, llama_example ex) {"
            + bad + " return ctx_arg; }")
    with pytest.raises(gen.ArgCppError):
        gen.parse_arg_cpp(text)
