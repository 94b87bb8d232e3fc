"""Chat answers as OpenAI messages: which syntax a chat template implies (``formats``), the
parse of a generated answer into reasoning, content and tool calls (``parse``, with
``blocks`` per tool-call format and ``parse_json`` for JSON still being written), and the
streaming deltas built from it (``stream``). Pure Python: nothing here touches the model.
"""
from .formats import ChatFormat, ToolFormat, detect_format, generation_opens_reasoning
from .parse import ChatMessage, ToolCall, parse_output
from .stream import ChatStream

__all__ = [
    "ChatFormat",
    "ChatMessage",
    "ChatStream",
    "ToolCall",
    "ToolFormat",
    "detect_format",
    "generation_opens_reasoning",
    "parse_output",
]
