"""Where one decoder step's wall time goes, part by part (no torch).

The decoder fills a `StepTimes` per step (`LookaheadDecoder.last_step`); the parts add up to the
step's wall time, so what a step spends outside its forward can be read off, and the backend adds
the engine thread's own parts around it (backend/engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

# The decoder's parts of a step, in the order they run.
DECODER_PARTS = ("schedule", "draft", "forward", "verify", "commit")


@dataclass
class StepTimes:
    """Seconds one decoder step spent in each part, and what it fed."""

    schedule: float = 0.0  # pool slots, budgets and plan_step: everything not in another part
    draft: float = 0.0  # each request's drafter: draft retrieval
    forward: float = 0.0  # the runner's one forward: inputs, the model, the output layer's rows
    verify: float = 0.0  # sampling and acceptance: verify, recycling, moving accepted KV, verdicts
    commit: float = 0.0  # each request's commit: detokenising, stop words, its tries
    requests: int = 0  # segments fed
    tokens: int = 0  # tokens fed

    @property
    def total(self) -> float:
        return sum(getattr(self, part) for part in DECODER_PARTS)

    def parts(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in DECODER_PARTS}
