"""Starting and stopping the serving processes: tritonserver with the Python backend (backend/),
and the OpenAI-compatible endpoint (frontend/) beside it.

`python -m launcher` (cli.py) serves a model repository; tests and measurement tools start the
same processes through `start_server` (tritonserver.py) and `start_frontend` (frontend.py), each a
`ManagedProcess` (process.py): ready once its health URL answers, stopped on leaving a `with`.
"""

from launcher.frontend import Frontend, FrontendError, start_frontend
from launcher.process import ManagedProcess, free_port
from launcher.tritonserver import TritonServer, TritonServerError, find_tritonserver, start_server

__all__ = [
    "Frontend",
    "FrontendError",
    "ManagedProcess",
    "TritonServer",
    "TritonServerError",
    "find_tritonserver",
    "free_port",
    "start_frontend",
    "start_server",
]
