"""The package layout holds: one concern per sub-package, imports only go down the layers, the fast
CPU path is optional, and no module reaches for another module's private names."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lookahead"
# sub-package -> the sub-packages (and top-level modules) it may import from
ALLOWED = {
    "algorithm": {"algorithm", "config"},
    "runtime": {"runtime", "algorithm", "config", "structured"},
    "structured": {"structured", "algorithm", "config"},
    "state": {"state", "algorithm", "config"},
    "models": {"models", "runtime", "config", "cpu"},
    "cpu": {"cpu", "runtime", "config"},
}


def lookahead_imports(path: Path) -> list[tuple[str, list[str], bool]]:
    """(imported lookahead module, names, at module level) of every import in one file, but those
    for type checkers only."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
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
        if id(node) in typing_only:
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
        if target == "lookahead" or target.startswith("lookahead."):
            found.append((target, names, id(node) in top_level))
    return found


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_each_layer_imports_only_the_layers_below_it(layer: str) -> None:
    for path in (PACKAGE / layer).rglob("*.py"):
        for target, _, _ in lookahead_imports(path):
            part = target.split(".")[1] if "." in target else ""
            assert part in ALLOWED[layer], f"{path.relative_to(PACKAGE)} imports {target}"


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
        for target, _, top_level in lookahead_imports(path)
        if target.startswith("lookahead.cpu") and not top_level
    }
    assert users == {"models/loading.py", "cli.py"}
    for path in modules():
        if not path.is_relative_to(PACKAGE / "cpu"):
            top = [
                t
                for t, _, top_level in lookahead_imports(path)
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
        graph[name] = {t for t, _, top_level in lookahead_imports(path) if top_level and t != name}
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
    script = """
import json, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import lookahead
from lookahead import LookaheadDecoder, NGramTrie, SamplingParams
from lookahead.models.loading import apply_execution_path

class Silent:  # token ids only: the detokenizer decodes to nothing
    def decode(self, ids, skip_special_tokens=True):
        return ""

torch.manual_seed(0)
config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
model = LlamaForCausalLM(config).eval()
kernel, execution, prior = apply_execution_path(model, "auto")
try:
    apply_execution_path(model, "packed")
    refused = ""
except RuntimeError as error:
    refused = str(error)
prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
ids = torch.tensor([prompt])
plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                       pad_token_id=0)[0, len(prompt):].tolist()
trie = NGramTrie()
trie.insert(prompt + plain)
params = SamplingParams(max_tokens=16, ignore_eos=True)
out, stats = LookaheadDecoder(model, Silent(), trie).generate(prompt, params)
print(json.dumps({"kernel": kernel, "execution": execution, "prior": prior, "refused": refused,
                  "plain": plain, "lookahead": out, "accepted": stats.accepted_draft_tokens,
                  "file": lookahead.__file__,
                  "cpu_loaded": any(m.startswith("lookahead.cpu") for m in sys.modules)}))
"""
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
