"""Which tool-call and reasoning syntax a chat template makes its model write.

The choice follows llama-server's ``common/chat.cpp`` as it stood before its auto-parser: a
few characteristic strings of the Jinja source name the format (pure text inspection). Whether
the template writes several calls in one answer takes a render (:func:`renders_parallel_calls`,
given the model's render function).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable


class ToolFormat(enum.Enum):
    """How a model writes tool calls."""

    QWEN_XML = "qwen_xml"          # Qwen 3.5/3.6, Qwen3-Coder: <tool_call><function=..><parameter=..>
    HERMES = "hermes"              # Hermes 2 Pro, Qwen 2.5, Qwen 3: <tool_call>{json}</tool_call>
    LLAMA3 = "llama3"              # Llama 3.x: a bare {"name", "parameters"} object
    MISTRAL_NEMO = "mistral_nemo"  # [TOOL_CALLS][{...}, ...]
    DEEPSEEK_R1 = "deepseek_r1"    # <｜tool▁calls▁begin｜>... with ```json fences
    GENERIC = "generic"            # the whole answer is {"tool_call"|"tool_calls"|"response": ...}


# Strings that open a block of tool calls, per format. DeepSeek's tokenizer has been seen
# spelling its begin token several ways; llama-server accepts them all, so do we.
DEEPSEEK_CALLS_BEGIN = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool_calls_begin｜>",
    "<｜tool calls begin｜>",
    "<｜tool\\_calls\\_begin｜>",
    "<｜tool▁calls｜>",
)
CALL_MARKERS: dict[ToolFormat, tuple[str, ...]] = {
    ToolFormat.QWEN_XML: ("<tool_call>",),
    ToolFormat.HERMES: ("<tool_call>",),
    ToolFormat.LLAMA3: ("<|python_tag|>",),
    ToolFormat.MISTRAL_NEMO: ("[TOOL_CALLS]",),
    ToolFormat.DEEPSEEK_R1: DEEPSEEK_CALLS_BEGIN,
    ToolFormat.GENERIC: (),
}


@dataclass(frozen=True)
class ChatFormat:
    """The syntax of one model's answers: its tool-call format and its think markers
    (both None when the template knows no reasoning block)."""

    tools: ToolFormat
    think_open: str | None = None
    think_close: str | None = None
    # the template writes an answer's second tool call (renders_parallel_calls): a request
    # that does not say otherwise may make several, as llama-server's parallel_tool_calls
    parallel_calls: bool = False

    @property
    def call_markers(self) -> tuple[str, ...]:
        """The strings that start a block of tool calls in this format."""
        return CALL_MARKERS[self.tools]

    @property
    def reasoning_ends(self) -> tuple[str, ...]:
        """Strings that end a think block. Qwen's XML models may go straight from thinking to a
        call without ``</think>``, so llama-server also ends reasoning at ``<tool_call>``
        (which, unlike ``</think>``, is not consumed)."""
        if self.think_close is None:
            return ()
        if self.tools is ToolFormat.QWEN_XML:
            return (self.think_close, "<tool_call>")
        return (self.think_close,)


def _tool_format(src: str) -> ToolFormat:
    if "<tool_call>" in src and "<function=" in src and "<parameter=" in src:
        return ToolFormat.QWEN_XML
    if "<｜tool▁calls▁begin｜>" in src:
        return ToolFormat.DEEPSEEK_R1
    if "<tool_call>" in src:
        return ToolFormat.HERMES
    if "[TOOL_CALLS]" in src:
        return ToolFormat.MISTRAL_NEMO
    if "<|start_header_id|>" in src and ("ipython" in src or "tools" in src):
        return ToolFormat.LLAMA3
    return ToolFormat.GENERIC


def detect_format(template_source: str | None) -> ChatFormat:
    """The format of a model whose chat template is ``template_source`` (None or "" when it has
    none: GENERIC, no reasoning). A template that mentions ``<think>`` or ``reasoning_content``
    has ``<think>``/``</think>`` markers; DeepSeek R1 always has them."""
    src = template_source or ""
    tools = _tool_format(src)
    thinks = "<think>" in src or "reasoning_content" in src or tools is ToolFormat.DEEPSEEK_R1
    if thinks:
        return ChatFormat(tools, "<think>", "</think>")
    return ChatFormat(tools)


def generation_opens_reasoning(prompt_text: str, fmt: ChatFormat) -> bool:
    """True when the rendered prompt ends inside an open think block (its generation prompt
    ends with the open marker, maybe followed by whitespace): the model's output then starts
    inside reasoning and only the close marker will appear."""
    if not fmt.think_open:
        return False
    return prompt_text.rstrip().endswith(fmt.think_open)


_PROBE_CALLS = ("hydra_probe_first", "hydra_probe_second")


def answer_with_calls(calls: list[tuple[str, str, str]], *, question: str, reply: str,
                      result: str) -> list[dict[str, Any]]:
    """A conversation the template probes render: a user's ``question``, an assistant answer
    ``reply`` making ``calls`` (``(id, name, arguments)`` each), and each call's ``result``."""
    made = [{"id": i, "type": "function", "function": {"name": name, "arguments": args}} for i, name, args in calls]
    return [{"role": "user", "content": question}, {"role": "assistant", "content": reply, "tool_calls": made},
            *({"role": "tool", "tool_call_id": c["id"], "content": result} for c in made)]


def renders_parallel_calls(render: Callable[[list[dict[str, Any]], bool], str]) -> bool:
    """Does the template write the second of an answer's two tool calls? llama-server's
    ``supports_parallel_tool_calls`` (``common/jinja/caps.cpp``), which is its default for a
    request's ``parallel_tool_calls``. ``render(messages, add_generation_prompt)``; a template
    that refuses two calls (Llama 3.1's raises) or ignores calls writes none."""
    calls = [(f"call_{i}", name, '{"arg": "x"}') for i, name in enumerate(_PROBE_CALLS)]
    messages = [*answer_with_calls(calls, question="User message", reply="", result="Tool response"),
                {"role": "user", "content": "User message"}]
    try:
        return _PROBE_CALLS[1] in render(messages, False)
    except Exception:
        return False
