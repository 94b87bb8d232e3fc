"""Agent chat end to end: the real ``openai`` client against a real server and model.

Tool calls, reasoning and structured output through ``/v1/chat/completions`` with two chat
templates written for these tests (tests/templates/: the Qwen 3.5 XML form and the Hermes JSON
form) on the tiny model. Its weights are random, so every answer that must have a shape gets it
from a grammar: ``tool_choice: "required"`` (or a named function) forces a well-formed call,
``response_format`` forces valid JSON, a request grammar forces a think block to close.
"""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.helpers import start_server

TEMPLATES = Path(__file__).parent / "templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city for the next days.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"}},
        "required": ["city", "days", "metric"]}}}
CALC = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                   "required": ["a", "b"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris this week?"}]
# the Qwen template opens a think block unless told not to; random weights would never close it
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CALC)}


def _server(template: str):
    sp = start_server("--model", "tiny", "--parallel", "2", "--threads", "1", "--log-level", "WARNING",
                      "--chat-template-file", str(TEMPLATES / template))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{sp.http_port}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    return sp, client


@pytest.fixture(scope="module", params=["qwen35_xml.jinja", "hermes.jinja"])
def chat(request):
    sp, client = _server(request.param)
    yield client
    client.close()
    assert sp.stop() == 0, sp.log
    assert "Traceback" not in sp.log, sp.log


@pytest.fixture(scope="module")
def qwen():
    sp, client = _server("qwen35_xml.jinja")
    yield client, sp
    client.close()
    assert sp.stop() == 0, sp.log
    assert "Traceback" not in sp.log, sp.log


def check_call(call, name: str | None = None) -> dict:
    assert call.type == "function" and call.id
    assert call.function.name in SCHEMAS and (name is None or call.function.name == name)
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def streamed_message(stream) -> tuple[dict, str | None]:
    """Reassemble OpenAI chunks: content, reasoning and each call's name and arguments."""
    msg = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        msg["content"] += delta.content or ""
        msg["reasoning_content"] += getattr(delta, "reasoning_content", None) or ""
        for tc in delta.tool_calls or []:
            entry = msg["tool_calls"].setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert entry["id"] is None, "a call's id is sent once"
                entry["id"] = tc.id
            if tc.function and tc.function.name:
                assert entry["name"] is None, "a call's name is sent once, first"
                entry["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                assert entry["name"] is not None, "arguments after the name"
                entry["arguments"] += tc.function.arguments
    return msg, finish


# ---------------------------------------------------------------- tool calls
@pytest.mark.parametrize("seed", [None, 3])
def test_required_tool_call_is_well_formed(chat, seed):
    # one call: both templates write several, and by default the tiny model may go on calling
    kw = {"temperature": 0} if seed is None else {"temperature": 0.9, "seed": seed}
    r = chat.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, CALC], tool_choice="required",
                                     parallel_tool_calls=False, max_tokens=200, extra_body=NO_THINK, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls and not choice.message.content
    for call in choice.message.tool_calls:
        check_call(call)


def test_named_tool_choice_calls_that_function(chat):
    r = chat.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, CALC], max_tokens=200, temperature=0,
                                     tool_choice={"type": "function", "function": {"name": "calculator"}},
                                     extra_body=NO_THINK)
    assert r.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["calculator"]
    check_call(r.choices[0].message.tool_calls[0], "calculator")


def test_streamed_tool_call_deltas_reassemble_to_the_whole_answer(chat):
    kw = dict(model="m", messages=ASK, tools=[WEATHER, CALC], tool_choice="required", max_tokens=200, temperature=0,
              extra_body=NO_THINK)
    whole = chat.chat.completions.create(**kw).choices[0]
    msg, finish = streamed_message(chat.chat.completions.create(stream=True, **kw))
    assert finish == whole.finish_reason == "tool_calls"
    assert msg["content"] == (whole.message.content or "")
    calls = [msg["tool_calls"][i] for i in sorted(msg["tool_calls"])]
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(c["id"] for c in calls)


