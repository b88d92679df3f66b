"""Acceptance estimates on recorded steps: the class calibration against the acceptance predictor.

Recording: the decoder (library defaults, greedy, up to the model's end of turn) runs a prompt set's held-out
prompts (from `--offset` on, as the server benchmarks send them: a chat set in the model's chat
template) `--concurrency` at a time, with a fresh shared trie, and a recorder keeps every step of
every request: the whole draft its drafter retrieved (each node's probability, origins and
evidence), the nodes the step's plan kept and the ones the model accepted. Greedy output is
fixed, so once a request is done every retrieved node is labelled exactly: it lies on the
output or not, whatever a plan would have kept. Steps go to `--record` (JSON lines) and can be
evaluated again without the model (`--replay`).

Evaluation replays the steps in order through each estimator, as the runtime drives it: predict,
then learn from what the run's plan verified. For each, on the nodes the run tested (kept, with
their parent accepted) and on every retrieved node whose parent lies on the output: the
log-loss and the Brier score of the predicted conditional acceptance, and predicted against
observed acceptance per decile of the prediction. Then each estimator plans every recorded step
again (`plan_step` over the retrieved draft, alone as at concurrency 1, with the run's learned
forward-cost curve): the tokens a step would yield, its width and tokens per unit of forward
cost. Positions are the run's, so the planning numbers estimate, step for step, what the
estimator's plans would yield there. It also times the predictor: per node and per step.

    python -m bench acceptance --prompt-set code_edit --record results/acceptance/ce.jsonl
    python -m bench acceptance --replay results/acceptance/ce.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from bench.prompt_sets import PROMPT_SET_NAMES, load_prompt_set
from lookahead.algorithm.acceptance import AcceptancePredictor, verified_nodes
from lookahead.algorithm.draft import Draft, Evidence
from lookahead.algorithm.planner import (
    INITIAL_CALIBRATION,
    REQUEST_CALIBRATION_RATE,
    STOCK_CPU_PRIOR,
    Calibration,
    CostModel,
    plan_step,
)
from lookahead.algorithm.trie import NGramTrie
from lookahead.config import DRAFTER_NAMES, DecoderConfig, LookaheadConfig, SamplingParams
from lookahead.models.chat import chat_prompt
from lookahead.models.embedded import DEFAULT_MODEL
from lookahead.models.loading import freeze_loaded_objects, load_model
from lookahead.runtime.decoder import LookaheadDecoder

DECILES = 10


@dataclass
class Step:
    """One verified step of one request: the retrieved draft, what was fed of it, what was accepted."""

    request: int
    position: int  # tokens (prompt and output) before the draft's root's successors
    draft: Draft  # as retrieved
    kept: list[int]  # retrieved nodes the plan fed (root included)
    accepted: list[int]  # retrieved nodes the model accepted
    truth: list[int]  # retrieved nodes on the output (labelled once the request is done)

    def to_json(self) -> dict[str, Any]:
        d = self.draft
        return {
            "request": self.request,
            "position": self.position,
            "tokens": d.tokens,
            "parents": d.parents,
            "probs": [round(p, 6) for p in d.probs],
            "origins": d.origins,
            "evidence": [list(e) for e in d.evidence],
            "kept": self.kept,
            "accepted": self.accepted,
            "truth": self.truth,
        }

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> Step:
        draft = Draft(
            row["tokens"],
            row["parents"],
            row["probs"],
            row["origins"],
            [Evidence(*e) for e in row["evidence"]],
        )
        return cls(row["request"], row["position"], draft, row["kept"], row["accepted"], row["truth"])

    @property
    def fed(self) -> Draft:
        return self.draft if len(self.kept) == len(self.draft) else self.draft.subset(self.kept)

    @property
    def fed_accepted(self) -> list[int]:
        where = {node: i for i, node in enumerate(self.kept)}
        return [where[node] for node in self.accepted]


def _paths(draft: Draft) -> list[tuple[int, ...]]:
    """Every node's tokens below the root."""
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, len(draft)):
        paths.append((*paths[draft.parents[i]], draft.tokens[i]))
    return paths


