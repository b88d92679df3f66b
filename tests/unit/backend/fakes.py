"""A scripted decoder and a recording sink: the engine thread's path without a model or Triton."""

from __future__ import annotations

import threading
from typing import Any

from backend.engine import Engine, RequestState, Update
from backend.request import GenerationRequest
from lookahead.config import LookaheadConfig, SamplingParams
from lookahead.runtime.decoder import GenerationStats, StepOutput
from lookahead.runtime.scheduler import Scheduler


def tokenize(text: str) -> list[int]:
    """One token per character: enough to test lengths without a real tokenizer."""
    return [ord(c) for c in text]


class ScriptedGeneration:
    """Emits one scripted StepOutput per step; records when it was closed."""

    def __init__(
        self, steps: list[StepOutput], prompt_tokens: int, log: list[str], name: str, gate: threading.Event
    ):
        self.steps = list(steps)
        self.gate = gate
        self.stats = GenerationStats(prompt_tokens=prompt_tokens)
        self.finished = False
        self.finish_reason: str | None = None
        self.closed = False
        self.in_pool = False  # like Generation: true once its first step (the prefill) ran
        self.cumulative_logprob = None
        self.prompt_logprobs = None
        self.log, self.name = log, name

    def step(self) -> StepOutput:
        assert self.gate.wait(5)
        if isinstance(self.steps[0], Exception):  # a broken request fails every time it is stepped
            raise self.steps[0]
        output = self.steps.pop(0)
        self.in_pool = True
        self.log.append(self.name)
        self.stats.steps += 1
        self.stats.output_tokens += len(output.token_ids)
        self.stats.draft_tokens += 2
        self.stats.accepted_draft_tokens += len(output.token_ids) - 1
        self.finish_reason = output.finish_reason
        self.finished = output.finish_reason is not None
        if output.logprobs is not None:  # as Generation.commit sums them
            chosen = sum(position[t].logprob for position, t in zip(output.logprobs, output.token_ids))
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + chosen
        return output

    def close(self, reason: str = "cancelled") -> None:
        self.closed = True


class ScriptedDecoder:
    """start() hands out the script registered for the prompt's first character."""

    trie = None

    def __init__(self, scripts: dict[str, list[StepOutput]]):
        self.scripts = scripts
        self.order: list[str] = []
        self.batches: list[list[str]] = []  # the generations of each step() call
        self.generations: dict[str, ScriptedGeneration] = {}
        self.gate = threading.Event()  # steps wait for it; open unless a test closes it
        self.gate.set()
        self.kv_room: int | None = None  # most KV entries all running requests may hold (None: any)
        self.scheduler: Scheduler[Any] = Scheduler(self.fits, step_token_budget=128)
        self.checked: list[bool] = []  # each start's `checked`

    def fits(self, longest: list[int]) -> bool:
        return self.kv_room is None or sum(longest) <= self.kv_room

    def start(
        self, prompt_ids, params, lookahead=None, request_id="", grammar=None, checked=False
    ) -> ScriptedGeneration:
        self.checked.append(checked)
        name = chr(prompt_ids[0])
        self.generations[name] = ScriptedGeneration(
            self.scripts[name], len(prompt_ids), self.order, name, self.gate
        )
        return self.generations[name]

    def start_samples(
        self, prompt_ids, params, lookahead=None, request_id="", grammar=None, checked=False
    ) -> list[ScriptedGeneration]:
        """Sample i runs the script registered for the prompt's first character and i ("a0", "a1"...)."""
        samples = []
        for index in range(params.samples):
            name = f"{chr(prompt_ids[0])}{index}"
            self.generations[name] = ScriptedGeneration(
                self.scripts[name], len(prompt_ids), self.order, name, self.gate
            )
            samples.append(self.generations[name])
        return samples

    def step(self, generations: list[ScriptedGeneration]) -> list[StepOutput]:
        """Like LookaheadDecoder.step: every generation advances by one step, in the given order."""
        self.batches.append([generation.name for generation in generations])
        return [generation.step() for generation in generations]


class Recorder:
    """Collects updates and log lines; on_step lets a test act between two steps."""

    def __init__(self):
        self.updates: list[Update] = []
        self.info: list[str] = []
        self.errors: list[str] = []
        self.finals = threading.Semaphore(0)

    def emit(self, update: Update) -> None:
        self.updates.append(update)
        if update.final:
            self.finals.release()

    def log_info(self, message: str) -> None:
        self.info.append(message)

    log_warn = log_info

    def log_error(self, message: str) -> None:
        self.errors.append(message)

    def wait_finals(self, count: int) -> None:
        for _ in range(count):
            assert self.finals.acquire(timeout=10), "the engine did not finish a request"

    def of(self, state: RequestState) -> list[Update]:
        return [u for u in self.updates if u.state is state]


def steps(*texts: str, reason: str = "length") -> list[StepOutput]:
    """One step per text, each holding len(text) or 1 tokens; the last one finishes."""
    return [
        StepOutput(list(range(max(1, len(t)))), t, reason if i == len(texts) - 1 else None)
        for i, t in enumerate(texts)
    ]


def submit(engine: Engine, prompt: str, **request: Any) -> RequestState:
    state = RequestState(id=f"req-{prompt}", sender=None)
    state.request = GenerationRequest(
        prompt=prompt,
        prompt_ids=tuple(tokenize(prompt)),
        sampling=request.pop("sampling", SamplingParams(max_tokens=8)),
        lookahead=LookaheadConfig(),
        **request,
    )
    engine.submit(state)
    return state


def run_engine(
    scripts: dict[str, list[StepOutput]], **engine: Any
) -> tuple[Engine, ScriptedDecoder, Recorder]:
    decoder, recorder = ScriptedDecoder(scripts), Recorder()
    return Engine(decoder, recorder.emit, recorder, **engine), decoder, recorder
