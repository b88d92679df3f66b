"""python -m frontend: the OpenAI-compatible endpoint for a running tritonserver.

python -m frontend --grpc-url localhost:8001 --port 9000
python -m frontend --tokenizer path/to/hf-folder   # chat template of another model folder
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import uvicorn

from .app import create_app
from .edge import Limits, head_timeout_protocol


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m frontend", description=__doc__.split("\n\n")[0])
    parser.add_argument("--grpc-url", default="localhost:8001", help="tritonserver's gRPC host:port")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument(
        "--tokenizer",
        help="model (embedded name or folder) whose chat template every model uses "
        "(default: what each model serves: $LOOKAHEAD_MODEL, else its config.pbtxt model parameter)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    parser.add_argument(
        "--max-body-bytes", type=int, default=Limits.max_body_bytes, help="largest request body (413 beyond)"
    )
    parser.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=Limits.max_concurrent_requests,
        help="completions in flight at once (503 with Retry-After beyond)",
    )
    parser.add_argument(
        "--header-timeout-s",
        type=float,
        default=Limits.header_timeout_s,
        help="seconds a connection may take to send a request's head before it is closed",
    )
    args = parser.parse_args(argv)
    limits = Limits(args.max_body_bytes, args.max_concurrent_requests, args.header_timeout_s)
    app = create_app(args.grpc_url, args.tokenizer, limits)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        http=head_timeout_protocol(limits.header_timeout_s),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
