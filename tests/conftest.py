"""Fixtures every test may use, and the count of integration tests that really ran.

tests/unit/ needs no server; tests/integration/ starts real tritonservers (marked `integration`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lookahead.cpu.extension import VARIANTS, runnable_variants
from lookahead.models.embedded import DEFAULT_MODEL
from lookahead.models.loading import LoadedModel, load_model
from tests.helpers import ByteTokenizer, build_tiny_model

_INTEGRATION = Path(__file__).parent / "integration"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _INTEGRATION in Path(item.fspath).parents:
            item.add_marker(pytest.mark.integration)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """How many integration tests ran, so that a green run that skipped them all shows it."""
    counts = {}
    for outcome in ("passed", "failed", "error", "skipped"):
        reports = terminalreporter.stats.get(outcome, [])
        counts[outcome] = sum(
            1
            for r in reports
            if getattr(r, "when", "call") in ("call", "setup") and "integration" in r.keywords
        )
    ran = counts["passed"] + counts["failed"]
    terminalreporter.write_line(
        f"integration tests: {ran} ran ({counts['passed']} passed, {counts['failed']} failed), "
        f"{counts['error']} errors, {counts['skipped']} skipped"
    )
    runnable = runnable_variants()
    terminalreporter.write_line(
        "fast CPU path variants: "
        + ", ".join(
            f"{v.name} {'tested' if v in runnable else 'NOT tested (this CPU cannot run it)'}"
            for v in VARIANTS
        )
    )


@pytest.fixture
def tiny_model() -> Callable[..., Any]:
    """Factory: tiny_model("qwen2", vocab_size=49152) -> a seeded random-weight model."""
    return build_tiny_model


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    """SmolLM2-135M-Instruct in float32 on the CPU, loaded once per test session."""
    return load_model(DEFAULT_MODEL)


@pytest.fixture
def byte_tokenizer() -> ByteTokenizer:
    return ByteTokenizer()
