"""A real redis-server on a free loopback port, started and stopped by the tests that need one."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.local_redis import INSTALL_HINT, RedisServer
from tests.helpers import unavailable


def require_redis_server() -> None:
    """Skip the test where redis-server is missing; under CI=true, fail it."""
    if shutil.which("redis-server") is None:
        unavailable(INSTALL_HINT)


@contextmanager
def running_redis(folder: Path) -> Iterator[RedisServer]:
    require_redis_server()
    server = RedisServer(folder).start()
    try:
        yield server
    finally:
        server.kill()