def test_a_call_cut_by_max_tokens_is_the_call_so_far(chat):
    """As llama-server: an answer that ``max_tokens`` cuts inside a call reports that call with
    the arguments written so far and ``finish_reason: "length"`` — whole and streamed alike,
    with none of its markup as content."""
    kw = dict(model="m", messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
              temperature=0, extra_body=NO_THINK)
    full = chat.chat.completions.create(max_tokens=200, **kw)
    call = full.choices[0].message.tool_calls[0].function
    cut_in_arguments = False
    for n in range(full.usage.completion_tokens - 1, 0, -1):
        whole = chat.chat.completions.create(max_tokens=n, **kw).choices[0]
        msg, finish = streamed_message(chat.chat.completions.create(stream=True, max_tokens=n, **kw))
        assert whole.finish_reason == finish == "length", (n, whole)
        calls = whole.message.tool_calls or []
        assert [(c.function.name, c.function.arguments) for c in calls] == [
            (c["name"], c["arguments"]) for c in msg["tool_calls"].values()], n
        if not calls:  # cut before the call's name is whole: no call yet
            assert "<tool_call>" in whole.message.content, (n, whole.message)
            break
        assert not whole.message.content and not msg["content"], (n, whole.message)
        assert calls[0].function.name == call.name and call.arguments.startswith(calls[0].function.arguments)
        cut_in_arguments |= len(calls[0].function.arguments) < len(call.arguments)
    assert cut_in_arguments


def test_tool_choice_none_answers_in_text(chat):
    r = chat.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=8,
                                     temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls


def test_the_fleet_agent_request_shape(chat):
    """What the fleet's agent test sends (tools, temperature 0, max_tokens, session_id) and reads."""
    body = {"model": "m", "messages": ASK, "tools": [CALC], "max_tokens": 60, "temperature": 0, "stream": False,
            "session_id": "agent-1"}
    r = chat.post("/chat/completions", body=body, cast_to=object)
    choice = r["choices"][0]
    assert choice["finish_reason"] in ("stop", "length", "tool_calls")
    assert choice["message"]["role"] == "assistant" and "content" in choice["message"]
    for call in choice["message"].get("tool_calls") or []:
        assert call["function"]["name"] == "calculator" and isinstance(call["function"]["arguments"], str)


def test_a_tool_result_turn_renders_and_continues_from_the_prompt_cache(chat):
    first = chat.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="required",
                                         max_tokens=200, temperature=0, extra_body={"id_slot": 1, **NO_THINK})
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'}]
    second = chat.chat.completions.create(model="m", messages=history, tools=[WEATHER], max_tokens=8,
                                          temperature=0, extra_body={"id_slot": 1, **NO_THINK})
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the first turn's prompt up to its generation prompt is a prefix of the second's, from the
    # slot's cache; the generation prompt itself (an empty think block here, ~14 byte tokens) is
    # rendered differently once it is history
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 16 and second.usage.prompt_tokens > first.usage.prompt_tokens


