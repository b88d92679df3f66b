"""The endpoint as a child process beside a tritonserver (the launcher's, the tests' and the
load tools'): started in its own session, ready once /health answers, stopped with SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from lookahead.parent_death import ending_with_this_process

from .process import ManagedProcess, ProcessError


class FrontendError(ProcessError):
    """The endpoint exited or did not become ready."""


class Frontend(ManagedProcess):
    name = "the OpenAI endpoint"
    error = FrontendError
    stop_timeout_s = 6.0  # uvicorn's graceful shutdown takes at most 5 s
    parent_death_signal = signal.SIGTERM  # it ends its streams, then exits

    def __init__(self, process: subprocess.Popen, port: int, log_file: Path | None):
        super().__init__(process, log_file, f"http://127.0.0.1:{port}/health")
        self.port = port

    @property
    def url(self) -> str:
        """The base URL an OpenAI client takes."""
        return f"http://localhost:{self.port}/v1"


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
            preexec_fn=ending_with_this_process(Frontend.parent_death_signal),
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
