"""engine.chat.turns: where a chat prompt's last user turn starts (a checkpoint goes there)."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.chat.turns import last_turn_start, user_turn_opening
from engine.llama_backend.chat_template import ChatTemplate

TEMPLATES = Path(__file__).parent / "templates"
GEMMA = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
         "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST]{{ m['content'] }}[/INST]"
           "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


def renderer(source: str):
    template = ChatTemplate(source, "llama")
    return lambda messages, gen: template.render(messages, gen, bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("source, opening", [
    ((TEMPLATES / "qwen35_xml.jinja").read_text(), "<|im_start|>user"),  # the fleet's family
    (GEMMA, "<start_of_turn>user"),
    (MISTRAL, "[INST]"),  # "</s>" and "<s>" end alike: the common part starts at the marker
])
def test_the_opening_of_a_user_turn_is_found_by_comparing_renders(source, opening):
    assert user_turn_opening(renderer(source)) == opening


def test_a_template_that_refuses_the_probe_gives_no_opening():
    refuses = "{{ raise_exception('a system message first') if messages[0]['role'] != 'system' else '' }}"
    assert user_turn_opening(renderer(refuses)) is None
    assert user_turn_opening(renderer("{% for m in messages %}{{ m['content'] }}{% endfor %}")) is None


def test_the_last_start_is_found_and_a_missing_one_is_none():
    assert last_turn_start([5, 1, 2, 9, 1, 2, 9, 1], [1, 2]) == 4
    assert last_turn_start([1, 2], [1, 2]) == 0
    assert last_turn_start([2, 1, 3, 1], [1, 2]) is None
    assert last_turn_start([1, 2, 3], []) is None and last_turn_start([1], [1, 2]) is None


@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), min_size=1, max_size=3))
def test_the_last_start_is_what_a_plain_search_finds(tokens, opening):
    starts = [i for i in range(len(tokens) - len(opening) + 1) if tokens[i:i + len(opening)] == opening]
    assert last_turn_start(tokens, opening) == (starts[-1] if starts else None)
