"""hydra_rpc/cli/llama_argv.py: the command line a Hydra node agent starts llama-engine with."""
from __future__ import annotations

import pytest

from engine.params_table import GPU_LAYERS_ALL
from hydra_rpc.cli.llama_argv import InvalidArgument, parse_llama_argv
from tests.fleet import FLEET_GLOBAL, FLEET_NODE, node_agent_argv



@pytest.fixture
def fleet_argv(tmp_path, tiny_model_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    params = {**FLEET_GLOBAL, **FLEET_NODE, "model": tiny_model_path, "chat-template-file": str(template)}
    return node_agent_argv("127.0.0.1", 8080, 9503, params)


def test_the_fleets_command_line(fleet_argv, tiny_model_path):
    assert "--rope-scale" in fleet_argv and fleet_argv[fleet_argv.index("--rope-scale") + 1] == "5"
    s = parse_llama_argv(fleet_argv, env={})
    assert (s.host, s.port, s.rpc_port, s.ggml_rpc_port, s.hydra_port()) == (("127.0.0.1",), 8080, 9503, 9505, 9503)
    assert s.model == tiny_model_path
    assert (s.n_ctx, s.n_parallel, s.kv_unified) == (320000, 2, True)
    assert (s.flash_attn, s.cache_type_k, s.cache_type_v) == ("on", "q8_0", "q8_0")
    assert (s.rope_scaling, s.rope_scale, s.rope_freq_scale) == ("yarn", 5.0, 0.2)
    assert s.n_gpu_layers == GPU_LAYERS_ALL and s.n_cpu_moe == 8
    assert s.override_tensor == (("token_embd\\.weight", "CPU"), ("output\\.weight", "CPU"), ("output_norm\\.weight", "CPU"))
    assert s.t1 == {"sampling.temp": 0.86, "sampling.penalty_repeat": 1.06, "sampling.top_k": 20, "sampling.top_p": 0.95}
    assert s.jinja and s.chat_template.startswith("{% for m in messages %}")
    assert s.chat_template_kwargs == {"preserve_thinking": True, "enable_thinking": True, "preserve_reasoning": True}
    assert (s.cache_prompt, s.context_shift, s.metrics, s.slots, s.timeout, s.prio, s.prio_batch) == (
        True, True, True, True, 1800, 3, 1)
    assert (s.cache_reuse, s.slot_prompt_similarity, s.cache_ram, s.slot_save_path) == (64, 0.4, 8192, None)
    assert {a.name for a in s.ignored_args} == {
        "--cont-batching", "--log-verbosity", "--perf", "--rpc-engine", "--yarn-orig-ctx"}
    assert all(a.reason for a in s.ignored_args) and s.action is None


@pytest.mark.parametrize("token", ["--foo", "--foo=1", "-zz", "--flash-attn-x", "foo"])
def test_unknown_argument_is_named_like_llama_server(token):
    with pytest.raises(InvalidArgument) as e:
        parse_llama_argv(["--port", "8080", token, "1"], env={})
    assert str(e.value).startswith(f"error: invalid argument: {token}")


@pytest.mark.parametrize(("argv", "words"), [
    (["--api-key", "secret"], ["--api-key", "not supported", "without auth"]),
    (["--hf-repo", "x/y"], ["--hf-repo", "downloads"]),
    (["--draft", "5"], ["--draft", "the argument has been removed"]),
    (["--logit-bias", "15+1"], ["--logit-bias", "a request's own logit_bias"]),
])
def test_refused_arguments(argv, words):
    with pytest.raises(InvalidArgument) as e:
        parse_llama_argv(argv, env={})
    assert str(e.value).startswith(f"error: invalid argument: {argv[0]}")
    assert all(w in str(e.value) for w in words)


@pytest.mark.parametrize(("argv", "words"), [
    (["--ctx-size"], ['"--ctx-size"', "expected value"]),
    (["--flash-attn", "maybe"], ['"--flash-attn"', "on|off|auto"]),
    (["-ctk", "q8_1"], ['"-ctk"', "q8_0"]),
    (["-np", "0"], ['"-np"', "other than 0"]),
    (["-ngl", "x"], ['"-ngl"', "'auto' or 'all'"]),
    (["--chat-template-kwargs", "nope"], ["JSON object"]),
    (["--prio", "4"], ["prio"]),
    (["--log-verbosity", "loud"], ['"--log-verbosity"', "not a number"]),  # typed even without effect
    (["--slot-prompt-similarity", "high"], ['"--slot-prompt-similarity"', "not a number"]),  # llama.cpp's stof
    (["--poll", "x"], ['"--poll"', "not a number"]),
    (["--kv-unified=maybe"], ["invalid boolean value"]),
    (["--chat-template-file", "/nonexistent/t.jinja"], ["failed to open file"]),
])
def test_bad_values(argv, words):
    with pytest.raises(InvalidArgument) as e:
        parse_llama_argv(argv, env={})
    assert all(w in str(e.value) for w in words), str(e.value)


def test_argument_forms():
    s = parse_llama_argv(["-c", "1024", "--ubatch_size", "64", "--batch-size=256", "-np", "2", "-fa", "-kvu",
                          "-ot", "a=CPU", "-ot", "b=CPU,c=CPU", "-r", "stop one", "-r", "two", "-s", "-1",
                          "--temp", "-1", "-ngl", "7", "--rope-scale", "4", "--rope-freq-scale", "0.5"], env={})
    assert (s.n_ctx, s.ubatch_size, s.n_batch, s.n_parallel, s.flash_attn, s.kv_unified) == (1024, 64, 256, 2, "on", True)
    assert s.override_tensor == (("a", "CPU"), ("b", "CPU"), ("c", "CPU"))
    assert s.t1 == {"antiprompt": ("stop one", "two"), "sampling.seed": 0xFFFFFFFF, "sampling.temp": 0.0}
    assert s.n_gpu_layers == 7 and s.rope_freq_scale == 0.5  # the later of --rope-scale / --rope-freq-scale


@pytest.mark.parametrize(("argv", "kv_unified", "flash_attn"), [
    (["-np", "2", "-kvu", "--no-kv-unified"], False, "auto"),
    (["-np", "2", "-kvu", "-no-kvu", "-fa"], False, "on"),
    (["-np", "2", "--kv-unified=false", "-fa", "off"], False, "off"),
    (["-np", "2", "--kv_unified", "-fa", "-1"], True, "auto"),
    (["-np", "2"], False, "auto"),
    ([], True, "auto"),  # --parallel auto: 4 unified slots
])
def test_flags_and_negative_forms(argv, kv_unified, flash_attn):
    s = parse_llama_argv(argv, env={})
    assert (s.kv_unified, s.flash_attn) == (kv_unified, flash_attn)


def test_environment_twins_and_command_line_precedence():
    env = {"LLAMA_ARG_CTX_SIZE": "1024", "LLAMA_ARG_FLASH_ATTN": "on", "LLAMA_ARG_N_PARALLEL": "3",
           "LLAMA_ARG_KV_UNIFIED": "true", "LLAMA_ARG_ENDPOINT_METRICS": "1", "LLAMA_ARG_LOG_VERBOSITY": "4",
           "LLAMA_ARG_CHAT_TEMPLATE_KWARGS": '{"a": 1}', "LLAMA_CHAT_TEMPLATE_KWARGS": '{"b": 2}'}
    s = parse_llama_argv([], env=env)
    assert (s.n_ctx, s.flash_attn, s.n_parallel, s.kv_unified, s.metrics) == (1024, "on", 3, True, True)
    assert s.chat_template_kwargs["a"] == 1 and "b" not in s.chat_template_kwargs  # the current name wins
    assert [(a.name, a.source) for a in s.ignored_args] == [("--verbosity", "LLAMA_ARG_LOG_VERBOSITY")]
    s = parse_llama_argv(["-c", "2048", "-fa", "off", "--no-kv-unified"], env=env)
    assert (s.n_ctx, s.flash_attn, s.kv_unified) == (2048, "off", False)
    s = parse_llama_argv(["-np", "2"], env={"LLAMA_ARG_NO_KV_UNIFIED": "1", "LLAMA_ARG_ENDPOINT_METRICS": "0",
                                            "LLAMA_CHAT_TEMPLATE_KWARGS": '{"b": 2}'})
    assert (s.kv_unified, s.metrics) == (False, False) and s.chat_template_kwargs["b"] == 2


@pytest.mark.parametrize(("env", "var"), [({"LLAMA_ARG_KV_UNIFIED": "yes"}, "LLAMA_ARG_KV_UNIFIED"),
                                          ({"LLAMA_ARG_CTX_SIZE": "big"}, "LLAMA_ARG_CTX_SIZE"),
                                          ({"LLAMA_API_KEY": "k"}, '"LLAMA_API_KEY": --api-key is not supported')])
def test_bad_environment(env, var):
    with pytest.raises(InvalidArgument) as e:
        parse_llama_argv([], env=env)
    assert var in str(e.value)


@pytest.mark.parametrize(("argv", "action"), [(["--help"], "help"), (["-h"], "help"), (["--version"], "version")])
def test_actions(argv, action):
    assert parse_llama_argv(argv, env={}).action == action


def test_output_flags_are_applied(tmp_path):
    """--grammar/--json-schema (and their -file forms) and --reasoning-format reach the settings."""
    gbnf = tmp_path / "yes.gbnf"
    gbnf.write_text('root ::= "yes"')
    assert parse_llama_argv(["--grammar-file", str(gbnf)], {}).grammar == 'root ::= "yes"'
    s = parse_llama_argv(["-j", '{"type": "object"}', "--reasoning-format", "none"], {})
    assert (s.json_schema, s.grammar, s.reasoning_format) == ({"type": "object"}, None, "none")
    assert parse_llama_argv([], {"LLAMA_ARG_THINK": "deepseek"}).reasoning_format == "deepseek"
    for argv, words in ((["-j", "[1]"], "a JSON schema is an object"), (["-j", "{"], "not JSON"),
                        (["--reasoning-format", "loud"], "unknown reasoning format")):
        with pytest.raises(InvalidArgument) as e:
            parse_llama_argv(argv, {})
        assert words in str(e.value)


def test_a_bad_command_line_grammar_stops_the_start():
    from hydra_rpc.cli.llama_cli import default_grammar
    from hydra_rpc.cli.usage import UsageError

    assert default_grammar(parse_llama_argv(["--grammar", 'root ::= "a"'], {})).text == 'root ::= "a"'
    assert "root ::=" in default_grammar(parse_llama_argv(["-j", '{"type": "object"}'], {})).text
    with pytest.raises(UsageError, match="--grammar"):
        default_grammar(parse_llama_argv(["--grammar", "root ::= ("], {}))


def test_the_reasoning_budget_flags_reach_the_engine():
    from engine.reasoning_budget import ReasoningBudget
    from hydra_rpc.cli.llama_cli import reasoning_budget

    s = parse_llama_argv(["--reasoning-budget", "0", "--reasoning-budget-message", "Done thinking."], {})
    assert reasoning_budget(s) == ReasoningBudget(0, "Done thinking.")
    assert reasoning_budget(parse_llama_argv([], {})) is None
    with pytest.raises(InvalidArgument):
        parse_llama_argv(["--reasoning-budget", "-2"], {})
