"""engine/tensor_overrides.py: --override-tensor / --n-cpu-moe through llama.cpp's C API."""
from __future__ import annotations

import re

import llama_cpp as L
import pytest

from engine.model_files import ensure_tiny_model
from engine.tensor_overrides import build_tensor_overrides, buffer_types, moe_cpu_patterns
from tests.llama_log import LlamaLogCapture


def load_with(overrides, variant: str = "a") -> list[str]:
    """Load a tiny model with ``overrides``; return the tensors llama.cpp says it moved."""
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.tensor_buft_overrides = overrides.as_param()
    with LlamaLogCapture() as log:
        model = L.llama_model_load_from_file(str(ensure_tiny_model(variant)).encode(), mp)
    assert model
    L.llama_model_free(model)
    return [m.group(1) for ln in log.lines if (m := re.match(r"tensor (\S+) .*buffer type overridden to CPU", ln))]


def test_cpu_is_a_buffer_type():
    assert "CPU" in buffer_types()


def test_overrides_reach_the_loader_in_order():
    moved = load_with(build_tensor_overrides([(r"token_embd\.weight", "CPU"), (r"blk\.1\.attn_.*", "CPU")]))
    assert moved[0] == "token_embd.weight" and {"blk.1.attn_q.weight", "blk.1.attn_k.weight"} <= set(moved)
    assert not any(t.startswith("blk.0.") for t in moved)


def test_no_overrides_is_a_null_pointer():
    o = build_tensor_overrides()
    assert o.as_param() is None and load_with(o) == []


def test_moe_patterns_are_llama_cpps():
    assert moe_cpu_patterns(2) == [r"blk\.0\.ffn_(up|down|gate|gate_up)_(ch|)exps",
                                   r"blk\.1\.ffn_(up|down|gate|gate_up)_(ch|)exps"]
    assert moe_cpu_patterns(5, cpu_moe=True) == [r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"]
    assert len(build_tensor_overrides([("a", "CPU")], n_cpu_moe=8).patterns) == 9


def test_unknown_buffer_type_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown buffer type 'CUDA0'; available: .*CPU"):
        build_tensor_overrides([("x", "CUDA0")])


EXPS = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}


@pytest.mark.parametrize("n_cpu_moe,cpu_moe,layers", [(2, False, {0, 1}), (0, True, {0, 1, 2, 3})])
def test_moe_options_move_the_moe_models_expert_tensors(n_cpu_moe, cpu_moe, layers):
    """--n-cpu-moe / --cpu-moe on the generated MoE model (qwen35moe, 4 layers): llama.cpp moves
    exactly the routed experts of those layers (not the shared expert, not the router), and the
    report INFO shows names the same tensors."""
    o = build_tensor_overrides([(r"blk\.3\.ffn_down_shexp", "CPU")], n_cpu_moe=n_cpu_moe, cpu_moe=cpu_moe)
    moved = load_with(o, "moe")
    want = {f"blk.{i}.{t}.weight" for i in layers for t in EXPS} | {"blk.3.ffn_down_shexp.weight"}
    assert set(moved) == want
    report = o.report(str(ensure_tiny_model("moe")))
    assert report[0] == {"pattern": r"blk\.3\.ffn_down_shexp", "buffer_type": "CPU", "n_tensors": 1,
                         "tensors": ["blk.3.ffn_down_shexp.weight"]}
    assert {t for r in report[1:] for t in r["tensors"]} <= want  # at most 8 names shown per pattern
    assert sum(r["n_tensors"] for r in report) == len(want)
