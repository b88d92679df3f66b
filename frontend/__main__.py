"""python -m frontend: the OpenAI-compatible endpoint for a running tritonserver.

python -m frontend --grpc-url localhost:8001 --port 9000
python -m frontend --tokenizer path/to/hf-folder   # chat template of another model folder
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import uvicorn

from .app import create_app


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
    args = parser.parse_args(argv)
    app = create_app(args.grpc_url, args.tokenizer)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
