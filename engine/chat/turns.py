"""Where a chat prompt's last user turn starts: a context checkpoint goes there.

A hybrid (recurrent) model's state cannot be cut back, so a prompt is only reused up to a
context checkpoint. Agents sharing a system prompt (with its tools) differ from their first
user turn on; with checkpoints only near a prompt's end, a new agent would reuse a few hundred
tokens less than the system prompt. llama-server cuts a chat prompt's batches where user turns
start and takes a checkpoint at the last one (``tools/server/server-context.cpp``,
``message_spans``); the text that opens a user turn comes from comparing renders of the
template (llama.cpp's autoparser, ``user_start``). The same here: :func:`user_turn_opening`
finds that text once per template, :func:`last_turn_start` finds its tokens in a prompt.

The turn is the last **user message**'s, as llama-server's spans have it: a template that
renders a tool's result as a user turn (Qwen's) does not make that result a user message, and
llama-server cuts an agent's next turn only where checkpoints near its end go. A cut at the
result would also leave a chunk of a few dozen tokens, which llama.cpp's CPU attention
computes token by token against the whole context (a 54-token chunk at ~4,000 tokens of
context took longer than 458 tokens: docs/performance.md, "An agent's turn cut where
llama-server cuts it"). :func:`tool_result_turns` finds once per template whether its tool
results open user turns, :func:`user_turns_after_last_user` counts them in a conversation,
and :func:`last_turn_start` skips that many (:func:`last_user_message_start`, both).
"""
from __future__ import annotations

from typing import Any, Callable

from .formats import answer_with_calls

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


def tool_result_turns(render: Callable[[list[dict[str, Any]], bool], str], opening: str | None) -> int:
    """How ``render`` writes tool results: 0, not in user turns (or unknown); 1, consecutive
    results share one user turn (Qwen's); 2, each opens its own."""
    if not opening:
        return 0
    messages = answer_with_calls([(f"c{i}", "f", "{}") for i in (1, 2)], question=_FIRST, reply=_REPLY, result=_SECOND)
    try:
        text = render(messages, False)
    except Exception:  # a template without tool calls: its results are not user turns
        return 0
    after = text.find(_REPLY)
    return 0 if after < 0 else min(2, text.count(opening, after))


def user_turns_after_last_user(messages: list[Any], tool_turns: int) -> int | None:
    """The user turns a template renders after the conversation's last user message (its tool
    results', by :func:`tool_result_turns`); None when no message is the user's."""
    roles = [m.get("role") if isinstance(m, dict) else None for m in messages]
    if "user" not in roles:
        return None
    last = len(roles) - 1 - roles[::-1].index("user")
    after = roles[last + 1:]
    if tool_turns == 2:
        return after.count("tool")
    if tool_turns == 1:  # a run of results is one turn
        return sum(1 for i, role in enumerate(after) if role == "tool" and (i == 0 or after[i - 1] != "tool"))
    return 0


def last_user_message_start(tokens: list[int], opening: list[int], messages: list[Any],
                            tool_turns: int) -> int | None:
    """Where the turn of ``messages``' last user message starts in their rendered ``tokens``
    (``opening``: the template's user-turn tokens; ``tool_turns``: :func:`tool_result_turns`);
    None when it is not found or no message is the user's."""
    skip = user_turns_after_last_user(messages, tool_turns)
    return None if skip is None else last_turn_start(tokens, opening, skip)


def last_turn_start(tokens: list[int], opening: list[int], skip: int = 0) -> int | None:
    """Where the last occurrence of ``opening`` starts in ``tokens`` (``skip``: that many later
    ones passed over first); None when it is not there. One backward scan for its first token
    at C speed, then a slice comparison per candidate."""
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
            if not skip:
                return start
            skip -= 1
            at += len(opening)  # occurrences do not overlap
            continue
        at += 1
