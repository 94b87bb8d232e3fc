"""engine.chat.turns: where a chat prompt's last user turn starts (a checkpoint goes there)."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.chat.turns import last_turn_start, tool_result_turns, user_turn_opening, user_turns_after_last_user
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


EACH_TOOL = ("{% for m in messages %}{% if m['role'] in ('user', 'tool') %}<|u|>{% else %}<|a|>{% endif %}"
             "{{ m['content'] }}<|e|>{% endfor %}")


@pytest.mark.parametrize("source, turns", [
    ((TEMPLATES / "qwen35_xml.jinja").read_text(), 1),  # a run of results in one user turn
    ((TEMPLATES / "hermes.jinja").read_text(), 1),
    (EACH_TOOL, 2),
    (GEMMA, 0),  # a "tool" turn of its own
])
def test_how_a_template_writes_tool_results_is_found_by_rendering_two(source, turns):
    render = renderer(source)
    assert tool_result_turns(render, user_turn_opening(render)) == turns


def test_the_user_turns_after_the_last_user_message_are_its_tool_results():
    call = {"role": "assistant", "content": ""}
    result = {"role": "tool", "content": "r"}
    agent = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"},
             call, result, result, call, result]
    assert user_turns_after_last_user(agent, 1) == 2  # two runs of results
    assert user_turns_after_last_user(agent, 2) == 3
    assert user_turns_after_last_user(agent, 0) == 0
    assert user_turns_after_last_user(agent + [{"role": "user", "content": "more"}], 1) == 0
    assert user_turns_after_last_user([{"role": "system", "content": "s"}], 1) is None  # no user message


def test_skipped_starts_are_passed_over_from_the_end():
    assert last_turn_start([1, 2, 9, 1, 2, 9, 1, 2], [1, 2], skip=1) == 3
    assert last_turn_start([1, 2, 9, 1, 2, 9, 1, 2], [1, 2], skip=2) == 0
    assert last_turn_start([1, 2, 9, 1, 2], [1, 2], skip=2) is None


@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), min_size=1, max_size=3),
       st.integers(0, 3))
def test_skipping_finds_what_a_search_from_the_end_finds(tokens, opening, skip):
    starts, end = [], len(tokens)  # occurrences from the end, not overlapping
    for i in range(len(tokens) - len(opening), -1, -1):
        if i + len(opening) <= end and tokens[i:i + len(opening)] == opening:
            starts.append(i)
            end = i
    assert last_turn_start(tokens, opening, skip) == (starts[skip] if skip < len(starts) else None)


# ---- several calls in one answer: llama-server's default for parallel_tool_calls ----------
ONLY_FIRST_CALL = ("{% for m in messages %}{% if m['role'] == 'assistant' and m.get('tool_calls') %}"
                   "<call>{{ m['tool_calls'][0]['function']['name'] }}</call>{% else %}{{ m['content'] }}{% endif %}"
                   "{% endfor %}")
ONE_CALL_ONLY = ("{% for m in messages %}{% if m.get('tool_calls') and m['tool_calls']|length != 1 %}"
                 "{{ raise_exception('This model only supports single tool-calls at once!') }}{% endif %}"
                 "{{ m['content'] }}{% endfor %}")


@pytest.mark.parametrize("source, several", [
    ((TEMPLATES / "qwen35_xml.jinja").read_text(), True),  # the fleet's family
    ((TEMPLATES / "hermes.jinja").read_text(), True),
    (ONLY_FIRST_CALL, False),  # writes an answer's first call only
    (ONE_CALL_ONLY, False),  # refuses two, as Llama 3.1's
    (GEMMA, False),  # knows no calls
])
def test_whether_a_template_writes_an_answers_second_call(source, several):
    from engine.chat.formats import renders_parallel_calls

    assert renders_parallel_calls(renderer(source)) is several


def test_a_request_that_does_not_say_may_make_as_many_calls_as_the_template_writes():
    """``parallel_tool_calls`` absent: the grammar allows several calls where the template
    writes them (llama-server's default), one where it does not; a request's own value wins."""
    from engine.chat.formats import ChatFormat, ToolFormat
    from engine.chat.prompt import plan_chat, read_chat_options
    from engine.chat.tool_grammar import tool_call_grammar, validate_tools

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    grammars = {p: tool_call_grammar("QWEN_XML", validate_tools(tools), parallel=p, force=False, named=None).text
                for p in (False, True)}
    assert grammars[False] != grammars[True]
    messages = [{"role": "user", "content": "hi"}]
    for writes_several in (False, True):
        fmt = ChatFormat(ToolFormat.QWEN_XML, "<think>", "</think>", parallel_calls=writes_several)
        for body, parallel in (({}, writes_several), ({"parallel_tool_calls": False}, False),
                               ({"parallel_tool_calls": True}, True)):
            plan = plan_chat(messages, read_chat_options({"tools": tools, **body}), fmt)
            assert plan.grammar is not None and plan.grammar.text == grammars[parallel], (writes_several, body)
