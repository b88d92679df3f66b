"""Response shaping: a step's outputs -> the updates the response thread sends (no Triton).

The engine thread hands each request's `StepOutput`s here after a step; what comes back is what
its client sees: text deltas (one per token where it streams each token), whole outputs for a
request that does not stream, samples side by side for n / best_of, its final update with stats.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lookahead.runtime.generation import GenerationStats, StepOutput
from lookahead.runtime.logprobs import PositionLogprobs

if TYPE_CHECKING:
    from .engine import RequestState

MAX_ERROR_CHARS = 2000  # an error response's message is cut here: it never echoes a whole input


class FailureCode(enum.Enum):
    """Why a request ended without output; mapped to a Triton error code when sent."""

    INVALID_ARG = "INVALID_ARG"
    CANCELLED = "CANCELLED"
    INTERNAL = "INTERNAL"
    UNAVAILABLE = "UNAVAILABLE"


@dataclass(frozen=True)
class Update:
    """One response for the response thread to send: a text delta, or a failure."""

    state: RequestState
    final: bool
    text: str = ""
    num_output_tokens: int = 0
    finish_reason: str | None = None
    stats: GenerationStats | None = None  # on a final response that followed a generation
    failure: FailureCode | None = None
    message: str = ""
    logprobs: list[PositionLogprobs] | None = None  # of this response's tokens, when computed
    cumulative_logprob: float | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # on the first response
    # Several samples: one update per returned sample (its text, tokens, logprobs, finish reason),
    # in the order of the response's output elements.
    samples: tuple[Update, ...] = ()

    @classmethod
    def failed(cls, state: RequestState, code: FailureCode, message: str) -> Update:
        """A request's final error; its message at most MAX_ERROR_CHARS long."""
        if len(message) > MAX_ERROR_CHARS:
            message = f"{message[: MAX_ERROR_CHARS - 40]}... ({len(message)} characters in all)"
        return cls(state, final=True, stats=state.stats, failure=code, message=message)

    @property
    def pieces(self) -> tuple[Update, ...]:
        """One update per output element: the samples', or this one."""
        return self.samples or (self,)


def merged_stats(every: list[GenerationStats]) -> GenerationStats:
    """The stats of several samples of one prompt as one request's: tokens and drafts summed."""
    if len(every) == 1:
        return every[0]
    total = GenerationStats(prompt_tokens=every[0].prompt_tokens)
    for stats in every:
        for name in ("output_tokens", "cached_prompt_tokens", "steps", "draft_tokens", "drafts"):
            setattr(total, name, getattr(total, name) + getattr(stats, name))
        total.accepted_draft_tokens += stats.accepted_draft_tokens
    return total


def sample_updates(state: RequestState, pairs: list[tuple[RequestState, StepOutput]]) -> list[Update]:
    """The responses of a request for several samples after a step. Streaming: as many as the
    most any sample made, the k-th holding each sample's k-th update (or an empty piece);
    else one, once every sample finished, with each returned sample's whole output (best_of:
    the n of highest cumulative logprob, best first, as vLLM's V0 engine returned them)."""
    request = state.request
    made = {id(member): updates_for(member, output) for member, output in pairs}
    for member, _ in pairs:
        if made[id(member)]:
            member.last_update = made[id(member)][-1]
    done = all(member.generation.finished for member in state.members)
    if not request.stream:
        if not done:
            return []
        returned = state.members
        if request.sampling.samples > request.sampling.n:
            returned = sorted(returned, key=lambda m: m.generation.cumulative_logprob, reverse=True)
        pieces = tuple(member.last_update for member in returned[: request.sampling.n])
        return [Update(state, final=True, stats=state.stats, samples=pieces)]
    count = max(len(updates) for updates in made.values())
    updates = []
    for index in range(count):
        pieces = tuple(_piece(member, made.get(id(member), []), index) for member in state.members)
        final = done and index == count - 1
        updates.append(Update(state, final=final, stats=state.stats if final else None, samples=pieces))
    return updates


def updates_for(state: RequestState, output: StepOutput) -> list[Update]:
    """The responses this step produces: one per token where the request streams each token,
    else at most one."""
    if state.request.stream and state.request.stream_each_token and output.token_ids:
        return _token_updates(state, output)
    update = _update_for(state, output)
    return [] if update is None else [update]


def _token_updates(state: RequestState, output: StepOutput) -> list[Update]:
    """One response per token of a step, sent together at its end: each with the text that token
    added (possibly none: part of a character), its logprobs and the cumulative logprob up to it;
    finish_reason and the request's stats on the last."""
    generation, request = state.generation, state.request
    shown = not request.logprobs_hidden and generation.cumulative_logprob is not None
    own = [position[token].logprob for position, token in zip(output.logprobs or (), output.token_ids)]
    updates = []
    for index, text in enumerate(output.token_texts):
        last = index == len(output.token_ids) - 1
        cumulative = generation.cumulative_logprob
        if cumulative is not None and not last:
            cumulative -= sum(own[index + 1 :])
        prompt_logprobs = None
        if not state.prompt_logprobs_sent:
            prompt_logprobs, state.prompt_logprobs_sent = generation.prompt_logprobs, True
        final = last and output.finish_reason is not None
        updates.append(
            Update(
                state,
                final=final,
                text=text,
                num_output_tokens=1,
                finish_reason=output.finish_reason if last else None,
                stats=generation.stats if final else None,
                logprobs=output.logprobs[index : index + 1] if shown and output.logprobs else None,
                cumulative_logprob=cumulative,
                prompt_logprobs=prompt_logprobs,
            )
        )
    return updates


def _update_for(state: RequestState, output: StepOutput) -> Update | None:
    """The response this step produces, if any: streaming sends only steps that made text."""
    request = state.request
    state.unreported_tokens += len(output.token_ids)
    if output.logprobs is not None:
        state.unreported_logprobs.extend(output.logprobs)
    final = output.finish_reason is not None
    if request.stream:
        if not (output.text or final):
            return None
        text = output.text
    else:
        state.text_parts.append(output.text)
        if not final:
            return None
        text = (request.prompt if request.prepend_input else "") + "".join(state.text_parts)
    tokens, state.unreported_tokens = state.unreported_tokens, 0
    logprobs, state.unreported_logprobs = state.unreported_logprobs, []
    generation = state.generation
    prompt_logprobs = None
    if not state.prompt_logprobs_sent:
        prompt_logprobs, state.prompt_logprobs_sent = generation.prompt_logprobs, True
    return Update(
        state,
        final=final,
        text=text,
        num_output_tokens=tokens,
        finish_reason=output.finish_reason,
        stats=generation.stats if final else None,
        logprobs=None if request.logprobs_hidden or generation.cumulative_logprob is None else logprobs,
        cumulative_logprob=generation.cumulative_logprob,
        prompt_logprobs=prompt_logprobs,
    )


def _piece(member: RequestState, updates: list[Update], index: int) -> Update:
    """A sample's part of a response: its index-th update of the step, else nothing new (no text,
    no tokens; its finish reason once it finished: every sample is in every response, as in vLLM)."""
    if index < len(updates):
        return updates[index]
    generation = member.generation
    shown = not member.request.logprobs_hidden and generation.cumulative_logprob is not None
    return Update(
        member,
        final=False,
        finish_reason=generation.finish_reason,
        logprobs=[] if shown else None,
        cumulative_logprob=generation.cumulative_logprob,
    )
