"""Tiny random-weight models of the fleet's other architecture kinds.

``engine.model_files`` generates llama-architecture models; the fleet runs others, and
each kind has its own rules in llama.cpp's memory:

tiny-hybrid  ``qwen35``: gated delta-net (recurrent) layers beside attention layers. A
             sequence's state is a KV part plus a recurrent part; a sequence cannot be cut
             back to a shorter prefix (``llama_memory_seq_rm`` of a partial range fails), and
             its positions cannot be shifted.
tiny-moe     ``qwen35moe``: the same hybrid layers with a routed mixture of experts (4
             experts, 2 used per token) and a shared expert: the tensors ``--n-cpu-moe``,
             ``--cpu-moe`` and ``-ot`` patterns act on (``blk.N.ffn_*_exps``).
tiny-swa     ``gemma3`` with a 16-token sliding window on every other layer: an iSWA cache
             whose window part forgets positions that left the window.
tiny-hybrid-wide  ``qwen35`` with the delta net of Qwen 3.5 35B-A3B (16 K heads and 32 V heads
             of 128, 30 recurrent layers of 40): a sequence's recurrent state, what every
             context checkpoint copies, is the fleet model's ~63 MB, on tiny weights.

The shapes follow each architecture's loader in llama.cpp (``src/models/<arch>.cpp``,
``load_arch_hparams`` / ``load_arch_tensors``); the sizes are the smallest that keep every
kernel's constraints (head sizes even for RoPE, the delta net's head_v_dim = ssm_d_state).
Generated text is gibberish by design. Files are cached like the llama ones, under a hash
of the parameters (:func:`ensure_kind_model`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .tiny_gguf import GENERATOR_VERSION, add_tiny_tokenizer, build_vocab

#: Bump whenever the bytes written for the same parameters change.
KINDS_VERSION = 1


@dataclass(frozen=True)
class KindParams:
    """A generated model of one kind. All fields go into the cache-file hash."""

    arch: str  # qwen35 | qwen35moe | gemma3
    name: str
    n_vocab: int = 512
    n_embd: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    n_ff: int = 128
    full_attention_interval: int = 2  # hybrid: every n-th layer is attention, the rest recurrent
    ssm_d_state: int = 16  # delta net: head size of its K and V heads
    ssm_n_group: int = 2  # K heads
    ssm_dt_rank: int = 4  # V heads
    ssm_d_conv: int = 4
    n_expert: int = 4
    n_expert_used: int = 2
    n_ff_exp: int = 32
    n_ff_shexp: int = 64
    sliding_window: int = 16  # gemma3: the window of its SWA layers
    swa_pattern: int = 2  # gemma3: every n-th layer has full attention
    seed: int = 1234
    context_length: int = 65536
    std: float = 0.5

    @property
    def kind(self) -> str:
        return {"qwen35": "hybrid", "qwen35moe": "moe", "gemma3": "swa"}[self.arch]

    def digest(self) -> str:
        blob = json.dumps({"generator_version": GENERATOR_VERSION, "kinds_version": KINDS_VERSION,
                           **dataclasses.asdict(self)}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


KIND_VARIANTS: dict[str, KindParams] = {
    "hybrid": KindParams(arch="qwen35", name="hydra-tiny-hybrid", seed=3535),
    "moe": KindParams(arch="qwen35moe", name="hydra-tiny-moe", seed=3536),
    "swa": KindParams(arch="gemma3", name="hydra-tiny-swa", n_layer=3, n_head_kv=1, seed=2700),
    "hybrid-wide": KindParams(arch="qwen35", name="hydra-tiny-hybrid-wide", n_layer=40, full_attention_interval=4,
                              ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=32, seed=3537),
}


def _writer_common(w: Any, p: KindParams) -> None:
    """Keys every kind shares: sizes, the SPM vocab of the llama models, the chat template."""
    import gguf

    tokens, scores, types = build_vocab(p.n_vocab)
    w.add_name(p.name)
    w.add_vocab_size(len(tokens))
    w.add_context_length(p.context_length)
    w.add_embedding_length(p.n_embd)
    w.add_block_count(p.n_layer)
    w.add_feed_forward_length(p.n_ff)
    w.add_head_count(p.n_head)
    w.add_head_count_kv(p.n_head_kv)
    w.add_key_length(p.head_dim)
    w.add_value_length(p.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    add_tiny_tokenizer(w, tokens, scores, types)


def _hybrid_layer(t: Callable[..., None], p: KindParams, i: int) -> None:
    """One qwen35/qwen35moe trunk layer without its FFN: attention (Q with its gate, Q/K
    norms) every ``full_attention_interval``-th layer, a gated delta net otherwise."""
    e, hd = p.n_embd, p.head_dim
    t(f"blk.{i}.attn_norm.weight", ones=e)
    t(f"blk.{i}.post_attention_norm.weight", ones=e)
    if (i + 1) % p.full_attention_interval == 0:
        t(f"blk.{i}.attn_q.weight", (hd * p.n_head * 2, e))
        t(f"blk.{i}.attn_k.weight", (hd * p.n_head_kv, e))
        t(f"blk.{i}.attn_v.weight", (hd * p.n_head_kv, e))
        t(f"blk.{i}.attn_output.weight", (e, hd * p.n_head))
        t(f"blk.{i}.attn_q_norm.weight", ones=hd)
        t(f"blk.{i}.attn_k_norm.weight", ones=hd)
        return
    key_dim = p.ssm_d_state * p.ssm_n_group
    value_dim = p.ssm_d_state * p.ssm_dt_rank
    t(f"blk.{i}.attn_qkv.weight", (key_dim * 2 + value_dim, e))
    t(f"blk.{i}.attn_gate.weight", (value_dim, e))
    t(f"blk.{i}.ssm_conv1d.weight", (key_dim * 2 + value_dim, p.ssm_d_conv))
    t(f"blk.{i}.ssm_dt.bias", (p.ssm_dt_rank,), std=0.1)
    # A = -exp(A_log): negative, or the state grows without bound (llama.cpp's own test rule)
    t(f"blk.{i}.ssm_a", (p.ssm_dt_rank,), negative=True)
    t(f"blk.{i}.ssm_beta.weight", (p.ssm_dt_rank, e))
    t(f"blk.{i}.ssm_alpha.weight", (p.ssm_dt_rank, e))
    t(f"blk.{i}.ssm_norm.weight", ones=p.ssm_d_state)
    t(f"blk.{i}.ssm_out.weight", (e, value_dim))


def _moe_ffn(t: Callable[..., None], p: KindParams, i: int) -> None:
    e = p.n_embd
    t(f"blk.{i}.ffn_gate_inp.weight", (p.n_expert, e))
    t(f"blk.{i}.ffn_gate_exps.weight", (p.n_expert, p.n_ff_exp, e))
    t(f"blk.{i}.ffn_up_exps.weight", (p.n_expert, p.n_ff_exp, e))
    t(f"blk.{i}.ffn_down_exps.weight", (p.n_expert, e, p.n_ff_exp))
    t(f"blk.{i}.ffn_gate_inp_shexp.weight", (e,))
    t(f"blk.{i}.ffn_gate_shexp.weight", (p.n_ff_shexp, e))
    t(f"blk.{i}.ffn_up_shexp.weight", (p.n_ff_shexp, e))
    t(f"blk.{i}.ffn_down_shexp.weight", (e, p.n_ff_shexp))


def _dense_ffn(t: Callable[..., None], p: KindParams, i: int) -> None:
    t(f"blk.{i}.ffn_gate.weight", (p.n_ff, p.n_embd))
    t(f"blk.{i}.ffn_up.weight", (p.n_ff, p.n_embd))
    t(f"blk.{i}.ffn_down.weight", (p.n_embd, p.n_ff))


def _gemma3_layer(t: Callable[..., None], p: KindParams, i: int) -> None:
    e, hd = p.n_embd, p.head_dim
    t(f"blk.{i}.attn_norm.weight", ones=e)
    t(f"blk.{i}.attn_q.weight", (hd * p.n_head, e))
    t(f"blk.{i}.attn_k.weight", (hd * p.n_head_kv, e))
    t(f"blk.{i}.attn_v.weight", (hd * p.n_head_kv, e))
    t(f"blk.{i}.attn_output.weight", (e, hd * p.n_head))
    t(f"blk.{i}.post_attention_norm.weight", ones=e)
    t(f"blk.{i}.attn_q_norm.weight", ones=hd)
    t(f"blk.{i}.attn_k_norm.weight", ones=hd)
    t(f"blk.{i}.ffn_norm.weight", ones=e)
    _dense_ffn(t, p, i)
    t(f"blk.{i}.post_ffw_norm.weight", ones=e)


def write_kind_gguf(out: str | os.PathLike[str], p: KindParams) -> Path:
    """Write the random-weight GGUF of ``p`` to ``out`` (not atomic; see :func:`ensure_kind_model`)."""
    import gguf

    w = gguf.GGUFWriter(str(out), p.arch)
    _writer_common(w, p)
    if p.arch in ("qwen35", "qwen35moe"):
        w.add_rope_dimension_count(p.head_dim)
        # interleaved M-RoPE: sections in rotary pairs, summing to head_dim / 2
        w.add_rope_dimension_sections([p.head_dim // 4, p.head_dim // 8, p.head_dim // 8, 0])
        w.add_full_attention_interval(p.full_attention_interval)
        w.add_ssm_conv_kernel(p.ssm_d_conv)
        w.add_ssm_inner_size(p.ssm_d_state * p.ssm_dt_rank)
        w.add_ssm_state_size(p.ssm_d_state)
        w.add_ssm_time_step_rank(p.ssm_dt_rank)
        w.add_ssm_group_count(p.ssm_n_group)
    if p.arch == "qwen35moe":
        w.add_expert_count(p.n_expert)
        w.add_expert_used_count(p.n_expert_used)
        w.add_expert_feed_forward_length(p.n_ff_exp)
        w.add_expert_shared_feed_forward_length(p.n_ff_shexp)
    if p.arch == "gemma3":
        w.add_sliding_window(p.sliding_window)
        w.add_sliding_window_pattern(p.swa_pattern)

    rng = np.random.default_rng(p.seed)
    n_vocab = p.n_vocab

    def t(name: str, shape: tuple[int, ...] = (), *, ones: int = 0, std: float | None = None,
          negative: bool = False) -> None:
        # numpy shape (…, rows, cols) -> ggml ne = [cols, rows, …]
        if ones:
            w.add_tensor(name, np.ones(ones, dtype=np.float32))
            return
        scale = std if std is not None else p.std / np.sqrt(shape[-1])
        a = (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(np.float32)
        w.add_tensor(name, -np.abs(a) if negative else a)

    t("token_embd.weight", (n_vocab, p.n_embd), std=1.0)
    for i in range(p.n_layer):
        if p.arch == "gemma3":
            _gemma3_layer(t, p, i)
            continue
        _hybrid_layer(t, p, i)
        (_moe_ffn if p.arch == "qwen35moe" else _dense_ffn)(t, p, i)
    t("output_norm.weight", ones=p.n_embd)
    t("output.weight", (n_vocab, p.n_embd), std=4.0 / np.sqrt(p.n_embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out)


def kind_file_name(p: KindParams) -> str:
    return f"{p.name}-f32-{p.digest()}.gguf"
