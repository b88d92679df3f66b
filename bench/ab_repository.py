"""A model repository that serves this checkout's models beside those of another git revision.

Each model of --ref is served under its name plus `_ref` (`baseline_ref`, `lookahead_ref`),
from a worktree of that revision, so one tritonserver and one load test measure both sides of an
A/B in the same run on the same machine. A model's entry point imports the code of the tree it
lives in (model.py puts its own repository first on sys.path), so each side runs its own code;
both read the converted models and kernel builds of this checkout's .cache (keyed by their
sources, so each revision still runs its own kernels).

    python -m bench ab_repository --ref main~3 --out results/ab
    python -m bench load_test --start-server --model-repository results/ab/model_repository \\
        --models baseline baseline_ref
"""

from __future__ import annotations

import argparse
import subprocess
from collections.abc import Sequence
from pathlib import Path

from lookahead import cache_dirs

REPO_ROOT = Path(__file__).resolve().parents[1]
# What a server's environment needs so that the other revision's models find this checkout's
# caches (the load test passes whichever of them the environment does not set).
SHARED_CACHE_ENV = {
    cache_dirs.MODELS_ENV: str(cache_dirs.models_dir()),
    cache_dirs.KERNELS_ENV: str(cache_dirs.kernels_dir()),
    cache_dirs.PACKED_ENV: str(cache_dirs.packed_dir()),
}


def build(ref: str, out: Path, models: Sequence[str]) -> Path:
    """A worktree of `ref` in out/ref and a model repository in out/model_repository holding links
    to this checkout's models and to the worktree's (suffixed `_ref`); returns the repository."""
    tree = out / "ref"
    if tree.exists():
        subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", str(tree)], check=True)
    subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", str(tree), ref], check=True)
    repository = out / "model_repository"
    repository.mkdir(parents=True, exist_ok=True)
    for name in models:
        for link, target in ((name, REPO_ROOT), (f"{name}_ref", tree.resolve())):
            path = repository / link
            if path.is_symlink() or path.exists():
                path.unlink()
            path.symlink_to(target / "model_repository" / name, target_is_directory=True)
    return repository


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", required=True, help="the git revision to compare against")
    parser.add_argument("--out", type=Path, default=Path("results/ab"))
    parser.add_argument("--models", nargs="+", default=["lookahead", "baseline"])
    args = parser.parse_args(argv)
    repository = build(args.ref, args.out.resolve(), args.models)
    print(f"model repository: {repository}")
    return 0
