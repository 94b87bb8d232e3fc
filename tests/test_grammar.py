"""Grammar-constrained sampling, logit bias, top logprobs and the grammar check, on the tiny model."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator

import pytest

from engine.llama_backend import BatchItem, LoadedModel, make_sampler
from engine.llama_backend.grammar_sampler import MAX_GRAMMAR_BYTES, check_grammar, check_grammar_spec
from engine.sampling import GrammarSpec, SamplerParams

PROMPT = "The quick brown fox jumps over the lazy dog."
YES_NO = GrammarSpec('root ::= "yes" | "no"')


@pytest.fixture(scope="module")
def model(tiny_model_path: str) -> Iterator[LoadedModel]:
    m = LoadedModel(tiny_model_path, n_ctx=2048, n_seq_max=2, n_batch=512, n_threads=1)
    yield m
    m.close()


@pytest.fixture
def m(model: LoadedModel) -> LoadedModel:
    model.clear_all()
    return model


def run(m: LoadedModel, params: SamplerParams, n: int = 64, prompt: str = PROMPT) -> tuple[bytes, bool]:
    """Generate up to ``n`` tokens; (text, ended with an end-of-generation token)."""
    m.clear_all()
    toks = m.tokenize(prompt)
    s = make_sampler(params, m)
    try:
        m.decode([BatchItem(0, toks, 0, True)])
        pos, out = len(toks), []
        for _ in range(n):
            tok = s.sample(m, 0)
            if m.is_eog(tok):
                return m.detokenize(out), True
            out.append(tok)
            m.decode([BatchItem(0, [tok], pos, True)])
            pos += 1
        return m.detokenize(out), False
    finally:
        s.free()


PARAMS = [SamplerParams(temperature=0.0)] + [SamplerParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=s)
                                              for s in (1, 2, 3)]


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"t{p.temperature}-s{p.seed}")
def test_yes_no(m: LoadedModel, params: SamplerParams) -> None:
    text, eog = run(m, SamplerParams(**{**params.__dict__, "grammar": YES_NO}))
    assert eog and text in (b"yes", b"no")


def test_without_grammar_the_model_says_other_things(m: LoadedModel) -> None:
    text, _ = run(m, SamplerParams(temperature=0.0), n=8)
    assert text not in (b"yes", b"no")


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    "ok": {"type": "boolean"}}, "required": ["name", "age"]}


def check_schema_by_hand(v: object) -> None:
    assert isinstance(v, dict) and set(v) <= set(SCHEMA["properties"])
    assert isinstance(v["name"], str) and len(v["name"]) <= 12
    assert isinstance(v["age"], int) and not isinstance(v["age"], bool)
    assert all(isinstance(t, str) and len(t) <= 5 for t in v.get("tags", [])) and len(v.get("tags", [])) <= 3
    assert isinstance(v.get("ok", True), bool)


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"t{p.temperature}-s{p.seed}")
def test_json_schema(m: LoadedModel, params: SamplerParams) -> None:
    from engine.chat.grammar import schema_to_gbnf

    spec = GrammarSpec(schema_to_gbnf(SCHEMA))
    text, eog = run(m, SamplerParams(**{**params.__dict__, "grammar": spec, "temperature": min(params.temperature, 0.7)}),
                    n=400)
    assert eog, text
    check_schema_by_hand(json.loads(text))


EXHAUST = r"""
import sys
from engine.llama_backend import BatchItem, LoadedModel, make_sampler
from engine.sampling import GrammarExhausted, GrammarSpec, SamplerParams
m = LoadedModel(sys.argv[1], n_ctx=256, n_seq_max=1, n_threads=1)
toks = m.tokenize("hello")
m.decode([BatchItem(0, toks, 0, True)])
s = make_sampler(SamplerParams(temperature=0.0, grammar=GrammarSpec('root ::= "a" [\\x00]')), m)
tok = s.sample(m, 0)
m.decode([BatchItem(0, [tok], len(toks), True)])
try:
    s.sample(m, 0)
except GrammarExhausted as e:
    print("EXHAUSTED", m.detokenize([tok]).decode(), e)
