"""Where a chat prompt's last user turn starts: a context checkpoint goes there.

A hybrid (recurrent) model's state cannot be cut back, so a prompt is only reused up to a
context checkpoint. Agents sharing a system prompt (with its tools) differ from their first
user turn on; with checkpoints only near a prompt's end, a new agent would reuse a few hundred
tokens less than the system prompt. llama-server cuts a chat prompt's batches where user turns
start and takes a checkpoint at the last one (``tools/server/server-context.cpp``,
``message_spans``); the text that opens a user turn comes from comparing renders of the
template (llama.cpp's autoparser, ``user_start``). The same here: :func:`user_turn_opening`
finds that text once per template, :func:`last_turn_start` finds its tokens in a prompt.

Templates that render a tool's result as a user turn (Qwen's) make that the last user turn
of an agent's prompt, as in llama-server.
"""
from __future__ import annotations

from typing import Any, Callable

# distinct texts a template copies into its render unchanged
_FIRST, _REPLY, _SECOND = "HYDRA_TURN_ONE", "HYDRA_TURN_REPLY", "HYDRA_TURN_TWO"


def user_turn_opening(render: Callable[[list[dict[str, Any]], bool], str]) -> str | None:
    """The text that opens a user turn in ``render``'s output (``render(messages,
    add_generation_prompt)``), e.g. ``<|im_start|>user``; None when the renders do not show
    one. It is what precedes the first user message's text and also follows the assistant's
    reply before the next user message's text, whitespace at its ends left out, from its first
    marker on."""
    user, reply = {"role": "user", "content": _FIRST}, {"role": "assistant", "content": _REPLY}
    try:
        one = render([user], False)
        three = render([user, reply, {"role": "user", "content": _SECOND}], False)
    except Exception:  # a template that refuses such a conversation: no checkpoint there
        return None
    first, end_of_reply, second = one.find(_FIRST), three.find(_REPLY), three.find(_SECOND)
    if first < 0 or end_of_reply < 0 or second < end_of_reply:
        return None
    before_first, between = one[:first], three[end_of_reply + len(_REPLY):second]
    n = 0
    while n < min(len(before_first), len(between)) and before_first[-1 - n] == between[-1 - n]:
        n += 1
    opening = between[len(between) - n:].strip()
    # the common part may begin inside the marker before it (``</s>`` and ``<s>`` share "s>"):
    # a turn's markers are special tokens, written <…> or […]
    cut = min((i for i in (opening.find("<"), opening.find("[")) if i >= 0), default=0)
    return opening[cut:] or None


def last_turn_start(tokens: list[int], opening: list[int]) -> int | None:
    """Where the last occurrence of ``opening`` starts in ``tokens``; None when it is not there.
    One backward scan for its first token at C speed, then a slice comparison per candidate."""
    if not opening or len(tokens) < len(opening):
        return None
    head, back = opening[0], tokens[::-1]
    at = len(opening) - 1  # a match cannot start in the last len(opening) - 1 tokens
    while True:
        try:
            at = back.index(head, at)
        except ValueError:
            return None
        start = len(tokens) - 1 - at
        if tokens[start:start + len(opening)] == opening:
            return start
        at += 1
