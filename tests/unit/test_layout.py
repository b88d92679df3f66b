"""The layering holds: one concern per sub-package, imports only go down the layers (those for type
checkers too), the fast CPU path is optional, the Triton stub's package imports no CLI, and no
module reaches for another module's private names."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import TINY_DECODE_SCRIPT

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lookahead"
# Top-level modules of the library every layer may import: settings, the serving contract, caches,
# child processes that end with their parent.
BASE = {"config", "contract", "cache_dirs", "parent_death"}
# sub-package -> the sub-packages it may import from, besides BASE
ALLOWED = {
    "algorithm": {"algorithm"},
    "runtime": {"runtime", "algorithm", "structured"},
    "structured": {"structured", "algorithm"},
    "state": {"state", "algorithm"},
    "models": {"models", "runtime", "cpu", "algorithm"},
    "cpu": {"cpu", "runtime", "algorithm"},
}
# the project's packages, lowest first -> what each may import of the project
PROJECT = {
    "lookahead": {"lookahead"},  # the library
    "client": {"client", "lookahead.contract"},  # the SDK: no torch, no server code
    "backend": {"backend", "lookahead"},  # what runs in the Triton stub
    "frontend": {"frontend", "lookahead"},  # the OpenAI endpoint, a process of its own
    "launcher": {"launcher", "backend.drain", "lookahead"},  # starts and stops the processes
    "bench": {"bench", "lookahead", "client", "launcher"},  # measures all of it
}


def imports(path: Path, typing_too: bool = True) -> list[tuple[str, list[str], bool]]:
    """(imported module, names, at module level) of every import in one file of the project; those
    for type checkers only when typing_too."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    typing_only = {
        id(child)
        for node in tree.body
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        for child in ast.walk(node)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only and not typing_too:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            target, names = node.names[0].name, []
        else:
            continue
        found.append((target, names, id(node) in top_level))
    return found


def lookahead_imports(path: Path, typing_too: bool = True) -> list[tuple[str, list[str], bool]]:
    return [found for found in imports(path, typing_too) if found[0].split(".")[0] == "lookahead"]


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_each_layer_imports_only_the_layers_below_it(layer: str) -> None:
    for path in (PACKAGE / layer).rglob("*.py"):
        for target, names, _ in lookahead_imports(path):
            parts = [target.split(".")[1]] if "." in target else names  # `from .. import x`: x
            assert all(part in ALLOWED[layer] | BASE for part in parts), (
                f"{path.relative_to(PACKAGE)} imports {target}"
            )


def test_the_base_modules_import_only_each_other() -> None:
    assert {target for target, _, _ in lookahead_imports(PACKAGE / "config.py")} == set()
    assert {target for target, _, _ in lookahead_imports(PACKAGE / "cache_dirs.py")} == set()
    assert {target for target, _, _ in lookahead_imports(PACKAGE / "contract.py")} == {"lookahead.config"}
    assert {target for target, _, _ in lookahead_imports(PACKAGE / "parent_death.py")} == set()


@pytest.mark.parametrize("package", sorted(PROJECT))
def test_each_package_imports_only_the_packages_below_it(package: str) -> None:
    for path in (ROOT / package).rglob("*.py"):
        for target, _, _ in imports(path):
            if target.split(".")[0] not in PROJECT:
                continue  # not the project's
            allowed = PROJECT[package]
            assert any(target == a or target.startswith(a + ".") for a in allowed), (
                f"{path.relative_to(ROOT)} imports {target}"
            )


