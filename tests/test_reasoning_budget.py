"""The reasoning budget (llama-server's ``--reasoning-budget`` / ``reasoning_budget_tokens``):
at most N generated tokens inside a think block, then the budget message and the close tag are
written instead of sampled."""
from __future__ import annotations

import pytest

from engine.reasoning_budget import BudgetState, BudgetTracker, ReasoningBudget, tracker_for
from tests.test_chat_tools import ASK, _server


class Words:
    """A model stand-in that tokenizes a text into one token per character."""

    def tokenize(self, text, add_special=False, parse_special=False):
        return [ord(c) for c in text]


def test_the_tracker_counts_then_forces_the_message_and_close_tag():
    t = tracker_for(ReasoningBudget(2, "ok"), True, "<think>", "</think>")
    text = bytearray()
    for piece in (b"a", b"b"):
        assert t.next_forced(Words(), text) is None
        text += piece
        t.observe(text, piece)
    forced = []
    while (tok := t.next_forced(Words(), text)) is not None:
        forced.append(chr(tok))
        text += chr(tok).encode()
        t.observe(text, chr(tok).encode())
    assert "".join(forced) == "ok</think>" and t.state is BudgetState.DONE


def test_the_tracker_waits_for_the_open_tag_and_stops_at_a_natural_close():
    t = tracker_for(ReasoningBudget(100), False, "<think>", "</think>")
    text = bytearray()
    for piece in (b"hi <thi", b"nk>", b"x", b"</think>"):
        text += piece
        t.observe(text, piece)
    assert t.state is BudgetState.DONE and t.left == 99
    assert tracker_for(ReasoningBudget(1), True, None, None) is None  # no think block in this template


def test_the_tracker_does_not_force_inside_a_character():
    t = tracker_for(ReasoningBudget(0), True, "<think>", "</think>")
    assert t.next_forced(Words(), bytearray(b"x\xe6\x94")) is None  # two bytes of a three-byte character
    assert t.next_forced(Words(), bytearray(b"x\xe6\x94\xb7")) == ord("<")


def test_an_illegal_transition_raises():
    t = BudgetTracker(ReasoningBudget(1), "<think>", "</think>")
    with pytest.raises(AssertionError, match="idle → forcing"):
        t.move(BudgetState.FORCING)


@pytest.fixture(scope="module")
def qwen():
    sp, client = _server("qwen35_xml.jinja")
    yield client
    client.close()
    assert sp.stop() == 0, sp.log
    assert "Traceback" not in sp.log, sp.log


@pytest.mark.parametrize("budget", [0, 5])
def test_a_spent_budget_closes_the_think_block(qwen, budget):
    """Qwen's template opens the block: the first ``budget`` tokens are reasoning, then the close
    tag is written (random weights would never write it)."""
    r = qwen.chat.completions.create(model="m", messages=ASK, max_tokens=30, temperature=0, logprobs=True,
                                     extra_body={"reasoning_budget_tokens": budget, "reasoning_format": "none"})
    tokens = [t.token for t in r.choices[0].logprobs.content]
    raw = "".join(tokens)
    assert "</think>" in raw, raw
    before = len(raw[:raw.index("</think>")])
    n_before = next(i for i in range(len(tokens) + 1) if len("".join(tokens[:i])) >= before)
    assert budget <= n_before <= budget + 3  # + the tokens that finish a character
    whole = qwen.chat.completions.create(model="m", messages=ASK, max_tokens=30, temperature=0,
                                         extra_body={"reasoning_budget_tokens": budget,
                                                     "reasoning_budget_message": " Enough."})
    msg = whole.choices[0].message
    assert (msg.model_extra.get("reasoning_content") or "").endswith("Enough.") and msg.content


def test_a_bad_budget_is_a_400(qwen):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        qwen.post("/chat/completions", body={"messages": ASK, "reasoning_budget_tokens": "5"}, cast_to=object)
    assert e.value.body["param"] == "reasoning_budget_tokens"
