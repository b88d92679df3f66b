"""`pip install .` gives a working library and client: the wheel built from the project's sources,
installed into a fresh environment outside the checkout, decodes losslessly, building the fast
CPU path from its installed C++ sources.

The fresh environment borrows this one's installed dependencies (a .pth line naming its
site-packages, whose own .pth files, the checkout's among them, are not read), so nothing is
downloaded; the project itself comes only from the wheel, and the child checks that.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from lookahead.cpu.extension import runnable_variants
from tests.helpers import TINY_DECODE_SCRIPT

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("lookahead", "backend", "client", "frontend", "launcher")

CHILD = (
    TINY_DECODE_SCRIPT
    % """
import importlib
from pathlib import Path
from lookahead.cpu import extension
checkout = Path(sys.argv[1])
result["leaks"] = [p for p in sys.path if p and (Path(p) / "lookahead").resolve() == checkout / "lookahead"]
names = ["lookahead", "lookahead.algorithm.drafters", "lookahead.runtime.scheduler",
         "lookahead.runtime.runner", "lookahead.models.loading", "lookahead.structured",
         "lookahead.state.sync", "lookahead.cpu.fast_path", "lookahead.contract", "client",
         "client.api", "launcher", "backend.config", "frontend.app"]
result["files"] = {name: importlib.import_module(name).__file__ for name in names}
result["sources"] = str(extension._SOURCES)
result["kernels_dir"] = str(extension.kernels_dir())
result["built"] = sorted(p.name for p in extension.kernels_dir().glob("lookahead_cpu_*/*.so"))
"""
)


@pytest.mark.slow
def test_the_wheel_installs_and_decodes_outside_the_checkout(tmp_path: Path) -> None:
    source = tmp_path / "source"  # built from a copy, so the checkout gets no build/ or egg-info
    source.mkdir()
    for name in ("pyproject.toml", "requirements.txt"):
        shutil.copy2(ROOT / name, source / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(source),
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(tmp_path / "dist"),
        ]
    )
    (wheel,) = (tmp_path / "dist").glob("triton_lookahead-*.whl")

    env_dir = tmp_path / "env"
    run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)])
    python = env_dir / "bin" / "python"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    ours = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (site / "dependencies.pth").write_text("".join(f"{path}\n" for path in ours))
    run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)])

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("LOOKAHEAD_")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    result = json.loads(run([str(python), "-c", CHILD, str(ROOT)], cwd=tmp_path, env=env).splitlines()[-1])
    assert result["leaks"] == []
    assert all(Path(file).is_relative_to(site) for file in result["files"].values()), result["files"]
    assert Path(result["sources"]).is_relative_to(site)
    assert sorted(p.name for p in Path(result["sources"]).iterdir()) == sorted(
        p.name for p in (ROOT / "lookahead" / "cpu" / "csrc").iterdir()
    )
    assert result["lookahead"] == result["plain"] and result["accepted"] > 0
    if runnable_variants():  # built at first use, from the installed sources, into the user's cache
        assert result["kernel"] == "integer"
        assert result["kernels_dir"] == str(tmp_path / "cache" / "lookahead" / "kernels")
        assert result["built"] == [f"lookahead_cpu_{runnable_variants()[0].name}.so"]
    else:
        assert result["kernel"] == "stock"
    help_text = run([str(python), "-m", "client", "--help"], cwd=tmp_path, env=env)
    assert help_text.startswith("usage: python -m client")


def run(command: list[str], **kwargs) -> str:
    finished = subprocess.run(command, capture_output=True, text=True, timeout=1500, **kwargs)
    assert finished.returncode == 0, f"{command[:4]}: {finished.stderr[-3000:]}"
    return finished.stdout
