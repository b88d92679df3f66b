"""Integration tests start real tritonservers. Where none can start they skip, except under
CI=true, where that is a failure: a green CI run means they ran."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from launcher import TritonServer, TritonServerError, find_tritonserver
from tests.helpers import unavailable
from tests.integration.servers import copy_repository, launch


@pytest.fixture(scope="session", autouse=True)
def tritonserver_installed() -> None:
    try:
        find_tritonserver()
    except TritonServerError as error:
        unavailable(f"no tritonserver can start: {error}")


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """One tritonserver (lookahead + baseline, a warm-up corpus) shared by the modules that need one."""
    root = tmp_path_factory.mktemp("shared")
    repository = copy_repository(
        root / "repository", root / "state", ("lookahead", "baseline"), warmup_corpus="lookahead/warmup.jsonl"
    )
    corpus = repository / "lookahead" / "warmup.jsonl"  # relative paths start at the repository
    corpus.write_text(json.dumps({"text": "def add(a, b):\n    return a + b\n"}) + "\n")
    with launch(repository, root / "server.log") as running:
        yield running
