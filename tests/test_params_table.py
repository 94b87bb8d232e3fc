"""engine/params_table.py: typed values for CONFIGURE/hydra_config and the command line."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import tiers
from engine.params_table import (
    BY_CLI,
    BY_KEY,
    GPU_LAYERS_ALL,
    PARAMS,
    ParamError,
    UnknownParam,
    check_config,
    stof,
    stoi,
    stoul32,
    validate,
)


def test_table_is_well_formed():
    assert {p.tier for p in PARAMS} <= {"T1", "T2", "T3", "T4", "startup"}
    for p in PARAMS:
        assert p.cli or p.config, p.key
        if p.default not in (None, ()):
            assert p.validate(p.default) == p.default, p.key


def test_configure_classifies_every_key_by_the_table():
    """CONFIGURE (engine/tiers.py) takes each key's tier and type from this table: the C++'s
    tiers (T2 cache types and rope_*, T3 model keys), startup keys denied, no-effect keys named."""
    for p in PARAMS:
        if not p.config or p.default in (None, ()):
            continue
        c = tiers.classify({p.key: p.default})
        if p.key in tiers.NO_EFFECT:
            assert c.rejected_keys[p.key].startswith("no effect"), p.key
        elif p.tier == "startup":
            assert c.rejected_keys == {p.key: tiers.DENIED}, p.key
        elif p.tier == "T1":
            assert p.key in c.t1 and c.tier == "T1", p.key
        else:
            assert c.staged == {p.key: p.validate(p.default)} and c.tier == p.tier, p.key
    assert all(p.tier == "T2" for p in PARAMS if p.key.startswith("rope_"))
    assert {BY_KEY[k].tier for k in ("cache_type_k", "cache_type_v", "n_ctx")} == {"T2"}
    assert {BY_KEY[k].tier for k in ("model_path", "n_gpu_layers", "rpc_servers", "n_cpu_moe", "override_tensor")} \
        == {"T3"}


def test_configure_rejects_wrong_values_with_the_reason_and_applies_the_rest():
    c = tiers.classify({"flash_attn": 7, "rope_scale": 0, "n_ctx": 2**31, "temp": "hot", "top_k": 20,
                        "cache_type_k": "iq4_nl", "sampling": 3, "fit": True, "frob": 1})
    assert c.rejected_keys["flash_attn"] == "flash_attn must be one of on|off|auto (1|0|-1) or a bool"
    assert "rope_scale must be a finite number in" in c.rejected_keys["rope_scale"]
    assert "n_ctx must be an integer in [0, 16777216]" in c.rejected_keys["n_ctx"]
    assert c.rejected_keys["temp"].startswith("temp must be")  # named as sent, not sampling.temp
    assert c.rejected_keys["sampling"] == "sampling must be an object"
    assert c.rejected_keys["fit"] == tiers.DENIED and c.unrecognized_keys == ["frob"]
    assert c.t1 == {"sampling.top_k": 20} and c.staged == {"cache_type_k": "iq4_nl"} and c.tier == "T2"


@pytest.mark.parametrize(("key", "value", "typed"), [
    ("flash_attn", "on", "on"), ("flash_attn", True, "on"), ("flash_attn", 0, "off"), ("flash_attn", -1, "auto"), ("flash_attn", "disabled", "off"), ("flash_attn", "-1", "auto"),
    ("cache_type_k", "iq4_nl", "iq4_nl"), ("cache_type_v", "q8_0", "q8_0"),
    ("n_gpu_layers", "all", GPU_LAYERS_ALL), ("n_gpu_layers", 12, 12),
    ("temp", -0.5, 0.0), ("sampling.top_k", 20, 20), ("repeat_penalty", 1.06, 1.06), ("seed", -1, 0xFFFFFFFF),
    ("rope_scale", 5, 5.0), ("rope_scaling", "yarn", "yarn"), ("n_ctx", 320000, 320000), ("yarn_orig_ctx", 32768, 32768),
    ("kv_unified", True, True), ("kv_unified", "on", True),
    ("override_tensor", "token_embd\\.weight=CPU,output\\.weight=CPU",
     (("token_embd\\.weight", "CPU"), ("output\\.weight", "CPU"))),
    ("override_tensor", "a=CPU\nb=RPC0", (("a", "CPU"), ("b", "RPC0"))),  # the C# client's separator
    ("chat_template_kwargs", '{"preserve_thinking": true}', {"preserve_thinking": True}),
    ("chat_template_kwargs", {"x": [1]}, {"x": [1]}),
    ("rpc_servers", "127.0.0.1:50052, [::1]:9", ("127.0.0.1:50052", "[::1]:9")),
    ("tensor_split", "21/44", (21.0, 44.0)), ("model", {"path": "m.gguf"}, "m.gguf"), ("model_path", "m.gguf", "m.gguf"),
])
def test_accepted_like_the_cpp(key, value, typed):
    assert validate(key, value) == typed


@pytest.mark.parametrize(("key", "value", "reason"), [
    ("flash_attn", 7, "flash_attn must be one of on|off|auto (1|0|-1) or a bool"),
    ("flash_attn", 2, "flash_attn must be one of on|off|auto (1|0|-1) or a bool"),
    ("rope_scale", 0, "rope_scale must be a finite number in"),
    ("rope_scale", -1.0, "rope_scale must be"),
    ("n_ctx", 2**31, "n_ctx must be an integer in [0, 16777216]"),
    ("n_ctx", 1.5, "n_ctx must be an integer"),
    ("n_ctx", True, "n_ctx must be an integer"),
    ("cache_type_k", "q8_1", "cache_type_k must be one of f32|f16|bf16|q8_0|q4_0|q4_1|iq4_nl|q5_0|q5_1"),
    ("top_p", math.nan, "top_p must be"),
    ("temp", math.inf, "temp must be"),
    ("n_gpu_layers", -3, "n_gpu_layers must be a number of layers, 'auto' or 'all'"),
    ("override_tensor", "noequals", "override_tensor must be <tensor name pattern>=<buffer type>"),
    ("override_tensor", "(=CPU", "override_tensor must be a valid tensor name pattern"),
    ("rpc_servers", "host", "rpc_servers must be HOST:PORT"),
    ("chat_template_kwargs", "[1]", "chat_template_kwargs must be a JSON object"),
    ("chat_template_kwargs", "{", "chat_template_kwargs must be a valid JSON object"),
    ("model", "", "model must be a non-empty string"),
    ("seed", 2**32, "seed must be an integer in [-1, 4294967295]"),
    ("kv_unified", 1, "kv_unified must be a bool"),
])
def test_rejected_with_a_reason(key, value, reason):
    with pytest.raises(ParamError) as e:
        validate(key, value)
    assert str(e.value).startswith(reason) and e.value.key == key


def test_startup_and_unknown_keys_are_unknown_to_configure():
    for key in ("nope", "port", "host", "chat_template_file", "metrics", 7):
        with pytest.raises(UnknownParam):
            validate(key, 1)


def test_check_config_splits_values_rejected_unknown():
    out = check_config({"sampling": {"temp": 0.5, "bogus": 1}, "flash_attn": 7, "what": 1, "n_ctx": 8192,
                        "cache_type_k": "iq4_nl"})
    assert out.values == {"sampling.temp": 0.5, "n_ctx": 8192, "cache_type_k": "iq4_nl"}
    assert out.rejected == {"flash_attn": "flash_attn must be one of on|off|auto (1|0|-1) or a bool"}
    assert out.unknown == ["sampling.bogus", "what"]


# ---- llama.cpp's string conversions --------------------------------------------------------------

@pytest.mark.parametrize(("text", "value"), [("12", 12), (" -3", -3), ("+7", 7), ("12abc", 12), ("0x10", 0),
                                             ("2147483647", 2**31 - 1)])
def test_stoi(text, value):
    assert stoi(text) == value


@pytest.mark.parametrize("text", ["", "abc", "2147483648", "-2147483649", "- 1"])
def test_stoi_refuses(text):
    with pytest.raises(ValueError):
        stoi(text)


@pytest.mark.parametrize(("text", "value"), [("0.86", 0.86), ("5", 5.0), ("1e3x", 1000.0), (".5", 0.5),
                                             ("0x1p-2", 0.25), ("-inf", -math.inf), ("Infinity", math.inf), ("1.", 1.0)])
def test_stof(text, value):
    assert stof(text) == value


def test_stof_nan_and_range():
    assert math.isnan(stof("nan(0x1)")) and math.isnan(stof("NaN"))
    for text in ("", "e5", "1e39", "x1"):
        with pytest.raises(ValueError):
            stof(text)


def test_stoul32_wraps_like_llama_seed():
    assert stoul32("-1") == 0xFFFFFFFF and stoul32("4294967296") == 0 and stoul32("42") == 42


@pytest.mark.parametrize(("cli", "text", "typed"), [
    ("-c", "320000", 320000), ("-fa", "on", "on"), ("--flash-attn", "auto", "auto"), ("-ctk", "q8_0", "q8_0"),
    ("-ngl", "all", GPU_LAYERS_ALL), ("-ngl", "auto", -1), ("-ngl", "99", 99), ("--temp", "0.86", 0.86),
    ("--temp", "-1", 0.0), ("-s", "-1", 0xFFFFFFFF), ("--rope-scaling", "yarn", "yarn"), ("--rope-scale", "5", 5.0),
    ("--chat-template-kwargs", '{"preserve_thinking": true}', {"preserve_thinking": True}),
    ("--prio", "3", 3), ("-np", "2", 2), ("-np", "-1", -1), ("--combined-split-mode", "layer", "layer"),
])
def test_cli_text(cli, text, typed):
    assert BY_CLI[cli].parse_cli(text) == typed


@pytest.mark.parametrize(("cli", "text"), [
    ("-fa", "maybe"), ("-ctk", "q8_1"), ("-c", "lots"), ("-np", "0"), ("--prio", "4"), ("--prio-batch", "-1"),
    ("--rope-scaling", "YARN"), ("--rope-scale", "0"), ("-ncmoe", "-1"), ("--combined-split-mode", "row"),
    ("--chat-template-kwargs", "not json"), ("-ngl", "x"),
])
def test_cli_text_refused(cli, text):
    with pytest.raises(ParamError):
        BY_CLI[cli].parse_cli(text)


# ---- never anything but ParamError ------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
keys = st.sampled_from(sorted(BY_KEY)) | st.text(max_size=12)


@settings(max_examples=1500, deadline=None)
@given(key=keys, value=json_values)
def test_validate_raises_only_param_error(key, value):
    try:
        validate(key, value)
    except ParamError as e:
        assert e.reason and isinstance(e.reason, str)


@settings(max_examples=800, deadline=None)
@given(cli=st.sampled_from(sorted(BY_CLI)), text=st.text(max_size=40))
def test_parse_cli_raises_only_param_error(cli, text):
    try:
        BY_CLI[cli].parse_cli(text)
    except ParamError:
        pass