def test_the_stubs_package_imports_no_cli() -> None:
    """Everything model_repository/<model>/1/model.py reaches, at any depth, lazily or not."""
    entries = sorted(ROOT.glob("model_repository/*/1/model.py"))
    assert entries
    seen: set[Path] = set()
    todo = list(entries)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for target, names, _ in imports(path):
            for module in [target, *(f"{target}.{name}" for name in names)]:
                if module.split(".")[0] not in PROJECT:
                    continue
                for candidate in (
                    ROOT.joinpath(*module.split(".")).with_suffix(".py"),
                    ROOT.joinpath(*module.split("."), "__init__.py"),
                ):
                    if candidate.is_file():
                        todo.append(candidate)
    reached = sorted(path.relative_to(ROOT).as_posix() for path in seen)
    assert "backend/model.py" in reached
    for name in reached:
        assert name.split("/")[0] in ("model_repository", "backend", "lookahead"), f"the stub reaches {name}"
        assert Path(name).stem not in ("cli", "__main__"), f"the stub reaches {name}"
        assert "argparse" not in {t for t, _, _ in imports(ROOT / name)}, f"the stub reaches {name}, a CLI"


def test_the_algorithm_has_no_model_code() -> None:
    for path in (PACKAGE / "algorithm").rglob("*.py"):
        imported = {
            (node.module if isinstance(node, ast.ImportFrom) else node.names[0].name) or ""
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Import | ast.ImportFrom)
        }
        assert not {
            name for name in imported if name.split(".")[0] == "transformers" or name == "torch.nn"
        }, path


def test_only_model_loading_and_the_cli_reach_the_fast_path_when_it_is_there() -> None:
    users = {
        path.relative_to(PACKAGE).as_posix()
        for path in modules()
        if not path.is_relative_to(PACKAGE / "cpu")
        for target, _, top_level in lookahead_imports(path, typing_too=False)
        if target.startswith("lookahead.cpu") and not top_level
    }
    assert users == {"models/loading.py", "cli.py"}
    for path in modules():
        if not path.is_relative_to(PACKAGE / "cpu"):
            top = [
                t
                for t, _, top_level in lookahead_imports(path, typing_too=False)
                if top_level and t.startswith("lookahead.cpu")
            ]
            assert not top, f"{path} imports the fast path at module level"


def test_no_module_imports_another_modules_private_names() -> None:
    for path in modules():
        for target, names, _ in lookahead_imports(path):
            private = [name for name in names if name.startswith("_") and name != "__version__"]
            assert not private, f"{path.relative_to(PACKAGE)} imports {private} from {target}"


def test_module_imports_form_no_cycle() -> None:
    graph: dict[str, set[str]] = {}
    for path in modules():
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = {
            t for t, _, top_level in lookahead_imports(path, typing_too=False) if top_level and t != name
        }
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, ()):
            if nxt.startswith(node + "."):
                continue  # a package's __init__ re-exporting its own modules
            assert state.get(nxt) != 1, f"import cycle: {' -> '.join(trail + [nxt])}"
            if nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [node])


@pytest.mark.slow
def test_without_the_fast_path_package_the_stock_path_decodes_losslessly(tmp_path: Path) -> None:
    shutil.copytree(PACKAGE, tmp_path / "lookahead", ignore=shutil.ignore_patterns("cpu", "__pycache__"))
    script = (
        TINY_DECODE_SCRIPT
        % """
import lookahead
try:
    apply_execution_path(model, "packed")
    result["refused"] = ""
except RuntimeError as error:
    result["refused"] = str(error)
result["file"] = lookahead.__file__
result["cpu_loaded"] = any(m.startswith("lookahead.cpu") for m in sys.modules)
"""
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    finished = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300
    )
    assert finished.returncode == 0, finished.stderr
    result = json.loads(finished.stdout.strip().splitlines()[-1])
    assert result["file"] == str(tmp_path / "lookahead" / "__init__.py")
    assert (result["kernel"], result["prior"], result["cpu_loaded"]) == ("stock", None, False)
    assert result["execution"] == "stock linear layers (the fast CPU path (lookahead/cpu) is not installed)"
    assert result["refused"] == "linear_kernel packed: the fast CPU path (lookahead/cpu) is not installed"
    assert result["lookahead"] == result["plain"] and result["accepted"] > 0
