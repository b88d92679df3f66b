"""`python -m bench NAME [ARGS]`: run one measurement; `python -m bench --help` lists them."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from bench import BENCHMARKS


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    lines = [f"  {name:<{width}}  {summary}" for name, summary in BENCHMARKS.items()]
    header = "usage: python -m bench NAME [ARGS]   (python -m bench NAME --help: its arguments)"
    return "\n".join([header, "", *lines])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"error: no benchmark {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"bench.{name}")
    sys.argv[0] = f"python -m bench {name}"  # argparse's prog
    return module.main(rest) or 0


if __name__ == "__main__":
    raise SystemExit(main())
