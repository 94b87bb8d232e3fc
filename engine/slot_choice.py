"""Which slot a request that names none runs on (llama-server's ``get_available_slot``).

Among the idle slots: the one whose cached tokens share the longest prefix with the prompt,
as a fraction of the prompt, if that fraction is above ``--slot-prompt-similarity`` (so a
returning conversation finds its KV); otherwise the least recently used one (so a burst of
new conversations spreads over every slot, and a slot's KV lives as long as it can). The
actor decides when it admits the job, so two submissions can never pick the same slot from
the same stale view.

Beyond llama-server: when prefixes can be copied between slots (``shareable``), a prefix
that other conversations share (a system prompt) is no reason to pick a slot — any slot gets
it by a copy. Only a slot whose own content the prompt continues (it would lose fewer than
``MIN_SHARED_PREFIX`` tokens) is picked by similarity; a new conversation goes to the least
recently used slot instead of overwriting another conversation that shares its system prompt.
"""
from __future__ import annotations

from typing import Sequence

from .host_cache import common_prefix
from .prompt_cache import MIN_SHARED_PREFIX
from .slots import Slot


def available(slot: Slot) -> bool:
    return not slot.busy and not slot.queue and not slot.erase_waiters


def choose_slot(slots: Sequence[Slot], prompt: list[int] | None, similarity: float,
                shareable: bool = False) -> Slot | None:
    """The slot for a prompt (its tokens, if known), or None when every slot is taken."""
    idle = [s for s in slots if available(s)]
    if not idle:
        return None
    if prompt and similarity > 0:
        best, best_sim = None, similarity
        for s in idle:
            if s.tokens:
                n = common_prefix(s.tokens, prompt)
                if shareable and len(s.tokens) - n >= MIN_SHARED_PREFIX:
                    continue  # another conversation: it would be overwritten for a prefix any slot can copy
                if n / len(prompt) > best_sim:
                    best, best_sim = s, n / len(prompt)
        if best is not None:
            return best
    return min(idle, key=lambda s: (s.last_used, s.id))
