"""llama-server's argument table (generated from arg.cpp), the status of each argument, the generator."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from engine.params_table import BY_CLI
from hydra_rpc import llama_args
from hydra_rpc.llama_args import APPLIED, ARGS, BY_NAME, NO_EFFECT, REFUSED, render_status_markdown, status
from hydra_rpc.llama_args_data import ARG_CPP_SHA256, LLAMA_CPP_SOURCE, SERVER_ARGS

REPO = Path(__file__).resolve().parent.parent
FLEET_PARAMS = [  # every key of the fleet's global and node params
    "flash-attn", "cache-type-k", "cache-type-v", "kv-unified", "cont-batching", "cache-prompt", "cache-reuse", "prio",
    "prio-batch", "rope-scaling", "rope-scale", "yarn-orig-ctx", "reasoning", "jinja", "timeout", "chat-template-kwargs",
    "log-prefix", "metrics", "slots", "perf", "log-verbosity", "context-shift", "host", "port", "rpc-port", "model",
    "chat-template-file", "n-cpu-moe", "n-gpu-layers", "override-tensor", "ctx-size", "parallel", "temp",
    "repeat-penalty", "top-k", "top-p", "slot-prompt-similarity", "ggml-rpc-port", "rpc-engine",
]
APPLIED_AT_LEAST = [  # the list
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


@pytest.mark.parametrize("key", APPLIED_AT_LEAST)
def test_applied(key):
    assert status(BY_NAME[f"--{key}"][0])[0] == APPLIED


def test_every_argument_has_one_status_with_a_note():
    tables = [llama_args.ACTIONS, llama_args._APPLIED, llama_args._NO_EFFECT, llama_args._REFUSED]
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
