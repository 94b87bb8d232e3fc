"""engine/llama_backend on the generated tiny model (no RPC here)."""
from __future__ import annotations

import ctypes
import hashlib
import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import llama_cpp.llama_cpp as L
import pytest

from engine.llama_backend import (
    BatchItem,
    DecodeError,
    LlamaBackendError,
    LoadedModel,
    Sampler,
    SamplerParams,
    StateError,
    check_rpc_support,
    make_sampler,
)
from engine.executors import make_inference_executor
from engine.llama_backend.chat_template import ChatTemplate
from engine.llama_backend import sampler as sampler_module
from engine.llama_backend.sampler import LLAMA_DEFAULT_SEED

PROMPT = "The quick brown fox jumps over the lazy dog."
GREEDY = SamplerParams(temperature=0.0)


@pytest.fixture(scope="module")
def model(tiny_model_path: str) -> Iterator[LoadedModel]:
    m = LoadedModel(tiny_model_path, n_ctx=2048, n_seq_max=4, n_batch=512, n_threads=1)
    yield m
    m.close()


@pytest.fixture
def m(model: LoadedModel) -> LoadedModel:
    model.clear_all()
    return model


def generate(m: LoadedModel, seq: int, prompt: list[int], n: int, params: SamplerParams = GREEDY) -> list[int]:
    """Prefill ``prompt`` into ``seq`` (which must be empty) and sample ``n`` tokens."""
    s = make_sampler(params, m)
    try:
        m.decode([BatchItem(seq, prompt, 0, True)])
        return continue_seq(m, seq, len(prompt), n, s)
    finally:
        s.free()


def continue_seq(m: LoadedModel, seq: int, pos: int, n: int, s: object) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        tok = s.sample(m, seq)  # type: ignore[attr-defined]
        out.append(tok)
        m.decode([BatchItem(seq, [tok], pos, True)])
        pos += 1
    return out


def test_rpc_support_built_in() -> None:
    check_rpc_support()


def test_identity(m: LoadedModel, tiny_model_path: str) -> None:
    ident = m.identity
    assert ident["model_path"] == tiny_model_path
    assert ident["model_name"] == "hydra-tiny-a"
    assert ident["tokenizer"] == "llama/512"
    assert ident["model_quant"] == "F32"
    assert ident["model_capabilities"] == 0
    assert ident["size_bytes"] == os.path.getsize(tiny_model_path)
    assert ident["n_params"] > 100_000
    with open(tiny_model_path, "rb") as f:
        assert ident["model_hash"] == hashlib.sha256(f.read()).hexdigest()
    assert m.n_vocab == 512 and m.n_seq_max == 4 and m.n_ctx >= 2048
    assert (m.bos, m.eos) == (1, 2)
    assert m.is_eog(m.eos) and not m.is_eog(m.bos)


def test_every_tokens_end_of_generation_is_llama_cpps_asked_again_or_not(m: LoadedModel) -> None:
    import llama_cpp.llama_cpp as L

    truth = [bool(L.llama_vocab_is_eog(m._vocab, t)) for t in range(m.n_vocab)]
    assert [m.is_eog(t) for t in range(m.n_vocab)] == truth  # asked of llama.cpp, kept
    assert [m.is_eog(t) for t in range(m.n_vocab)] == truth  # read back
    assert sum(truth) >= 1 and len(m._eog) == m.n_vocab


def test_quant_name_of_small() -> None:
    from engine.model_files import ensure_tiny_model

    with LoadedModel(ensure_tiny_model("small"), n_ctx=256, n_seq_max=1, n_threads=1) as s:
        assert s.identity["model_quant"] == "Q8_0"
        assert s.identity["tokenizer"] == "llama/2048"
        assert s.identity["model_name"] == "hydra-tiny-small"


@pytest.mark.parametrize(
    "text",
    ["", "hello", " leading space", "double  space\tand tab\nnewline", "accents: éàü", "CJK 你好世界",
     "emoji 🎉🦙!", "<s> looks special"],
)
def test_tokenize_roundtrip(m: LoadedModel, text: str) -> None:
    toks = m.tokenize(text)
    assert toks[0] == m.bos
    assert m.detokenize(toks) == text.encode()
    assert b"".join(m.token_to_piece(t) for t in toks) == text.encode()
    assert m.tokenize(text.encode(), add_special=False) == toks[1:]