s.free(); m.close()
"""


def test_unspellable_grammar_raises_instead_of_aborting(tiny_model_path: str) -> None:
    # the vocabulary has a byte token for NUL, but llama.cpp's grammar refuses every piece
    # starting with a NUL byte: after "a" no token is allowed
    p = subprocess.run([sys.executable, "-c", EXHAUST, tiny_model_path], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("EXHAUSTED a"), p.stdout


def test_logit_bias_bans_a_token(m: LoadedModel) -> None:
    toks = m.tokenize(PROMPT)
    m.decode([BatchItem(0, toks, 0, True)])
    s = make_sampler(SamplerParams(temperature=0.0), m)
    want = s.sample(m, 0)
    s.free()
    banned = make_sampler(SamplerParams(temperature=0.0, logit_bias=((want, -math.inf),)), m)
    assert banned.sample(m, 0) != want
    banned.free()
    boosted = make_sampler(SamplerParams(temperature=0.0, logit_bias=((7, 1000.0),)), m)
    assert boosted.sample(m, 0) == 7
    boosted.free()
    # with a grammar too: ban "y", the answer must be "no"
    bias = tuple((t, -math.inf) for t in range(m.n_vocab) if m.token_to_piece(t).lstrip(b" ").startswith(b"y"))
    assert bias
    for p in PARAMS:
        text, eog = run(m, SamplerParams(**{**p.__dict__, "grammar": YES_NO, "logit_bias": bias}))
        assert eog and text == b"no"


def test_logit_bias_out_of_range(m: LoadedModel) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        make_sampler(SamplerParams(logit_bias=((m.n_vocab, 1.0),)), m)


def test_top_logprobs(m: LoadedModel) -> None:
    toks = m.tokenize(PROMPT)
    m.decode([BatchItem(0, toks, 0, True)])
    top = m.top_logprobs(0, 10)
    assert len(top) == 10
    lps = [lp for _, lp in top]
    assert lps == sorted(lps, reverse=True) and all(lp <= 0.0 for lp in lps)
    full = m.top_logprobs(0, m.n_vocab)
    assert math.isclose(sum(math.exp(lp) for _, lp in full), 1.0, rel_tol=1e-4)
    assert full[:10] == top
    s = make_sampler(SamplerParams(temperature=0.0), m)
    tok, lp = s.sample(m, 0, True)
    s.free()
    assert tok == top[0][0] and math.isclose(lp, top[0][1], rel_tol=1e-5)


@pytest.mark.parametrize("text", ['root ::= "yes" | "no"', 'root ::= item+\nitem ::= [a-z] | "(" item ")"  # c',
                                  'root ::= ' + "(" * 64 + '"a"' + ")" * 64])
def test_check_grammar_accepts(text: str) -> None:
    check_grammar(text)


@pytest.mark.parametrize("text,why", [
    ('root ::= "yes', "unexpected end"), ("root ::= other", "Undefined rule"), ('x ::= "a"', "root"),
    ("", "empty"), ("root ::= " + "(" * 65 + '"a"' + ")" * 65, "deeper"),
    ("root ::= " + '"a" ' * (MAX_GRAMMAR_BYTES // 4), "bytes"), ("root ::= root", "recursion"),
])
def test_check_grammar_rejects(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        check_grammar(text)


def test_check_grammar_spec_rejects_bad_trigger() -> None:
    with pytest.raises(ValueError, match="trigger"):
        check_grammar_spec(GrammarSpec('root ::= "a"', lazy=True, trigger_patterns=("(",)))
    with pytest.raises(ValueError, match="trigger"):
        check_grammar_spec(GrammarSpec('root ::= "a"', lazy=True))


def test_lazy_grammar_waits_for_its_trigger(m: LoadedModel) -> None:
    import llama_cpp.llama_cpp as L

    spec = GrammarSpec('root ::= "<go>" [0-9] [0-9]', lazy=True, trigger_patterns=(r"[\s\S]*?(<go>)[\s\S]*",))
    text, _ = run(m, SamplerParams(temperature=0.0, grammar=spec), n=12)
    assert b"<go>" not in text  # never triggered: unconstrained, as without a grammar
    assert text == run(m, SamplerParams(temperature=0.0), n=12)[0]
    # the model "chooses" the trigger (fed by hand), then the grammar takes over
    m.clear_all()
    toks = m.tokenize(PROMPT)
    s = make_sampler(SamplerParams(temperature=0.0, grammar=spec), m)
    m.decode([BatchItem(0, toks, 0, True)])
    pos, out = len(toks), []
    forced = m.tokenize("<go>", add_special=False)
    for _ in range(10):
        if forced:
            tok = forced.pop(0)
            assert s.grammar is not None and s.grammar.allows(tok)
            s.grammar.accept(tok)
            L.llama_sampler_accept(s.handle, tok)
        else:
            tok = s.sample(m, 0)
        if m.is_eog(tok):
            break
        out.append(tok)
        m.decode([BatchItem(0, [tok], pos, True)])
        pos += 1
    s.free()
    text = m.detokenize(out)
    assert text.startswith(b"<go>") and len(text) == 6 and text[4:].isdigit(), text


def test_greedy_under_a_lazy_grammar_passes_a_token_whose_trigger_text_breaks_it(m: LoadedModel) -> None:
    """Before its trigger a lazy grammar refuses only a token that fires the trigger with text
    the grammar cannot take: greedy then takes the next most likely token, as the full
    candidate path does."""
    import dataclasses
    import re

    import numpy as np

    toks = m.tokenize(PROMPT)
    m.decode([BatchItem(0, toks, 0, True)])
    row = np.array(m.logits(0), dtype=np.float32)
    first, second = (int(t) for t in np.argsort(row)[::-1][:2])
    piece = m.token_to_piece(first)
    assert piece.strip() and piece not in m.token_to_piece(second), (piece, m.token_to_piece(second))
    trigger = r"[\s\S]*?(" + re.escape(piece.decode("utf-8")) + r")[\s\S]*"
    for params in (SamplerParams(temperature=0.0), SamplerParams(temperature=0.0, penalty_repeat=1.1)):  # numpy's argmax, the chain
        spec = GrammarSpec('root ::= "qqqq"', lazy=True, trigger_patterns=(trigger,))
        s = make_sampler(dataclasses.replace(params, grammar=spec), m)
        try:
            assert s.sample(m, 0) == second
        finally:
            s.free()


def _start_as_searched(pattern: str, buf: bytes) -> int | None:
    """llama.cpp's rule, on the pattern as written: where an unanchored one matches in the
    window (or an anchored one the whole text), its first non-empty group, else the match."""
    import re

    from engine.llama_backend.grammar_sampler import TRIGGER_WINDOW

    rx = re.compile(pattern.encode())
    if pattern.startswith("^") and pattern.endswith("$"):
        m = rx.fullmatch(buf)
    else:
        m = rx.search(buf, max(0, len(buf) - TRIGGER_WINDOW))
    if m is None:
        return None
    starts = [m.start(g) for g in range(1, rx.groups + 1) if m.start(g) >= 0 and m.end(g) > m.start(g)]
    return starts[0] if starts else m.start(0)


TRIGGERS = [r"[\s\S]*?(<tool_call>)[\s\S]*", r"[\s\S]*?<tool_call>", r"[\S\s]*?(x)?(<tool_call>)",
            r"</think>[\s\S]*?(<tool_call>)[\s\S]*", r'^\s*(\{\s*"name")[\s\S]*$', r"^[\s\S]*?</think>\s*(<tool_call>)[\s\S]*$",
            r"[\s\S]*?", r"[\s\S]*?(\[TOOL_CALLS\]|<tool_call>)", r"[\s\S]*?\[TOOL_CALLS\]|<tool_call>",
            r"[\s\S]*?[|(]x|<tool_call>"]


@pytest.mark.parametrize("pattern", TRIGGERS)
def test_a_trigger_fires_where_the_pattern_as_written_fires(pattern: str) -> None:
    """A leading lazy any-text run is taken off a trigger before it is searched (searched with
    it, each token's search was quadratic in the text: ~100 ms on 4 KB); where the grammar's
    text starts stays what the pattern as written gives, on texts with and without the opener,
    past the search window too."""
    import random

    from engine.llama_backend.grammar_sampler import TRIGGER_WINDOW, compile_triggers, trigger_start

    (trigger,) = compile_triggers(GrammarSpec("root ::= \"a\"", "root", True, (pattern,)))
    rng = random.Random(7)
    words = [b"x", b" ", b"\n", b"<tool_call>", b"</think>", b'{"name"', b"[TOOL_CALLS]", b"text ", b"<tool"]
    texts = [b"", b"<tool_call>", b"x" * (TRIGGER_WINDOW + 50) + b"<tool_call>", b"<tool_call>" + b"x" * TRIGGER_WINDOW]
    texts += [b"".join(rng.choice(words) for _ in range(rng.randrange(1, 40))) for _ in range(300)]
    for text in texts:
        assert trigger_start(trigger, text) == _start_as_searched(pattern, text), text


def test_the_tool_formats_triggers_are_searched_without_their_lazy_prefix() -> None:
    """The chat formats' triggers start with ``[\\s\\S]*?``: each is searched as its opener on."""
    from engine.chat.tool_grammar import tool_call_grammar
    from engine.llama_backend.grammar_sampler import compile_triggers

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    spec = tool_call_grammar("QWEN_XML", [tool], parallel=False, force=False, named=None)
    (trigger,) = compile_triggers(spec)
    assert trigger.unprefixed and trigger.pattern.pattern.startswith(b"(<tool_call>)")
