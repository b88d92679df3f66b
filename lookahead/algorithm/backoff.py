"""When a request stops looking for drafts for a while: its drafts keep failing to pay.

Retrieval, planning and verification cost host time on every step that looks for a draft,
whether the plan then feeds it or not. Where a request's drafts keep going unfed or rejected
(chat that repeats nothing, a step too crowded for drafts to pay), that time is lost on every
step and lookahead would run slower than plain decoding. So after MISSES_BEFORE_REST looks in a
row without an accepted token, the request decodes plainly for a rest of 1 step, then 2, 4, ...
up to MAX_REST after each look that misses again; a look that gets a token accepted ends the
rests. Outputs never change: a step without a draft is a plain decoding step.
"""

from __future__ import annotations

from dataclasses import dataclass

MISSES_BEFORE_REST = 4
MAX_REST = 8


@dataclass
class DraftBackoff:
    """One request's rests from looking for drafts (see the module docstring)."""

    misses: int = 0  # looks in a row without an accepted token
    rest: int = 0  # the latest rest's length in steps (0: none since the last hit)
    resting: int = 0  # steps left in the current rest

    def looks(self) -> bool:
        """Whether this step looks for a draft (called once per step that could draft)."""
        if self.resting:
            self.resting -= 1
            return False
        return True

    def observe(self, accepted: int) -> None:
        """A look's outcome: how many of its draft tokens the model accepted (0 where none was fed)."""
        if accepted:
            self.misses = self.rest = 0
            return
        self.misses += 1
        if self.misses >= MISSES_BEFORE_REST:
            self.rest = min(2 * self.rest or 1, MAX_REST)
            self.resting = self.rest