# ---------------------------------------------------------------- structured output
def test_json_schema_response_format_validates_for_twenty_seeds(qwen):
    client, _ = qwen
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                               "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                        "maxItems": 3}},
              "required": ["name", "age", "tags"], "additionalProperties": False}
    for seed in range(20):
        r = client.chat.completions.create(
            model="m", messages=ASK, max_tokens=120, temperature=1.0, seed=seed, extra_body=NO_THINK,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                                                   "strict": True}})
        assert r.choices[0].finish_reason == "stop", (seed, r.choices[0])
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_json_object_response_format(qwen):
    client, _ = qwen
    r = client.chat.completions.create(model="m", messages=ASK, max_tokens=80, temperature=0, extra_body=NO_THINK,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # a random model may nest until the limit; what it wrote is still a JSON object's start
        assert r.choices[0].message.content.lstrip().startswith("{")


# ---------------------------------------------------------------- reasoning
THINK_THEN_ANSWER = 'root ::= [a-z]{2,12} "</think>" [a-z]{2,12}'


def test_reasoning_is_split_from_content_whole_and_streamed(qwen):
    """The template's generation prompt opens <think>: the output starts inside reasoning, and the
    grammar makes the model close it."""
    client, _ = qwen
    kw = dict(model="m", messages=ASK, max_tokens=60, temperature=0, extra_body={"grammar": THINK_THEN_ANSWER})
    whole = client.chat.completions.create(**kw).choices[0]
    reasoning = whole.message.model_extra.get("reasoning_content")
    assert reasoning and reasoning.isalpha() and whole.message.content.isalpha(), whole.message
    msg, finish = streamed_message(client.chat.completions.create(stream=True, **kw))
    assert (msg["reasoning_content"], msg["content"], finish) == (reasoning, whole.message.content, "stop")


def test_reasoning_format_none_keeps_the_text_in_content(qwen):
    client, _ = qwen
    r = client.chat.completions.create(model="m", messages=ASK, max_tokens=60, temperature=0,
                                       extra_body={"grammar": THINK_THEN_ANSWER, "reasoning_format": "none"})
    assert "</think>" in r.choices[0].message.content
    assert not r.choices[0].message.model_extra.get("reasoning_content")


def test_enable_thinking_false_closes_the_think_block_in_the_prompt(qwen):
    client, _ = qwen
    r = client.chat.completions.create(model="m", messages=ASK, max_tokens=10, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False},
                                                   "grammar": 'root ::= [a-z]{3,8}'})
    assert r.choices[0].message.content.isalpha()
    assert not r.choices[0].message.model_extra.get("reasoning_content")


# ---------------------------------------------------------------- logprobs and logit_bias
def test_logprobs_and_top_logprobs(qwen):
    client, _ = qwen
    r = client.chat.completions.create(model="m", messages=ASK, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"reasoning_format": "none"})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        tops = [t.logprob for t in item.top_logprobs]
        assert tops == sorted(tops, reverse=True) and item.logprob <= tops[0] + 1e-4
    assert "".join(i.token for i in content) == r.choices[0].message.content


def test_logit_bias_bans_the_greedy_token(qwen):
    client, _ = qwen
    kw = dict(model="m", messages=ASK, max_tokens=1, temperature=0, logprobs=True,
              extra_body={"reasoning_format": "none"})
    first = client.chat.completions.create(**kw).choices[0].logprobs.content[0]
    tok = first.model_extra["id"]
    again = client.chat.completions.create(logit_bias={str(tok): -100}, **kw).choices[0].logprobs.content[0]
    assert again.model_extra["id"] != tok


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("body, param", [
    ({"messages": [1]}, "messages"),
    ({"messages": ASK, "tools": [{"type": "function"}]}, "tools"),
    ({"messages": ASK, "tools": "get_weather"}, "tools"),
    ({"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"messages": ASK, "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": ASK, "grammar": "root ::= ("}, "grammar"),
    ({"messages": ASK, "grammar": "root ::= " + "(" * 500 + '"a"' + ")" * 500}, "grammar"),
    ({"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"schema": "x"}}},
     "response_format"),
    ({"messages": ASK, "response_format": {"type": "yaml"}}, "response_format"),
    ({"messages": ASK, "reasoning_format": "loud"}, "reasoning_format"),
    ({"messages": ASK, "logit_bias": {"999999": 1}}, "logit_bias"),
    ({"messages": ASK, "top_logprobs": 99}, "top_logprobs"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]}, "messages"),
])
def test_bad_chat_fields_are_a_400_naming_the_field(qwen, body, param):
    client, sp = qwen
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/chat/completions", body={"model": "m", "max_tokens": 4, **body}, cast_to=object)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert "Traceback" not in sp.log


# ---------------------------------------------------------------- the Hydra port renders the same prompt
@pytest.mark.asyncio
async def test_a_hydra_prefill_with_tools_is_the_prompt_http_decode_continues(qwen):
    """P/D split: PREFILL on the Hydra port with messages and tools, then the HTTP chat on the
    same slot finds the whole prompt in the slot's cache, and the PREFILL's logits with it: nothing
    is decoded again (a refused PREFILL in between leaves the slot as it was)."""
    from codec.enums import Op, Status
    from hydra_rpc.client import HydraClient

    client, sp = qwen
    async with await HydraClient.connect(sp.host, sp.port) as hydra:
        r = await hydra.request(Op.PREFILL, "0", json.dumps({"messages": ASK, "tools": [WEATHER]}).encode())
        assert r.status == Status.OK, r.meta
        bad = await hydra.request(Op.PREFILL, "0", json.dumps({"messages": [1]}).encode())
        assert bad.status == Status.BAD_REQUEST and "messages[0]" in bad.meta["error"], bad.meta
    whole = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], max_tokens=1, temperature=0,
                                           extra_body={"id_slot": 0})
    assert whole.usage.prompt_tokens == r.meta["n_past"]
    assert whole.usage.prompt_tokens_details.cached_tokens == r.meta["n_past"]


