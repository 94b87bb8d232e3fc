"""Turning chat messages into prompt text: the GGUF's jinja template, or a fallback.

Pure Python (no llama.cpp): the model supplies the template source, its architecture and
the BOS/EOS texts.
"""
from __future__ import annotations

from typing import Any

def content_text(content: Any) -> str:
    """OpenAI-style message content (str or list of parts) -> plain text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                out.append(str(part.get("text", "")))
            elif isinstance(part, str):
                out.append(part)
        return "".join(out)
    return str(content)



class ChatTemplate:
    """The GGUF's ``tokenizer.chat_template`` (compiled on first use), or, without one,
    gemma-style turns for gemma models and ChatML for the rest — llama-server's fallback for
    every model; a Gemma model answers off-format in ChatML, so its own turns are kept."""

    def __init__(self, source: str | None, architecture: str):
        self.source = source
        self.architecture = architecture
        self._compiled: Any = None

    def compile(self) -> None:
        """Compile a jinja template now (the loader thread), so a broken one fails the model's
        build — a reload to it then fails and the old model keeps serving — instead of every
        chat answering 500 afterwards. Raises jinja2's TemplateError."""
        if self.format == "jinja" and self._compiled is None:
            self._compiled = _compile_template(self.source or "")

    @property
    def format(self) -> str:
        """"jinja" (GGUF template), "gemma" (fallback for gemma3) or "chatml" (fallback)."""
        if self.source:
            return "jinja"
        return "gemma" if self.architecture.startswith("gemma") else "chatml"

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, *, bos_token: str,
               eos_token: str, **extra: Any) -> str:
        """Prompt text for ``messages``. The jinja template runs sandboxed (as llama-cpp-python's
        Jinja2ChatFormatter) and sees ``extra`` too, e.g. ``tools=[...]``."""
        fmt = self.format
        if fmt == "jinja":
            if self._compiled is None:
                self._compiled = _compile_template(self.source or "")
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token, eos_token=eos_token, **extra)
        if fmt == "gemma":
            return _gemma_turns(messages, add_generation_prompt)
        out = [f"<|im_start|>{m.get('role', 'user')}\n{content_text(m.get('content'))}<|im_end|>\n"
               for m in messages]
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n")
        return "".join(out)


def _gemma_turns(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    out: list[str] = []
    system = ""
    for m in messages:
        role = m.get("role", "user")
        text = content_text(m.get("content"))
        if role == "system":
            system += text + "\n\n"
            continue
        if role == "assistant":
            role = "model"
        elif role != "model":
            role = "user"
        if system and role == "user":
            text, system = system + text, ""
        out.append(f"<start_of_turn>{role}\n{text}<end_of_turn>\n")
    if system:  # a lone system message
        out.append(f"<start_of_turn>user\n{system.rstrip()}<end_of_turn>\n")
    if add_generation_prompt:
        out.append("<start_of_turn>model\n")
    return "".join(out)


def _compile_template(src: str) -> Any:
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        loader=jinja2.BaseLoader(),
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols],
    )

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        import json

        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda f: datetime.datetime.now().strftime(f)
    return env.from_string(src)
