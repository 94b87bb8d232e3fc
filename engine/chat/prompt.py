"""What a chat request puts into the chat template, checked before any slot is taken.

Both wire sides (HTTP ``/v1/chat/completions`` and the Hydra port's PREFILL/DECODE
``messages``) go through :func:`plan_chat`, so a P/D split prefills exactly the prompt that
the HTTP decode continues. Pure Python: the tool formats and grammars come from
``engine.chat.formats`` and ``engine.chat.grammar``; nothing here touches the model.

Every refusal is a :class:`ChatRequestError` — the client's mistake, answered 400 /
BAD_REQUEST with the field it names — never an exception from deeper down.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..reasoning_budget import MAX_BUDGET_MESSAGE, ReasoningBudget
from ..sampling import GrammarSpec
from .formats import ChatFormat, ToolFormat

MAX_MESSAGES = 4096
MAX_TOOL_CALLS_PER_MESSAGE = 128
REASONING_FORMATS = ("auto", "deepseek", "none")
# llama-server's generic form tells a model that knows no tool format what to answer
GENERIC_SYSTEM = ("Respond in JSON format, either with `tool_call` (a request to call tools) or with "
                  "`response` reply to the user's request")


class ChatRequestError(ValueError):
    """The request's chat fields are unusable: the client's fault (HTTP 400, BAD_REQUEST)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolChoice:
    mode: str = "auto"  # auto | none | required
    name: str | None = None  # a named function (mode "required")


@dataclass
class ChatOptions:
    """The chat fields of one request, as given (validated by :func:`read_chat_options`)."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: ToolChoice = ToolChoice()
    parallel_tool_calls: bool | None = None  # None: as the template allows (ChatFormat.parallel_calls)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_format: str = "auto"
    response_format: GrammarSpec | None = None  # from response_format / json_schema / grammar
    reasoning_budget: ReasoningBudget | None = None


@dataclass
class ChatPlan:
    """What the engine renders and how its output is read back."""

    messages: list[dict[str, Any]]
    template_vars: dict[str, Any]
    grammar: GrammarSpec | None
    fmt: ChatFormat
    parse_tools: bool  # look for tool calls in the output
    reasoning: bool  # split <think> blocks into reasoning_content
    tool_schemas: dict[str, dict[str, Any]] = field(default_factory=dict)
    reasoning_budget: ReasoningBudget | None = None


# ---------------------------------------------------------------- messages
def normalize_messages(messages: Any, param: str = "messages") -> list[dict[str, Any]]:
    """OpenAI messages → what a chat template expects. Assistant ``tool_calls`` arguments given
    as JSON strings become objects (templates iterate ``arguments|items``), as llama-server
    passes them; anything malformed is a :class:`ChatRequestError` naming the item."""
    if not isinstance(messages, list) or not messages:
        raise ChatRequestError(f"'{param}' must be a non-empty array", param)
    if len(messages) > MAX_MESSAGES:
        raise ChatRequestError(f"'{param}' holds {len(messages)} messages, more than {MAX_MESSAGES}", param)
    out = []
    for i, m in enumerate(messages):
        where = f"{param}[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatRequestError(f"{where} must be an object with a string 'role'", param)
        if not isinstance(m.get("content"), (str, list, type(None))):
            raise ChatRequestError(f"{where}.content must be a string, an array of parts or null", param)
        if isinstance(m.get("content"), list) and not all(isinstance(p, (dict, str)) for p in m["content"]):
            raise ChatRequestError(f"{where}.content must hold objects (parts) or strings", param)
        calls = m.get("tool_calls")
        if calls is not None:
            m = {**m, "tool_calls": _history_calls(calls, where, param)}
        out.append(m)
    return out


def _history_calls(calls: Any, where: str, param: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list) or len(calls) > MAX_TOOL_CALLS_PER_MESSAGE:
        raise ChatRequestError(f"{where}.tool_calls must be an array of at most {MAX_TOOL_CALLS_PER_MESSAGE} calls",
                               param)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatRequestError(f"{where}.tool_calls[{j}] must be an object with function.name", param)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):
                pass  # a template renders a string it cannot iterate as it is
        out.append({**c, "type": c.get("type", "function"), "function": {**fn, "arguments": args}})
    return out


# ---------------------------------------------------------------- options
def read_tool_choice(value: Any, tools: list[dict[str, Any]]) -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("auto", "none", "required"):
        return ToolChoice(value)
    fn = value.get("function") if isinstance(value, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ChatRequestError("'tool_choice' must be \"auto\", \"none\", \"required\" or "
                               "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise ChatRequestError(f"'tool_choice' names the function {name!r}, which 'tools' does not define",
                               "tool_choice")
    return ToolChoice("required", name)


def read_chat_options(body: dict[str, Any], *, default_kwargs: dict[str, Any] | None = None,
                      default_reasoning_format: str = "auto", default_grammar: GrammarSpec | None = None,
                      default_budget: ReasoningBudget | None = None) -> ChatOptions:
    """The chat fields of a request body (OpenAI and llama-server names). Raises ChatRequestError."""
    opts = ChatOptions()
    if body.get("tools") is not None:
        from .tool_grammar import validate_tools  # here: most requests carry no tools

        try:
            opts.tools = validate_tools(body["tools"])
        except ValueError as e:
            raise ChatRequestError(str(e), "tools") from None
    opts.tool_choice = read_tool_choice(body.get("tool_choice"), opts.tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ChatRequestError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    opts.parallel_tool_calls = parallel
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ChatRequestError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    opts.template_kwargs = {**(default_kwargs or {}), **(kwargs or {})}
    rf = body.get("reasoning_format", default_reasoning_format)
    if rf not in REASONING_FORMATS:
        raise ChatRequestError(f"'reasoning_format' must be one of {', '.join(REASONING_FORMATS)}",
                               "reasoning_format")
    opts.reasoning_format = rf
    opts.response_format = read_output_grammar(body) or default_grammar
    opts.reasoning_budget = read_reasoning_budget(body, default_budget)
    return opts


def read_reasoning_budget(body: dict[str, Any], default: ReasoningBudget | None) -> ReasoningBudget | None:
    """llama-server's ``reasoning_budget_tokens`` (or ``thinking_budget_tokens``; -1: the
    server's ``--reasoning-budget``) and ``reasoning_budget_message``."""
    key = "reasoning_budget_tokens" if "reasoning_budget_tokens" in body else "thinking_budget_tokens"
    tokens = body.get(key, -1)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not -1 <= tokens < 2**31:
        raise ChatRequestError(f"'{key}' must be an integer ≥ -1", key)
    message = body.get("reasoning_budget_message", default.message if default else "")
    if not isinstance(message, str) or len(message.encode("utf-8")) > MAX_BUDGET_MESSAGE:
        raise ChatRequestError(f"'reasoning_budget_message' must be a string of at most {MAX_BUDGET_MESSAGE} bytes",
                               "reasoning_budget_message")
    if tokens == -1:
        return ReasoningBudget(default.tokens, message) if default else None
    return ReasoningBudget(tokens, message)


