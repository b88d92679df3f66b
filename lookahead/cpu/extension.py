"""The C++ extension of the fast CPU path: which variants this CPU runs, and building them.

The kernel (csrc/packed_linear.cpp), the lean layers (csrc/lean_layer.cpp) and their bindings
are compiled by the machine's g++ (torch.utils.cpp_extension) once per variant into the kernels
cache (cache_dirs.py: .cache/kernels in a checkout; or $LOOKAHEAD_KERNEL_DIR); a build is keyed
by the sources, the flags and the torch version, so a changed source never loads a stale library.
Builds of one variant take turns under an flock the kernel drops when its holder dies, so a build
killed halfway (an OOM kill, a stopped stub) never leaves the next load waiting on its lock file.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from ..algorithm import retrieval
from ..cache_dirs import kernels_dir
from ..runtime import recycling

_SOURCES = Path(__file__).with_name("csrc")
_BUILD_ROOT = kernels_dir()
_COMMON_FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")


class FastPathUnavailable(RuntimeError):
    """This machine, model or device cannot run the fast CPU path."""


@dataclass(frozen=True)
class Variant:
    """One build of the extension for one instruction set."""

    name: str
    flags: tuple[str, ...]  # g++ target flags
    cpu_flags: frozenset[str]  # /proc/cpuinfo flags the CPU must have

    @property
    def module_name(self) -> str:
        return f"lookahead_cpu_{self.name}"


# Fastest first. The same sources build all of them (csrc/simd.h), with the same results bit for
# bit: AVX-512 with VNNI's int8 dot products (Intel Ice Lake / Sapphire Rapids on, AMD Zen 4 on),
# AVX2 with AVX-VNNI's (Intel Alder Lake on), plain AVX2 + FMA + F16C (e.g. AMD Zen 2 / 3).
VARIANTS = (
    Variant(
        "avx512",
        ("-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512vnni", "-mfma", "-mf16c"),
        frozenset({"avx512f", "avx512vl", "avx512bw", "avx512_vnni", "fma", "f16c"}),
    ),
    Variant(
        "avxvnni",
        ("-mavx2", "-mfma", "-mf16c", "-mavxvnni"),
        frozenset({"avx2", "fma", "f16c", "avx_vnni"}),
    ),
    Variant("avx2", ("-mavx2", "-mfma", "-mf16c"), frozenset({"avx2", "fma", "f16c"})),
)
# Names one variant to use instead of the fastest this CPU runs (e.g. to measure AVX2 on an
# AVX-512 machine).
VARIANT_ENV = "LOOKAHEAD_CPU_VARIANT"


def cpu_flags() -> frozenset[str]:
    """The flags this CPU reports (Linux /proc/cpuinfo); empty where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def runnable_variants() -> tuple[Variant, ...]:
    """The variants this CPU can run, fastest first."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ()
    flags = cpu_flags()
    return tuple(variant for variant in VARIANTS if variant.cpu_flags <= flags)


def chosen_variant() -> Variant:
    """The variant a model runs on: $LOOKAHEAD_CPU_VARIANT when set, else the fastest this CPU runs.

    Raises FastPathUnavailable when none runs (or the named one cannot)."""
    runnable = runnable_variants()
    forced = os.environ.get(VARIANT_ENV, "").strip()
    if forced:
        variant = variant_named(forced)
        if variant not in runnable:
            raise FastPathUnavailable(f"{VARIANT_ENV}={forced}: this CPU cannot run it ({why_no_variant()})")
        return variant
    if not runnable:
        raise FastPathUnavailable(why_no_variant())
    return runnable[0]


def why_no_variant() -> str:
    """Why no variant runs here (only meaningful when `runnable_variants()` is empty)."""
    machine = platform.machine()
    if machine.lower() not in ("x86_64", "amd64"):
        return f"the fast CPU path needs an x86-64 CPU, this one is {machine}"
    needed = " or ".join("+".join(sorted(v.cpu_flags)) for v in VARIANTS)
    has = sorted(cpu_flags() & frozenset().union(*(v.cpu_flags for v in VARIANTS)))
    return (
        f"the fast CPU path needs an x86-64 CPU with {needed}; this one has {'+'.join(has) or 'none of them'}"
    )


def variant_named(name: str) -> Variant:
    for variant in VARIANTS:
        if variant.name == name:
            return variant
    raise FastPathUnavailable(f"unknown CPU variant {name!r}: one of {', '.join(v.name for v in VARIANTS)}")


@cache
def load_extension(variant: Variant) -> ModuleType:
    """Compile (first time, ~1 min) or load one variant of the extension; from then on the
    runtime's recycling takes its top candidates from it and retrieval runs its draft search."""
    module = _build_or_load(variant)
    recycling.use_cpu_kernel(module.top_candidates)
    retrieval.use_native_search(module.best_first_draft)
    return module


def _build_or_load(variant: Variant) -> ModuleType:
    if variant not in runnable_variants():
        raise FastPathUnavailable(f"this CPU cannot run the {variant.name} variant")
    from torch.utils import cpp_extension

    try:
        import ninja

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    except ImportError:
        pass  # a ninja on PATH will do
    files = sorted(_SOURCES.glob("*.[ch]*"))
    flags = [*_COMMON_FLAGS, *variant.flags]
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in files) + " ".join(flags).encode()).hexdigest()
    build = _BUILD_ROOT / f"{variant.module_name}-torch{torch.__version__}-{digest[:12]}"
    build.mkdir(parents=True, exist_ok=True)
    try:
        with open(build / "build.flock", "w") as turn:
            fcntl.flock(turn, fcntl.LOCK_EX)
            # Every builder holds the flock first: a torch lock file seen here was left by one that died.
            (build / "lock").unlink(missing_ok=True)
            return cpp_extension.load(
                variant.module_name,
                [str(f) for f in files if f.suffix == ".cpp"],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build),
            )
    except (OSError, RuntimeError, ImportError) as error:
        raise FastPathUnavailable(
            f"could not build the {variant.name} kernel in {_SOURCES}: {error}"
        ) from error