def on_output(draft: Draft, continuation: Sequence[int]) -> list[int]:
    """The nodes whose path is a prefix of `continuation` (the root's successors)."""
    paths = _paths(draft)
    return [i for i in range(1, len(draft)) if tuple(continuation[: len(paths[i])]) == paths[i]]


class StepRecorder:
    """The decoder's recorder: keeps each step, then labels a finished request's steps."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.request_of: dict[int, int] = {}
        self.texts: dict[int, list[int]] = {}  # each finished request's prompt and output

    def __call__(self, gen: Any, fed: Draft, verdict: Any) -> None:
        retrieved = gen.retrieved if gen.retrieved is not None else fed
        paths = {path: i for i, path in enumerate(_paths(retrieved))}
        fed_paths = _paths(fed)
        kept = sorted(paths[path] for path in fed_paths)
        accepted = [paths[fed_paths[node]] for node in verdict.accepted_nodes]
        request = self.request_of.setdefault(id(gen), len(self.request_of))
        self.steps.append(Step(request, len(gen.ids), retrieved, kept, accepted, []))

    def label(self, gen: Any) -> None:
        request = self.request_of[id(gen)]
        self.texts[request] = list(gen.ids)
        for step in self.steps:
            if step.request == request and not step.truth:
                step.truth = on_output(step.draft, gen.ids[step.position :])


def record(args: argparse.Namespace) -> tuple[list[Step], dict[str, Any]]:
    """Run the prompts through the decoder: every step, and the run's header (the execution
    path's cost curve, the one the decoder learned, every request's text)."""
    loaded = load_model(args.model, threads=args.threads)
    freeze_loaded_objects()
    prompt_set = load_prompt_set(args.prompt_set)
    texts = list(prompt_set.prompts[args.offset : args.offset + args.prompts])
    if prompt_set.use_chat_template:
        texts = [chat_prompt(loaded.tokenizer, [{"role": "user", "content": text}]) for text in texts]
    prompts = [loaded.tokenizer.encode(text) for text in texts]
    config = LookaheadConfig(drafter=args.drafter)
    decoder = LookaheadDecoder.for_model(loaded, NGramTrie(), config, DecoderConfig())
    recorder = StepRecorder()
    decoder.recorder = recorder
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    waiting = list(reversed(prompts))
    running: list[Any] = []
    while waiting or running:
        while waiting and len(running) < args.concurrency:
            running.append(decoder.start(waiting.pop(), params))
        decoder.step(running)
        for gen in [gen for gen in running if gen.finished]:
            recorder.label(gen)
            running.remove(gen)
    header = {
        "curve": dict(loaded.cost_prior or STOCK_CPU_PRIOR),
        "learned": {q: decoder.cost.relative(q) for q in (1, 2, 4, 8, 16, 32, 64, 128)},
        "texts": recorder.texts,
        "drafter": args.drafter,
    }
    return recorder.steps, header


class Estimator(Protocol):
    def conditionals(self, request: int, draft: Draft) -> np.ndarray: ...
    def weights(self, request: int, draft: Draft) -> list[float]: ...
    def observe(self, request: int, draft: Draft, accepted: list[int]) -> None: ...


class ClassCalibration:
    """Today's estimates: the decoder's class calibration and each request's copy of it."""

    name = "class calibration"

    def __init__(self) -> None:
        self.shared = Calibration.uniform(INITIAL_CALIBRATION)
        self.own: dict[int, Calibration] = {}

    def _of(self, request: int) -> Calibration:
        if request not in self.own:
            self.own[request] = self.shared.for_request(REQUEST_CALIBRATION_RATE)
        return self.own[request]

    def weights(self, request: int, draft: Draft) -> list[float]:
        return self._of(request).calibrated(draft)

    def conditionals(self, request: int, draft: Draft) -> np.ndarray:
        weights = np.asarray(self.weights(request, draft))
        parents = np.asarray(draft.parents[1:])
        return weights[1:] / np.maximum(weights[parents], 1e-12)

    def observe(self, request: int, draft: Draft, accepted: list[int]) -> None:
        for calibration in (self.shared, self._of(request)):
            calibration.observe(draft, accepted)