def read_output_grammar(body: dict[str, Any]) -> GrammarSpec | None:
    """``grammar`` (GBNF), ``json_schema`` or ``response_format`` — at most one of them —
    bounded and compiled once, so a bad one is refused before a slot is taken."""
    given = [k for k in ("grammar", "json_schema", "response_format") if body.get(k) is not None]
    if body.get("response_format") == {"type": "text"}:  # the default, said out loud
        given.remove("response_format")
    if len(given) > 1:
        raise ChatRequestError(f"give one of 'grammar', 'json_schema' and 'response_format', not {given}", given[1])
    if not given:
        return None
    from ..llama_backend.grammar_sampler import check_grammar_spec  # here: most requests carry none

    try:
        spec = _output_grammar(given[0], body[given[0]])
        if spec is not None:
            check_grammar_spec(spec)
    except ValueError as e:
        raise ChatRequestError(str(e), given[0]) from None
    return spec


def _output_grammar(field_name: str, value: Any) -> GrammarSpec | None:
    from .grammar import response_format_grammar, schema_to_gbnf

    if field_name == "grammar":
        if not isinstance(value, str):
            raise ValueError("'grammar' must be a string (GBNF)")
        # the client's own grammar applies as written, from the first token
        return GrammarSpec(value, after_think=False) if value.strip() else None
    if field_name == "json_schema":
        if not isinstance(value, dict):
            raise ValueError("'json_schema' must be an object")
        return GrammarSpec(schema_to_gbnf(value))
    return response_format_grammar(value)


# ---------------------------------------------------------------- the plan
def plan_chat(messages: list[dict[str, Any]], opts: ChatOptions, fmt: ChatFormat) -> ChatPlan:
    """Template variables, the grammar and the output parsing for one chat request."""
    from ..llama_backend.grammar_sampler import check_grammar_spec
    from .tool_grammar import tool_call_grammar

    tools = opts.tools if opts.tool_choice.mode != "none" else []
    template_vars: dict[str, Any] = dict(opts.template_kwargs)
    grammar = opts.response_format
    if tools:
        template_vars["tools"] = tools
        if opts.response_format is not None:
            raise ChatRequestError("'tools' and a structured 'response_format'/'grammar' cannot be combined",
                                   "response_format")
        choice = opts.tool_choice
        selected = [t for t in tools if choice.name is None or t["function"]["name"] == choice.name]
        try:
            parallel = fmt.parallel_calls if opts.parallel_tool_calls is None else opts.parallel_tool_calls
            grammar = tool_call_grammar(fmt.tools.name, selected, parallel=parallel,
                                        force=choice.mode == "required", named=choice.name)
            check_grammar_spec(grammar)  # what the tools' schemas made of it compiles, before a slot
        except ValueError as e:
            raise ChatRequestError(str(e), "tools") from None
        if fmt.tools is ToolFormat.GENERIC:
            messages = _with_system(messages, GENERIC_SYSTEM)
    elif opts.tools:
        template_vars["tools"] = opts.tools  # tool_choice none: the model is told, but answers in text
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in opts.tools}
    return ChatPlan(messages, template_vars, grammar, fmt, parse_tools=bool(tools),
                    reasoning=opts.reasoning_format != "none", tool_schemas=schemas,
                    reasoning_budget=opts.reasoning_budget)


def _with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """``text`` appended to the system message, or a system message put first (minja's add_system)."""
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        content = first.get("content")
        content = content if isinstance(content, str) else ""
        return [{**first, "content": (content + "\n\n" + text) if content else text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


__all__ = ["ChatOptions", "ChatPlan", "ChatRequestError", "ToolChoice", "normalize_messages", "plan_chat",
           "read_chat_options", "read_output_grammar", "read_tool_choice"]