def test_pieces_are_raw_bytes(m: LoadedModel) -> None:
    toks = m.tokenize("🎉", add_special=False)
    pieces = [m.token_to_piece(t) for t in toks]
    assert len(pieces) == 4  # byte fallback: one token per UTF-8 byte
    with pytest.raises(UnicodeDecodeError):
        pieces[0].decode("utf-8")
    assert b"".join(pieces) == "🎉".encode()


def test_special_tokens(m: LoadedModel) -> None:
    toks = m.tokenize("<s>x</s>", add_special=False, parse_special=True)
    assert toks[0] == 1 and toks[-1] == 2
    assert m.token_to_piece(2) == b""
    assert m.token_to_piece(2, special=True) == b"</s>"
    assert m.detokenize(toks, special=True) == b"<s>x</s>"


def test_chat_template(m: LoadedModel) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert m.chat_format == "jinja"
    assert m.apply_chat_template(msgs) == "system: be brief\nuser: hi\nassistant: "
    assert m.apply_chat_template(msgs, add_generation_prompt=False) == "system: be brief\nuser: hi\n"
    toks = m.chat_tokens(msgs)
    assert toks[0] == m.bos and toks[1] != m.bos


def test_chat_fallbacks() -> None:
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": "yo"}]
    chatml = ChatTemplate(None, "llama")  # a GGUF without a template: llama-server's ChatML
    assert chatml.format == "chatml"
    assert chatml.render(msgs, True, bos_token="", eos_token="") == (
        "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
        "<|im_start|>assistant\n")
    gemma = ChatTemplate(None, "gemma3")
    assert gemma.format == "gemma"
    assert gemma.render(msgs, True, bos_token="", eos_token="") == (
        "<start_of_turn>user\nsys\n\nhi<end_of_turn>\n<start_of_turn>model\nyo<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def test_greedy_deterministic(m: LoadedModel) -> None:
    prompt = m.tokenize(PROMPT)
    a = generate(m, 0, prompt, 24)
    m.seq_clear(0)
    assert m.seq_pos_max(0) == -1
    b = generate(m, 0, prompt, 24)
    assert a == b
    assert m.seq_pos_max(0) == len(prompt) + 24 - 1
    c = generate(m, 2, prompt, 24)  # another slot, same result
    assert c == a


def test_greedy_reads_the_argmax_and_picks_what_the_llama_chain_picks(m: LoadedModel, monkeypatch) -> None:
    """Plain greedy sampling skips llama.cpp's candidate copy of the whole vocabulary; the
    tokens are the chain's, step for step, and anything that changes a logit keeps the chain."""
    assert make_sampler(GREEDY, m).argmax_only
    for other in (SamplerParams(temperature=0.0, penalty_repeat=1.3), SamplerParams(temperature=0.7),
                  SamplerParams(temperature=0.0, logit_bias=((5, 2.0),))):
        assert not make_sampler(other, m).argmax_only
    prompt = m.tokenize(PROMPT)
    calls: list[int] = []
    chain_sample = L.llama_sampler_sample
    monkeypatch.setattr(L, "llama_sampler_sample", lambda *a: calls.append(1) or chain_sample(*a))
    fast = generate(m, 0, prompt, 48)
    assert calls == []
    monkeypatch.setattr(Sampler, "argmax_only", property(lambda self: False))
    m.seq_clear(0)
    assert generate(m, 0, prompt, 48) == fast and len(calls) == 48


def test_batched_equals_single(m: LoadedModel) -> None:
    p0 = m.tokenize(PROMPT)
    p1 = m.tokenize("Pack my box with five dozen liquor jugs, please")
    n = 20
    alone0 = generate(m, 0, p0, n)
    m.clear_all()
    alone1 = generate(m, 1, p1, n)
    m.clear_all()

    s0, s1 = make_sampler(GREEDY, m), make_sampler(GREEDY, m)
    m.decode([BatchItem(0, p0, 0, True), BatchItem(1, p1, 0, True)])  # both prompts in one batch
    pos0, pos1 = len(p0), len(p1)
    got0: list[int] = []
    got1: list[int] = []
    for _ in range(n):
        t0, t1 = s0.sample(m, 0), s1.sample(m, 1)
        got0.append(t0)
        got1.append(t1)
        m.decode([BatchItem(1, [t1], pos1, True), BatchItem(0, [t0], pos0, True)])  # order must not matter
        pos0 += 1
        pos1 += 1
    assert got0 == alone0
    assert got1 == alone1


def test_prefill_joins_running_decode(m: LoadedModel) -> None:
    """Continuous batching: a new sequence's prompt shares a batch with another's decode step."""
    p0 = m.tokenize(PROMPT)
    p3 = m.tokenize("a late arrival")
    ref3 = generate(m, 3, p3, 8)
    m.clear_all()
    ref0 = generate(m, 0, p0, 16)
    m.clear_all()

    s0, s3 = make_sampler(GREEDY, m), make_sampler(GREEDY, m)
    m.decode([BatchItem(0, p0, 0)])
    pos0 = len(p0)
    out0: list[int] = []
    out3: list[int] = []
    pos3 = 0
    for step in range(16):
        t0 = s0.sample(m, 0)
        out0.append(t0)
        items = [BatchItem(0, [t0], pos0)]
        if step == 4:  # the late prompt, in two chunks, the first without logits
            items.append(BatchItem(3, p3[:3], 0, logits_last=False))
        elif step == 5:
            items.append(BatchItem(3, p3[3:], 3))
            pos3 = len(p3)
        elif step > 5 and len(out3) < 8:
            t3 = s3.sample(m, 3)
            out3.append(t3)
            items.append(BatchItem(3, [t3], pos3))
            pos3 += 1
        m.decode(items)
        if step == 4:
            assert not m.has_logits(3)
        pos0 += 1
    assert out0 == ref0
    assert out3 == ref3[: len(out3)] and len(out3) >= 7


def test_four_sequences_batched(m: LoadedModel) -> None:
    prompts = [m.tokenize(f"sequence number {i} says hello") for i in range(4)]
    refs = []
    for i, p in enumerate(prompts):
        m.clear_all()
        refs.append(generate(m, i, p, 10))
    m.clear_all()
    samplers = [make_sampler(GREEDY, m) for _ in prompts]
    m.decode([BatchItem(i, p, 0) for i, p in enumerate(prompts)])
    pos = [len(p) for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    for _ in range(10):
        items = []
        for i in range(4):
            t = samplers[i].sample(m, i)
            outs[i].append(t)
            items.append(BatchItem(i, [t], pos[i]))
            pos[i] += 1
        m.decode(items)
    assert outs == refs


def test_state_moves_to_another_seq(m: LoadedModel) -> None:
    prompt = m.tokenize(PROMPT)
    s = make_sampler(GREEDY, m)
    m.decode([BatchItem(0, prompt, 0)])
    head = continue_seq(m, 0, len(prompt), 6, s)
    # the sequence now holds prompt + 6 tokens and has logits for the 7th
    pos = len(prompt) + 6
    snap = m.state_seq_get(0)
    assert m.state_seq_size(0) == len(snap) > 0
    reference = continue_seq(m, 0, pos, 12, s)

    m.seq_clear(0)
    assert m.seq_pos_max(0) == -1
    n = m.state_seq_set(2, snap)
    assert n == len(snap)
    assert m.seq_pos_max(2) == pos - 1
    # restored state has no logits: feed the last sampled token again, as a client would
    m.seq_rm(2, pos - 1, -1)
    m.decode([BatchItem(2, [head[-1]], pos - 1)])
    s2 = make_sampler(GREEDY, m)
    assert continue_seq(m, 2, pos, 12, s2) == reference


def test_state_errors(m: LoadedModel) -> None:
    m.decode([BatchItem(1, m.tokenize("abc"), 0)])
    with pytest.raises(StateError):
        m.state_seq_set(1, b"definitely not a llama state")
    assert m.seq_pos_max(1) == -1  # cleared even on failure
    assert m.state_seq_set(1, b"") == 0


def test_seq_copy(m: LoadedModel) -> None:
    prompt = m.tokenize(PROMPT)
    m.decode([BatchItem(0, prompt, 0)])
    m.seq_copy(0, 3)
    assert m.seq_pos_max(3) == m.seq_pos_max(0) == len(prompt) - 1
    m.seq_rm(3, len(prompt) - 1, -1)
    m.decode([BatchItem(3, prompt[-1:], len(prompt) - 1)])
    s0 = make_sampler(GREEDY, m)
    a = continue_seq(m, 3, len(prompt), 8, s0)
    m.clear_all()
    assert a == generate(m, 0, prompt, 8)


def test_seeded_sampler_reproducible(m: LoadedModel) -> None:
    prompt = m.tokenize(PROMPT)
    hot = SamplerParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    a = generate(m, 0, prompt, 24, hot)
    m.clear_all()
    b = generate(m, 0, prompt, 24, hot)
    m.clear_all()
    c = generate(m, 0, prompt, 24, SamplerParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=43))
    m.clear_all()
    g = generate(m, 0, prompt, 24)
    assert a == b
    assert a != c
    assert a != g


def test_an_unseeded_sampler_gets_a_seed_of_its_own_a_seeded_one_keeps_its_own(monkeypatch) -> None:
    """Without a seed (or with -1) the seed is drawn in Python, not by llama.cpp's
    std::random_device (22 µs a request on the first token's path): still one per sampler."""
    monkeypatch.setattr(sampler_module, "_SEEDS", random.Random(7))
    expected = random.Random(7)
    seeds = []
    for asked in (None, -1, None, 0xFFFFFFFF, 42):
        s = make_sampler(SamplerParams(temperature=0.8, seed=asked))
        seeds.append(L.llama_sampler_get_seed(s.handle))
        s.free()
    *drawn, kept = seeds
    assert kept == 42
    assert drawn == [expected.getrandbits(32) for _ in range(4)]
    assert len(set(drawn)) == 4 and LLAMA_DEFAULT_SEED not in drawn


def address(chain: object) -> int:
    return ctypes.cast(chain, ctypes.c_void_p).value  # type: ignore[arg-type]


def sampled_with_spares(m: LoadedModel, prompt: list[int], params: SamplerParams, n: int) -> tuple[list[int], object]:
    """``n`` tokens from a sampler the model makes (its spare chains in play), freed after;
    returns them and the chain the sampler used."""
    m.clear_all()
    s = m.make_sampler(params)
    try:
        m.decode([BatchItem(0, prompt, 0, True)])
        return continue_seq(m, 0, len(prompt), n, s), address(s.handle)
    finally:
        s.free()


def test_a_plain_chain_is_kept_for_the_next_job_and_a_seeded_one_samples_as_new(m: LoadedModel) -> None:
    """A chain that keeps nothing of its job (no penalties, grammar or bias) is taken again by
    the next job with the same parameters instead of built (~15 µs on the first token's path).
    With a fixed seed the kept chain is seeded again: the tokens are a new chain's; without one
    its generator goes on (a second run differs, as with a new random seed)."""
    prompt = m.tokenize(PROMPT)
    seeded = SamplerParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    fresh = generate(m, 0, prompt, 24, seeded)  # make_sampler without the model's spares
    a, chain_a = sampled_with_spares(m, prompt, seeded, 24)
    b, chain_b = sampled_with_spares(m, prompt, seeded, 24)
    assert chain_b == chain_a and a == b == fresh
    hot = SamplerParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    c, chain_c = sampled_with_spares(m, prompt, hot, 24)
    d, chain_d = sampled_with_spares(m, prompt, hot, 24)
    assert chain_d == chain_c != chain_a and c != d
    for unkept in (SamplerParams(temperature=0.0, penalty_repeat=1.3), SamplerParams(logit_bias=((5, 2.0),))):
        _, first = sampled_with_spares(m, prompt, unkept, 2)
        assert first not in {chain_a, chain_c} and len(m.spare_chains) == 2  # freed, not kept


def test_spare_chains_are_bounded_and_freed_with_their_model(tiny_model_path: str, monkeypatch) -> None:
    freed: list[object] = []
    real_free = L.llama_sampler_free
    monkeypatch.setattr(L, "llama_sampler_free", lambda chain: freed.append(address(chain)) or real_free(chain))
    m = LoadedModel(tiny_model_path, n_ctx=256, n_seq_max=1, n_threads=1)
    samplers = [m.make_sampler(SamplerParams(seed=i)) for i in range(sampler_module.SpareChains.LIMIT + 3)]
    chains = [address(s.handle) for s in samplers]
    for s in samplers:
        s.free()
    assert len(m.spare_chains) == sampler_module.SpareChains.LIMIT and freed == chains[-3:]
    late = m.make_sampler(SamplerParams(seed=0))  # taken from the spares
    m.close()
    assert len(m.spare_chains) == 0 and sorted(freed) == sorted(chains[1:])
    late.free()  # after the model: freed, not kept
    assert sorted(freed) == sorted(chains)


def test_penalties_sampler(m: LoadedModel) -> None:
    prompt = m.tokenize(PROMPT)
    plain = generate(m, 0, prompt, 32)
    m.clear_all()
    pen = generate(m, 0, prompt, 32, SamplerParams(temperature=0.0, penalty_repeat=1.5, penalty_last_n=64))
    assert len(set(plain)) < 32  # random weights: greedy falls into a loop...
    assert len(set(pen)) > len(set(plain))  # ...that the repetition penalty breaks
    with pytest.raises(ValueError, match="vocabulary size"):
        make_sampler(SamplerParams(penalty_repeat=1.3))


def test_logits_and_logprob(m: LoadedModel) -> None:
    prompt = m.tokenize(PROMPT)
    m.decode([BatchItem(0, prompt, 0)])
    row = m.logits(0, copy=True)
    assert row.dtype == np.float32 and row.shape == (m.n_vocab,)
    s = make_sampler(GREEDY, m)
    tok, lp = s.sample(m, 0, want_logprob=True)
    assert tok == int(np.argmax(row))
    ref = float(row[tok] - (row.max() + np.log(np.exp(row.astype(np.float64) - row.max()).sum())))
    assert lp == pytest.approx(ref, abs=1e-4)
    assert lp <= 0.0
    assert m.token_logprob(0, tok) == pytest.approx(lp)
    np.testing.assert_array_equal(m.logits(0), row)  # sampling did not touch the raw logits
    tok2, lp2 = m.sample(0, s, want_logprob=True)
    assert tok2 == tok and lp2 == pytest.approx(lp)


def test_a_logits_row_is_read_through_one_view_while_its_place_holds(m: LoadedModel) -> None:
    """The view of a logits row is made once for its address (made after every decode, it cost a
    Gemma token's sampling ~16 µs), reads each decode's logits, and the views kept stay bounded."""
    prompts = [m.tokenize(f"row {i} of the batch") for i in range(4)]
    m.decode([BatchItem(i, p, 0) for i, p in enumerate(prompts)])
    views = [m.logits(i) for i in range(4)]
    assert len({id(v) for v in views}) == 4
    pos = [len(p) for p in prompts]
    nxt = [int(np.argmax(v)) for v in views]
    for step in range(6):
        live = range(4) if step % 2 else range(step % 4, 4)  # batches of other sizes and rows
        m.decode([BatchItem(i, [nxt[i]], pos[i]) for i in live])
        for i in live:
            pos[i] += 1
            ptr = L.llama_get_logits_ith(m._ctx_handle(), m._logit_idx[i])
            fresh = np.ctypeslib.as_array(ptr, shape=(m.n_vocab,))
            np.testing.assert_array_equal(m.logits(i), fresh)
            nxt[i] = int(np.argmax(m.logits(i)))
    assert all(m.logits(i) is views[i] for i in range(4))  # the last batch's rows are the first's
    assert len(m._rows) <= 4 * m.n_seq_max


def test_no_logits_errors(m: LoadedModel) -> None:
    m.decode([BatchItem(0, m.tokenize("abc"), 0, logits_last=False)])
    with pytest.raises(LlamaBackendError, match="no logits for seq 0"):
        m.logits(0)
    with pytest.raises(LlamaBackendError):
        make_sampler(GREEDY, m).sample(m, 0)


def test_decode_validation(m: LoadedModel) -> None:
    m.decode([])  # no-op
    with pytest.raises(ValueError, match="out of range"):
        m.decode([BatchItem(4, [1], 0)])
    with pytest.raises(ValueError, match="twice"):
        m.decode([BatchItem(0, [1], 0), BatchItem(0, [2], 1)])
    with pytest.raises(ValueError, match="empty"):
        m.decode([BatchItem(0, [], 0)])
    with pytest.raises(ValueError, match="n_batch"):
        m.decode([BatchItem(0, [5] * (m.n_batch + 1), 0)])
    m.decode([BatchItem(0, [5, 6, 7], 0)])
    with pytest.raises(DecodeError) as ei:
        m.decode([BatchItem(0, [8], 10)])  # gap in positions
    assert ei.value.code == -1
    assert "consecutive" in str(ei.value) or "position" in str(ei.value)
    assert m.seq_pos_max(0) == 2  # the failed batch left the cache alone


def test_context_full(tiny_model_path: str) -> None:
    with LoadedModel(tiny_model_path, n_ctx=512, n_seq_max=2, n_batch=512, n_threads=1) as x:
        x.decode([BatchItem(0, [5] * 400, 0)])
        # unified KV: one sequence may use most of the context...
        assert x.seq_pos_max(0) == 399
        with pytest.raises(DecodeError) as ei:
            x.decode([BatchItem(1, [6] * 200, 0)])  # ...but the total must fit
        assert ei.value.code == 1
        x.decode([BatchItem(1, [6] * 100, 0)])
        assert x.seq_pos_max(1) == 99


def test_close_idempotent(tiny_model_path: str) -> None:
    x = LoadedModel(tiny_model_path, n_ctx=256, n_seq_max=1, n_threads=1)
    x.close()
    x.close()
    assert x.closed
    for call in (lambda: x.decode([BatchItem(0, [1], 0)]), lambda: x.tokenize("a"), lambda: x.seq_pos_max(0),
                 lambda: x.state_seq_get(0)):
        with pytest.raises(LlamaBackendError, match="closed"):
            call()


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        LoadedModel(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(LlamaBackendError, match="failed to load"):
        LoadedModel(bad)


def test_extra_params_validated(tiny_model_path: str) -> None:
    with pytest.raises(ValueError, match="unknown llama_context_params"):
        LoadedModel(tiny_model_path, extra_ctx_params={"no_such_field": 1})
    with pytest.raises(ValueError, match="unknown llama_model_params"):
        LoadedModel(tiny_model_path, extra_model_params={"no_such_field": 1})
    f32_kv = {"type_k": 0, "type_v": 0}
    with LoadedModel(tiny_model_path, n_ctx=256, n_seq_max=1, n_threads=1, extra_ctx_params=f32_kv) as x:
        x.decode([BatchItem(0, x.tokenize("hi"), 0)])  # f32 KV cache works too


def test_inference_executor_low_priority(tiny_model_path: str) -> None:
    ex = make_inference_executor(low_priority=True)
    try:
        nice, name = ex.submit(lambda: (os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
                                        threading.current_thread().name)).result()
        assert nice == 19
        assert name.startswith("hydra-inference")
        # the whole model lifecycle on that one thread
        x = ex.submit(LoadedModel, tiny_model_path, n_ctx=256, n_seq_max=1, n_threads=1).result()
        ex.submit(x.decode, [BatchItem(0, [1, 5, 6], 0)]).result()
        assert ex.submit(x.seq_pos_max, 0).result() == 2
        ex.submit(x.close).result()
    finally:
        ex.shutdown()
    ex2 = make_inference_executor(low_priority=False)
    try:
        main_nice = os.getpriority(os.PRIO_PROCESS, 0)
        assert ex2.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result() == main_nice
    finally:
        ex2.shutdown()



def test_load_reports_progress_and_threads_change_between_decodes(tiny_model_path: str) -> None:
    shares: list[float] = []
    m = LoadedModel(tiny_model_path, n_ctx=256, n_seq_max=1, n_threads=2, progress=shares.append)
    try:
        assert shares and shares[-1] == 1.0 and shares == sorted(shares)  # llama.cpp's callback, to the end
        m.decode([BatchItem(0, [1, 5, 6], 0)])
        two = m.logits(0).copy()
        m.seq_clear(0)
        m.set_threads(1)
        m.decode([BatchItem(0, [1, 5, 6], 0)])
        assert np.allclose(m.logits(0), two, atol=1e-4)  # fewer threads, same result
        m.set_threads(5)  # capped at the context's own count
        assert m._threads_now == 2
    finally:
        m.close()


def test_a_batch_holds_its_sequences_in_ascending_order() -> None:
    """llama.cpp views a ubatch's KV streams as one range: sequences out of order would split a
    step into several passes over the weights (engine/llama_backend/batch.py)."""
    from engine.llama_backend.batch import LlamaBatch

    batch = LlamaBatch(16, 4)
    try:
        out = batch.fill([BatchItem(3, [5], 7), BatchItem(1, [6, 9], 2), BatchItem(0, [8], 4)])
        assert list(batch._tok[:4]) == [8, 6, 9, 5] and list(batch._pos[:4]) == [4, 2, 3, 7]
        assert batch._row_seq[:4] == [0, 1, 1, 3]
        assert out == {0: 0, 1: 2, 3: 3}  # each sequence's logits row follows it
    finally:
        batch.free()


def test_logits_do_not_depend_on_the_order_items_are_given(m: LoadedModel) -> None:
    prompts = {s: m.tokenize(f"sequence {s} says") for s in range(3)}

    def last_logits(order: list[int]) -> dict[int, np.ndarray]:
        m.clear_all()
        m.decode([BatchItem(s, prompts[s], 0) for s in order])
        return {s: m.logits(s, copy=True) for s in order}

    a, b = last_logits([0, 1, 2]), last_logits([2, 0, 1])
    for s in range(3):
        np.testing.assert_allclose(a[s], b[s], rtol=1e-4, atol=1e-4)


def test_the_chat_template_is_compiled_and_rendered_once_at_load(model: LoadedModel):
    """As llama-server renders its example at start-up: the model's first chat pays no compile."""
    assert model.chat.format == "jinja" and model.chat._compiled is not None


def test_a_template_that_refuses_the_example_conversation_still_loads_and_serves(tiny_model_path: str):
    strict = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
              "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
              "{% if add_generation_prompt %}<assistant>{% endif %}")
    m = LoadedModel(tiny_model_path, n_ctx=256, n_seq_max=1, n_batch=64, n_threads=1, chat_template=strict)
    try:
        assert m.render_chat([{"role": "user", "content": "hi"}]) == "<user>hi<assistant>"
    finally:
        m.close()


def test_a_tokens_text_is_asked_of_llama_cpp_once_up_to_the_bound(tiny_model_path: str, monkeypatch) -> None:
    from engine.llama_backend import model_text

    monkeypatch.setattr(model_text, "PIECES_KEPT", 5)
    m = LoadedModel(tiny_model_path, n_ctx=256, n_seq_max=1, n_threads=1)
    try:
        asked: list[int] = []
        real = L.llama_token_to_piece
        monkeypatch.setattr(L, "llama_token_to_piece", lambda voc, tok, *rest: asked.append(tok) or real(voc, tok, *rest))
        ids = list(range(10))
        first = [m.token_to_piece(t) for t in ids]
        again = [m.token_to_piece(t) for t in ids]
        assert first == again == [m.detokenize([t]) for t in ids]
        assert asked == ids + ids[5:]  # the first five kept, the others asked each time
        assert m.token_to_piece(1, special=True) == m.token_pieces()[1]  # special text is not the cache's
    finally:
        m.close()


def test_llama_cpps_lines_reach_the_engine_logger_whole_and_only_when_it_is_at_debug() -> None:
    """llama.cpp writes a line in pieces (a piece of level CONT goes on the one before): the
    logger gets whole lines, one record each, and none unless it is at DEBUG."""
    import logging

    from engine.llama_backend import runtime

    got: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: got.append(record.getMessage())  # type: ignore[method-assign]
    log, level = runtime.llama_log, runtime.llama_log.level
    log.addHandler(handler)
    try:
        log.setLevel(logging.INFO)
        runtime._log_cb_impl(2, b"print_info: quiet\n", None)
        assert got == []
        log.setLevel(logging.DEBUG)
        runtime._log_cb_impl(2, b"print_info: n_vocab = ", None)
        runtime._log_cb_impl(5, b"512\nload_tensors: \x1b[31m", None)
        runtime._log_cb_impl(5, b"done\n", None)
        runtime._log_cb_impl(2, b"..", None)  # the load's progress dots, no newline
        runtime._log_cb_impl(1, b"repack: a tensor\n", None)
        assert got == ["print_info: n_vocab = 512", "load_tensors: \x1b[31mdone",  # the formatter escapes it
                       "..", "repack: a tensor"]
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
