"""`python -m lookahead prepare MODEL`: after it, loading the model searches no integer form."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lookahead.cli as cli
from lookahead.cpu import integer_forms
from lookahead.cpu.extension import runnable_variants
from lookahead.cpu.packed_linear import linear_groups
from lookahead.models.loading import load_model
from tests.helpers import build_tiny_model, unavailable


@pytest.fixture(autouse=True)
def a_kernel_variant_runs() -> None:
    """prepare searches integer forms for the packed kernel only."""
    if not runnable_variants():
        unavailable("this CPU runs no variant of the packed kernel")


@pytest.fixture
def tiny_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tiny Llama folder (no tokenizer) and an empty integer-form cache."""
    monkeypatch.setattr(integer_forms, "FORMS_DIR", tmp_path / "packed")
    folder = tmp_path / "tiny"
    build_tiny_model("llama").save_pretrained(folder)
    return folder


def test_prepare_searches_every_packed_matrix_once_so_loads_search_none(
    tiny_folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    assert cli.main(["prepare", str(tiny_folder)]) == 0
    out, err = capsys.readouterr()
    assert out.endswith(f"{tiny_folder}: integer forms cached\n")
    groups = linear_groups(build_tiny_model("llama"))
    # q/k/v and gate/up fused, o_proj and down_proj alone, per layer; the output layer alone.
    assert len(groups) == 2 * 4 + 1
    assert f"{len(groups)}/{len(groups)}" in err  # the progress bar reached the end
    assert len(list((integer_forms.FORMS_DIR).glob("*.safetensors"))) == len(groups)

    def no_search(weight: torch.Tensor) -> None:
        raise AssertionError("a load searched although prepare had")

    monkeypatch.setattr(integer_forms, "exact_integer_form", no_search)
    loaded = load_model(str(tiny_folder), linear_kernel="packed", require_tokenizer=False)
    assert loaded.linear_kernel == "packed"


def test_prepare_refuses_what_is_neither_an_embedded_model_nor_a_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert cli.main(["prepare", str(tmp_path / "nothing")]) == 2
    assert "neither embedded models" in capsys.readouterr().err


def test_a_build_killed_halfway_leaves_no_lock_that_stalls_the_next_load() -> None:
    """torch's build lock file, left by a builder that died, must not make the next load wait."""
    import subprocess
    import sys

    from lookahead.cpu.extension import chosen_variant, load_extension

    build = Path(load_extension(chosen_variant()).__file__).parent
    (build / "lock").touch()  # what a builder killed inside cpp_extension.load leaves behind
    try:
        done = subprocess.run(
            [sys.executable, "-c", "from lookahead.cpu.extension import *; load_extension(chosen_variant())"],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        stale = (build / "lock").exists()
        (build / "lock").unlink(missing_ok=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not stale
