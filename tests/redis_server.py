"""A real redis-server on a free loopback port, started and stopped by the tests that need one."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench.local_redis import INSTALL_HINT, RedisServer


def require_redis_server() -> None:
    """Skip the test where redis-server is missing; under CI=true, fail it."""
    if shutil.which("redis-server") is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true, and {INSTALL_HINT}")
        pytest.skip(INSTALL_HINT)


@contextmanager
def running_redis(folder: Path) -> Iterator[RedisServer]:
    require_redis_server()
    server = RedisServer(folder).start()
    try:
        yield server
    finally:
        server.kill()