@pytest.mark.asyncio
async def test_a_pin_decode_takes_the_request_grammar_and_tools(qwen):
    """The Hydra DECODE body carries llama-server's fields too: a grammar, or tools with
    tool_choice required, constrain the streamed text."""
    from codec.enums import Op, Status
    from hydra_rpc.client import HydraClient

    _, sp = qwen

    async def pin(body: dict) -> str:
        async with await HydraClient.connect(sp.host, sp.port) as hydra:
            await hydra.send(Op.DECODE, "1", json.dumps(body).encode())
            hdr, _ = await hydra.read_head()
            assert hdr.status == Status.OK
            return b"".join([p async for p in hydra.pin_pieces()]).decode()

    assert await pin({"n_predict": 8, "messages": ASK, "grammar": 'root ::= "yes" | "no"'}) in ("yes", "no")
    text = await pin({"n_predict": 200, "messages": ASK, "tools": [CALC], "tool_choice": "required", **NO_THINK})
    assert text.startswith("<tool_call>\n<function=calculator>") and text.rstrip().endswith("</tool_call>"), text


def test_logit_bias_values_beyond_float_range_are_a_400(qwen):
    client, _ = qwen
    for bias in (10 ** 400, "1", None, [1]):
        with pytest.raises(openai.BadRequestError) as e:
            client.post("/chat/completions", body={"messages": ASK, "max_tokens": 1, "logit_bias": {"5": bias}},
                        cast_to=object)
        assert e.value.body["param"] == "logit_bias"


# ---------------------------------------------------------------- a template with no tool format
@pytest.fixture(scope="module")
def generic():
    """The tiny model's own template knows no tool format: llama-server's generic JSON form."""
    sp = start_server("--model", "tiny", "--parallel", "1", "--threads", "1", "--log-level", "WARNING")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{sp.http_port}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    yield client
    client.close()
    assert sp.stop() == 0, sp.log
    assert "Traceback" not in sp.log, sp.log


def test_the_generic_form_answers_a_call_or_a_response(generic):
    r = generic.chat.completions.create(model="m", messages=ASK, tools=[CALC], tool_choice="required",
                                        max_tokens=120, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    check_call(r.choices[0].message.tool_calls[0], "calculator")
    for seed in range(3):  # auto: the grammar allows {"tool_call": …} or {"response": "…"}, nothing else
        r = generic.chat.completions.create(model="m", messages=ASK, tools=[CALC], max_tokens=120, temperature=1,
                                            seed=seed)
        choice = r.choices[0]
        if choice.finish_reason == "tool_calls":
            check_call(choice.message.tool_calls[0], "calculator")
        elif choice.finish_reason == "stop":
            assert not choice.message.tool_calls and "response" not in choice.message.content
