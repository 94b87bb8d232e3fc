"""llama.cpp's built-in chat formats (``llama_chat_apply_template``): what llama-server uses
with ``--no-jinja``, or when ``--chat-template`` names a built-in format (``chatml``,
``llama3``, …) instead of giving Jinja source."""
from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp.llama_cpp as L

from ..jobs import Unservable
from .chat_template import content_text
from .runtime import LlamaBackendError


class UnknownTemplate(LlamaBackendError, Unservable):
    """``llama_chat_apply_template`` recognises no built-in format in the template."""


def is_jinja_source(text: str) -> bool:
    return "{%" in text or "{{" in text


def render_builtin(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    """Prompt text for ``messages`` in the built-in format ``template`` names (or that
    llama.cpp recognises in a template's source)."""
    keep = [(str(m.get("role", "user")).encode(), content_text(m.get("content")).encode()) for m in messages]
    chat = (L.llama_chat_message * max(len(keep), 1))()
    for i, (role, content) in enumerate(keep):
        chat[i].role, chat[i].content = role, content
    tmpl = template.encode()
    size = 1024 + 2 * sum(len(r) + len(c) for r, c in keep)
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = int(L.llama_chat_apply_template(tmpl, chat, len(keep), add_generation_prompt, buf, size))
        if n < 0:
            raise UnknownTemplate(f"llama.cpp does not know the chat template {template[:80]!r}: without --jinja "
                                  "only its built-in formats render (this custom template is not supported, "
                                  "try using --jinja)")
        if n <= size:
            return buf.raw[:n].decode("utf-8", "replace")
        size = n
    raise LlamaBackendError("llama_chat_apply_template kept growing")  # pragma: no cover