class Predictor:
    """The acceptance predictor and each request's view of it."""

    name = "acceptance predictor"

    def __init__(self) -> None:
        self.predictor = AcceptancePredictor()
        self.own: dict[int, Any] = {}

    def _of(self, request: int) -> Any:
        if request not in self.own:
            self.own[request] = self.predictor.for_request()
        return self.own[request]

    def weights(self, request: int, draft: Draft) -> list[float]:
        return self._of(request).calibrated(draft)

    def conditionals(self, request: int, draft: Draft) -> np.ndarray:
        return self._of(request).conditionals(draft)

    def observe(self, request: int, draft: Draft, accepted: list[int]) -> None:
        self._of(request).observe(draft, accepted)


@dataclass
class Scores:
    """Predictions and outcomes of one estimator on one set of nodes."""

    predicted: list[float]
    observed: list[bool]

    def add(self, predicted: np.ndarray, observed: np.ndarray) -> None:
        self.predicted.extend(predicted.tolist())
        self.observed.extend(observed.tolist())

    def log_loss(self) -> float:
        p = np.clip(np.asarray(self.predicted), 1e-4, 1 - 1e-4)
        y = np.asarray(self.observed, dtype=float)
        return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))) if len(p) else math.nan

    def brier(self) -> float:
        p, y = np.asarray(self.predicted), np.asarray(self.observed, dtype=float)
        return float(np.mean((p - y) ** 2)) if len(p) else math.nan

    def deciles(self) -> list[tuple[float, float, int]]:
        """(mean predicted, observed rate, nodes) per tenth of the nodes ordered by prediction."""
        order = np.argsort(self.predicted, kind="stable")
        p, y = np.asarray(self.predicted)[order], np.asarray(self.observed, dtype=float)[order]
        return [
            (float(a.mean()), float(b.mean()), len(a))
            for a, b in zip(np.array_split(p, DECILES), np.array_split(y, DECILES))
            if len(a)
        ]


@dataclass
class Planning:
    """What an estimator's plans yield on the recorded positions."""

    tokens: float = 0.0
    width: float = 0.0
    cost: float = 0.0
    steps: int = 0


def evaluate(
    steps: Sequence[Step], curve: dict[int, float], estimators: Sequence[Callable[[], Any]]
) -> dict[str, Any]:
    """Replay the steps through each estimator (see the module docstring)."""
    results = {}
    for make in estimators:
        estimator = make()
        cost = CostModel(dict(curve))  # learns its yield rate from the replayed plans, as the decoder does
        on_tested, on_tree = Scores([], []), Scores([], [])
        planning = Planning()
        seconds, nodes = 0.0, 0
        for step in steps:
            draft = step.draft
            if len(draft) > 1:
                started = time.perf_counter()
                weights = estimator.weights(step.request, draft)
                seconds += time.perf_counter() - started
                nodes += len(draft) - 1
                conditionals = estimator.conditionals(step.request, draft)
                truth = np.zeros(len(draft), dtype=bool)
                truth[0] = True
                truth[step.truth] = True
                parents = np.asarray(draft.parents[1:])
                reachable = truth[parents]
                on_tree.add(conditionals[reachable], truth[1:][reachable])
                fed = step.fed
                if len(fed) > 1:
                    mask, accepted = verified_nodes(fed, step.fed_accepted)
                    fed_conditionals = estimator.conditionals(step.request, fed)
                    on_tested.add(fed_conditionals[mask], accepted[mask])
                (plan,) = plan_step([draft], [_Fixed(weights)], [True], cost, 128)
                paths = set(_paths(plan))
                gained = sum(1 for node in step.truth if _paths(draft)[node] in paths)
                planning.tokens += 1 + gained
                planning.width += len(plan)
                planning.cost += cost.relative(len(plan))
                planning.steps += 1
                cost.observe_yield(1 + gained, len(plan))
                started = time.perf_counter()
                estimator.observe(step.request, step.fed, step.fed_accepted)
                seconds += time.perf_counter() - started
            else:
                planning.tokens += 1
                planning.width += 1
                planning.cost += 1.0
                planning.steps += 1
        results[estimator.name] = {
            "tested": on_tested,
            "tree": on_tree,
            "planning": planning,
            "us_per_node": 1e6 * seconds / max(nodes, 1),
            "us_per_step": 1e6 * seconds / max(len(steps), 1),
        }
    return results


