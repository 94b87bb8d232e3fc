"""llama-server's reasoning budget: at most N generated tokens inside a think block.

A job with a budget counts the tokens it generates inside the block — from the first token
when its prompt opened the block, else from the model's own open tag — and once N are spent
(at a character boundary) the next tokens are not sampled but forced: the budget message, then
the close tag, as llama-server's ``common/reasoning-budget.cpp`` does. A budget of 0 closes the
block at once. The state machine below runs on the inference thread, one per generating job.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from .utf8 import owed_after

MAX_BUDGET_MESSAGE = 1024  # bytes


@dataclass(frozen=True)
class ReasoningBudget:
    tokens: int  # ≥ 0
    message: str = ""  # written before the close tag when the budget is spent


class BudgetState(enum.Enum):
    IDLE = "idle"  # waiting for the model to open a think block
    COUNTING = "counting"
    FORCING = "forcing"  # writing the message and the close tag
    DONE = "done"  # the block closed; nothing more to do


_MOVES = {
    BudgetState.IDLE: {BudgetState.COUNTING},
    BudgetState.COUNTING: {BudgetState.FORCING, BudgetState.DONE},
    BudgetState.FORCING: {BudgetState.DONE},
    BudgetState.DONE: set(),
}


@dataclass(eq=False)
class BudgetTracker:
    budget: ReasoningBudget
    open_tag: str
    close_tag: str
    state: BudgetState = BudgetState.IDLE
    left: int = 0
    forced: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.left = self.budget.tokens

    def move(self, to: BudgetState) -> None:
        if to not in _MOVES[self.state]:
            raise AssertionError(f"reasoning budget: {self.state.value} → {to.value} is not a transition")
        self.state = to

    def next_forced(self, model: Any, text: bytes) -> int | None:
        """The token to write instead of sampling, if the budget is spent (``text``: the output so far)."""
        if self.state is BudgetState.COUNTING and self.left <= 0 and owed_after(bytes(text[-4:])) == 0:
            self.move(BudgetState.FORCING)
            self.forced = model.tokenize(self.budget.message + self.close_tag, add_special=False, parse_special=True)
        if self.state is BudgetState.FORCING:
            if self.forced:
                return self.forced.pop(0)
            self.move(BudgetState.DONE)
        return None

    def observe(self, text: bytes, piece: bytes) -> None:
        """After a token: count it, and notice the block opening or closing."""
        window = bytes(text[-(len(piece) + 16):]).decode("utf-8", "ignore")
        if self.state is BudgetState.IDLE and self.open_tag in window:
            self.move(BudgetState.COUNTING)
        elif self.state is BudgetState.COUNTING:
            if self.close_tag in window:
                self.move(BudgetState.DONE)
            else:
                self.left -= 1


def tracker_for(budget: ReasoningBudget | None, opens_reasoning: bool, open_tag: str | None,
                close_tag: str | None) -> BudgetTracker | None:
    """A tracker when the job has a budget and the template knows a think block."""
    if budget is None or not open_tag or not close_tag:
        return None
    t = BudgetTracker(budget, open_tag, close_tag)
    if opens_reasoning:
        t.move(BudgetState.COUNTING)
    return t
