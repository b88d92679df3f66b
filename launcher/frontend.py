"""The endpoint as a child process beside a tritonserver (the launcher's, the tests' and the
load tools'): started in its own session, ready once /health answers, stopped with SIGTERM."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType


class FrontendError(RuntimeError):
    """The endpoint exited or did not become ready."""


class Frontend:
    def __init__(self, process: subprocess.Popen, port: int, log_file: Path | None):
        self.process = process
        self.port = port
        self.log_file = log_file

    @property
    def url(self) -> str:
        """The base URL an OpenAI client takes."""
        return f"http://localhost:{self.port}/v1"

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.is_ready():
            if self.process.poll() is not None:
                raise FrontendError(
                    f"the OpenAI endpoint exited with code {self.process.returncode}{self._log()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise FrontendError(f"the OpenAI endpoint was not ready after {timeout_s:.0f} s{self._log()}")
            time.sleep(0.25)

    def _log(self) -> str:
        if self.log_file is None:
            return ""
        try:
            return f"; log {self.log_file}:\n" + "\n".join(
                self.log_file.read_text(errors="replace").splitlines()[-20:]
            )
        except OSError:
            return ""

    def stop(self, timeout_s: float = 15.0) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def __enter__(self) -> Frontend:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def start_frontend(
    grpc_url: str,
    port: int,
    *,
    log_file: Path | None = None,
    tokenizer: str | None = None,
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 300.0,
) -> Frontend:
    """Start `python -m frontend` for the tritonserver at grpc_url and wait until it answers
    /health (which needs that server ready); its output goes to log_file, else to ours."""
    command = [sys.executable, "-m", "frontend", "--grpc-url", grpc_url, "--port", str(port)]
    if tokenizer:
        command += ["--tokenizer", tokenizer]
    output = open(log_file, "ab") if log_file else None
    try:
        process = subprocess.Popen(
            command,
            stdout=output,
            stderr=subprocess.STDOUT if output else None,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    finally:
        if output:
            output.close()
    frontend = Frontend(process, port, log_file)
    try:
        frontend.wait_ready(ready_timeout_s)
    except BaseException:
        frontend.stop()
        raise
    return frontend