class _Fixed:
    """Precomputed weights in the planner's interface."""

    def __init__(self, weights: list[float]) -> None:
        self._weights = weights

    def calibrated(self, draft: Draft) -> list[float]:
        return self._weights


def report(steps: Sequence[Step], results: dict[str, Any], curve: dict[int, float]) -> str:
    """The tables: scores and planning per estimator, then calibration per decile."""
    run_tokens = sum(1 + len(step.accepted) for step in steps)
    in_tree = sum(1 + len(step.truth) for step in steps)
    cost = CostModel(dict(curve))
    width = sum(len(step.kept) for step in steps)
    run_cost = sum(cost.relative(len(step.kept)) for step in steps)
    lines = [
        f"{len(steps)} steps of {len({s.request for s in steps})} requests: the run yielded "
        f"{run_tokens / len(steps):.2f} tokens a step at a width of {width / len(steps):.2f} "
        f"({run_tokens / run_cost:.3f} tokens per unit of cost); the retrieved trees held "
        f"{in_tree / len(steps):.2f}",
        "",
        "| estimator | nodes | log-loss | Brier | plan: tokens/step | plan: width "
        "| plan: tokens per cost | µs/node | µs/step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, result in results.items():
        plan = result["planning"]
        for label, nodes in (("tested", "tested nodes"), ("tree", "every node below the output")):
            scores = result[label]
            cells = [f"{name} ({nodes})", str(len(scores.predicted)), f"{scores.log_loss():.4f}"]
            cells.append(f"{scores.brier():.4f}")
            if label == "tested":
                cells += [f"{plan.tokens / plan.steps:.2f}", f"{plan.width / plan.steps:.2f}"]
                cells += [f"{plan.tokens / plan.cost:.3f}", f"{result['us_per_node']:.2f}"]
                cells.append(f"{result['us_per_step']:.1f}")
            else:
                cells += [""] * 5
            lines.append("| " + " | ".join(cells) + " |")
    titles = {"tested": "tested nodes", "tree": "every retrieved node whose parent lies on the output"}
    for label, title in titles.items():
        lines += ["", f"Calibration on {title}: mean predicted / observed acceptance per decile", ""]
        names = list(results)
        lines.append("| decile | " + " | ".join(names) + " |")
        lines.append("|---" * (len(names) + 1) + "|")
        tables = [results[name][label].deciles() for name in names]
        for d in range(max(len(t) for t in tables)):
            cells = [f"{t[d][0]:.3f} / {t[d][1]:.3f}" if d < len(t) else "" for t in tables]
            lines.append(f"| {d + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-set", default="code_edit", choices=PROMPT_SET_NAMES)
    parser.add_argument(
        "--offset", type=int, default=100, help="first prompt (held out from the others' slices)"
    )
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument(
        "--ignore-eos", action="store_true", help="generate max-tokens tokens, past the end of turn"
    )
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--drafter", default="trie", choices=DRAFTER_NAMES)
    parser.add_argument("--record", type=Path, help="write the recorded steps here (JSON lines)")
    parser.add_argument(
        "--replay", type=Path, help="evaluate steps recorded before instead of running the model"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replay:
        lines = args.replay.read_text(encoding="utf-8").splitlines()
        header = json.loads(lines[0])
        steps = [Step.from_json(json.loads(line)) for line in lines[1:]]
    else:
        steps, header = record(args)
        if args.record:
            args.record.parent.mkdir(parents=True, exist_ok=True)
            rows = [json.dumps(header)] + [json.dumps(step.to_json()) for step in steps]
            args.record.write_text("\n".join(rows) + "\n", encoding="utf-8")
    curve = {int(q): c for q, c in header["curve"].items()}
    results = evaluate(steps, curve, [ClassCalibration, Predictor])
    print(report(steps, results, curve))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
