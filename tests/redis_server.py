"""A real redis-server on a free loopback port, started and stopped by the tests that need one."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from backend.launcher import free_port


def redis_binary() -> str:
    """redis-server's path; skips the test where it is missing, fails it under CI=true."""
    binary = shutil.which("redis-server")
    if binary is None:
        message = (
            "no redis-server on the PATH (scripts/bootstrap.sh installs it: apt-get install redis-server)"
        )
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true, and {message}")
        pytest.skip(message)
    return binary


class RedisServer:
    """One redis-server without persistence: a restart comes back empty."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [
                redis_binary(),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.folder),
            ],
            stdout=(self.folder / "redis.log").open("ab"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                self.client().ping()
                return self
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis-server did not start: {(self.folder / 'redis.log').read_text()}"
                    )
                time.sleep(0.05)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5)

    def kill(self) -> None:
        """SIGKILL: as if the machine holding Redis died."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait()

    def pause(self) -> None:
        """SIGSTOP: Redis accepts connections and answers nothing (a hung or very slow server)."""
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)


@contextmanager
def running_redis(folder: Path) -> Iterator[RedisServer]:
    server = RedisServer(folder).start()
    try:
        yield server
    finally:
        server.kill()
