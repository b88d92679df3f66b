"""A redis-server of our own on a free loopback port, without persistence (for the trie_sync tests
and bench/fleet.py; a real deployment runs its own Redis)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis

from launcher import free_port

INSTALL_HINT = "no redis-server on the PATH (scripts/bootstrap.sh installs it: apt-get install redis-server)"


class RedisServer:
    """One redis-server that keeps nothing on disk: a restart comes back empty."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 20.0) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError(INSTALL_HINT)
        self.folder.mkdir(parents=True, exist_ok=True)
        log = self.folder / "redis.log"
        arguments = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        with log.open("ab") as output:
            self.process = subprocess.Popen(
                [binary, *arguments, "--dir", str(self.folder)], stdout=output, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.client().ping()
                return self
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"redis-server did not start: {log.read_text()}") from None
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
