"""TritonPythonModel: the Triton entry points, wiring config, requests, engine and responses.

Each model's `1/model.py` re-exports this class, so every model in the repository runs the
same code and differs only in its config.pbtxt `parameters`. Three threads per instance:
Triton's, which only validates and enqueues (`execute` returns None at once); the engine
thread, the only one touching the model; and the response thread, the only one calling a
response sender. A metrics thread (MetricWriter) applies Prometheus updates when they are enabled.
"""

from __future__ import annotations

import gc
import json
import os
import re
import threading
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from lookahead.contract import DEFAULT_MAX_PROMPT_TOKENS
from lookahead.models.checks import UnsupportedModelError, check_tree_attention
from lookahead.models.embedded import EmbeddedModelError
from lookahead.models.loading import LoadedModel, freeze_loaded_objects, load_model
from lookahead.models.prompt_bytes import prompt_byte_limit
from lookahead.runtime.decoder import LookaheadDecoder
from lookahead.state.keeper import TrieKeeper
from lookahead.state.persistence import claim_snapshot, load_snapshot
from lookahead.state.sync import TrieSync, entry_token_bound, redacted, stream_key
from lookahead.state.warmup import warm_up

from .config import BackendConfig
from .drain import DrainableLog, remove_region, restart_count, stub_shm_region, watch_drain
from .engine import SHUTDOWN_MESSAGE, Engine, FailureCode, RequestState, Update
from .grammars import GrammarStage
from .metrics import LookaheadMetrics, MetricWriter, instance_labels
from .orphan import exit_when_orphaned
from .request import RequestError, RequestLimits, json_options, parse_request
from .responses import ResponseLoop
from .vllm_metrics import VllmMetrics

ENGINE_STOPPED = "the engine thread has stopped (see the server log); reload the model"
UNLOAD_FAILED = (
    "Could not unload the model after its engine failed ({error}): it stays loaded and answers every "
    "request with UNAVAILABLE (tritonserver --model-control-mode=explicit lets a model unload itself)"
)

# The vLLM backend's tensor contract plus TensorRT-LLM's speculative stats and the prompt's logprobs.
INPUTS = [
    {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]},
    {"name": "stream", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "sampling_parameters", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    {"name": "exclude_input_in_output", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "return_finish_reason", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "return_cumulative_logprob", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "return_logprobs", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "return_num_input_tokens", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "return_num_output_tokens", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "return_perf_metrics", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
]
OUTPUTS = [
    {"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "finish_reason", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "cumulative_logprob", "data_type": "TYPE_FP32", "dims": [-1]},
    {"name": "logprobs", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "prompt_logprobs", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "num_input_tokens", "data_type": "TYPE_UINT32", "dims": [1]},
    {"name": "num_output_tokens", "data_type": "TYPE_UINT32", "dims": [-1]},
    {"name": "total_draft_tokens", "data_type": "TYPE_INT32", "dims": [1]},
    {"name": "total_accepted_draft_tokens", "data_type": "TYPE_INT32", "dims": [1]},
    {"name": "num_decoding_steps", "data_type": "TYPE_INT32", "dims": [1]},
    {"name": "acceptance_rate", "data_type": "TYPE_FP32", "dims": [1]},
]


# What makes a model unservable (a bad file or folder, an architecture that cannot verify trees,
# wheels that cannot be installed): the load fails with its message, not a traceback.
MODEL_ERRORS = (ValueError, OSError, UnsupportedModelError, EmbeddedModelError)
MAX_LOGGED_ID_CHARS = 128
ORPHAN_STOP_S = 2.0  # how long an orphaned stub waits for its engine's last step and snapshot
DRAIN_WAIT_S = 20.0  # how long a drain waits for the engine's last step and snapshot, then the sends
FINALIZE_SENDS_S = 5.0  # how long finalize after a drain waits for the response thread
# How long a starting instance waits for the models loading beside it to leave the cores before
# timing its forward for the planner (LookaheadDecoder.measure_cost).
QUIET_WAIT_S = 60.0
SERVER_STOPPING = "the server is shutting down; the request was not completed"


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def log_id(request_id: str | None) -> str:
    """The request's name in log lines: its id, shortened, or a fresh one."""
    if not request_id:
        return uuid.uuid4().hex
    return request_id if len(request_id) <= MAX_LOGGED_ID_CHARS else f"{request_id[:MAX_LOGGED_ID_CHARS]}..."


class TritonInputs:
    """The RequestInputs view of a pb_utils.InferenceRequest."""

    def __init__(self, request: Any):
        self.request = request

    def tensor(self, name: str) -> np.ndarray | None:
        tensor = pb_utils.get_input_tensor_by_name(self.request, name)
        return None if tensor is None else tensor.as_numpy()

    def parameters(self) -> dict[str, Any]:
        try:
            raw = self.request.parameters()
        except UnicodeDecodeError:
            raise RequestError("request parameters are not valid UTF-8") from None
        return json_options("request parameters", raw) if raw else {}


class TritonPythonModel:
    @classmethod
    def auto_complete_config(cls, auto_complete_model_config: Any) -> Any:
        """Add the tensors a config.pbtxt leaves out; what the user declared wins."""
        config = auto_complete_model_config.as_dict()
        declared_inputs = {tensor["name"] for tensor in config.get("input", [])}
        declared_outputs = {tensor["name"] for tensor in config.get("output", [])}
        for tensor in INPUTS:
            if tensor["name"] not in declared_inputs:
                auto_complete_model_config.add_input(tensor)
        for tensor in OUTPUTS:
            if tensor["name"] not in declared_outputs:
                auto_complete_model_config.add_output(tensor)
        # Decoupled: one request streams many responses and execute() returns before they exist.
        auto_complete_model_config.set_model_transaction_policy({"decoupled": True})
        # The engine interleaves requests itself; Triton must not batch tensors.
        auto_complete_model_config.set_max_batch_size(0)
        return auto_complete_model_config

    def initialize(self, args: dict[str, str]) -> None:
        self.logger = DrainableLog(pb_utils.Logger)
        self.drained = False
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException(
                f"model {args['model_name']!r} needs model_transaction_policy {{ decoupled: true }}"
            )
        config = BackendConfig.from_triton_args(args)

        # A short-lived thread does the torch work of loading. libgomp gives every thread that
        # starts parallel work its own team of workers, and once a process has more workers than
        # CPUs their waits stop spinning: a team left behind by this (main) thread would make each
        # forward of the engine thread wake sleeping workers (on 2 cores, a third slower).
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="lookahead-load") as loader:
            loading = loader.submit(self._load, config, args["model_instance_name"])
            try:
                loaded, keeper, decoder = loading.result()
            except MODEL_ERRORS as error:  # a model that cannot be served: one line says why
                message = f"{args['model_instance_name']}: cannot serve {config.model!r}: {one_line(error)}"
                self.logger.log_error(message)
                raise pb_utils.TritonModelException(message) from None
        self.model_name = args["model_name"]
        self.tokenize, self.detokenize = loaded.tokenizer.encode, loaded.tokenizer.decode
        if config.linear_kernel == "auto" and loaded.linear_kernel == "stock" and config.device == "cpu":
            self.logger.log_warn(
                f"{args['model_instance_name']}: linear_kernel auto chose {loaded.execution}; the fast CPU "
                "path runs fp32 models on x86-64 CPUs with AVX-512 or AVX2 + FMA + F16C"
            )
        self.check_request = decoder.check_request
        max_prompt_tokens = (
            config.max_prompt_tokens or decoder.longest_prompt(config.lookahead) or DEFAULT_MAX_PROMPT_TOKENS
        )
        self.logger.log_info(f"{args['model_instance_name']}: prompts of up to {max_prompt_tokens} tokens")
        self.limits = RequestLimits(
            config.lookahead,
            max_prompt_tokens,
            config.max_output_tokens,
            max_prompt_bytes=prompt_byte_limit(loaded.tokenizer, max_prompt_tokens),
            context_length=decoder.context_length,
            vocab_size=loaded.vocab_size,
            acceptance_outputs=config.acceptance_outputs,
            stream_each_token=config.stream_each_token,
        )

        self.metrics = self.vllm_metrics = self.metric_writer = None
        if config.report_custom_metrics:
            labels = instance_labels(args["model_name"], args["model_version"], args["model_instance_name"])
            writer = MetricWriter(self.logger)
            self.metrics = LookaheadMetrics.create(labels, writer, self.logger)
            max_model_len = decoder.context_length or max_prompt_tokens
            self.vllm_metrics = VllmMetrics.create(labels, max_model_len, writer)
            if self.metrics is None and self.vllm_metrics is None:
                writer.close()
            else:
                self.metric_writer = writer
        if keeper is not None and config.trie_sync:
            self._join_fleet(keeper, config, loaded, decoder)
        if self.metrics is not None and keeper is not None:
            self.metrics.trie_size(keeper.trie.node_count, keeper.trie.byte_estimate)
        if self.metrics is not None:
            self.metrics.restarts(restart_count(args["model_name"]))
        self.model_version = args["model_version"]
        self.responses = ResponseLoop(
            self.logger,
            on_final=self._on_final,
            served=self._served,
            on_unload=self._on_unload,
            on_sent=self.metrics.response_sent if self.metrics else None,
        )
        self.engine = Engine(
            decoder,
            emit=self.responses.put,
            log=self.logger,
            keeper=keeper,
            on_trie_size=self.metrics.trie_size if self.metrics else None,
            max_running_requests=config.max_running_requests,
            on_stopped=self._on_engine_stopped,
            max_queued_requests=config.max_queued_requests,
            queue_timeout_s=config.queue_timeout_s,
            on_step=self.vllm_metrics.step if self.vllm_metrics else None,
            on_step_timed=self.metrics.step_timed if self.metrics else None,
            on_cost=self.metrics.step_cost if self.metrics else None,
        )
        self.grammars = decoder.grammars
        self.grammar_stage = GrammarStage(
            decoder.grammars, self.engine.submit, self.responses.put, self.logger, config.max_queued_requests
        )
        freeze_loaded_objects()
        self.responses.start()
        self.engine.start()
        self.grammar_stage.start()
        exit_when_orphaned(self._on_orphaned)
        self.drain_watch = watch_drain(self._drain, model=self.model_name)
        self.logger.log_info(
            f"{args['model_instance_name']}: serving {loaded.name} on {config.device} "
            f"({config.dtype}, {loaded.execution}), "
            f"{config.lookahead}, trie {keeper.trie.node_count if keeper else 0} nodes"
        )

    def execute(self, requests: list[Any]) -> None:
        """Validate and enqueue; every response is sent later by the response thread."""
        for request in requests:
            try:
                request_id = request.request_id()
            except UnicodeDecodeError:  # an HTTP id need not be UTF-8; pybind11 refuses it as a str
                request_id = None
            state = RequestState(id=log_id(request_id), sender=request.get_response_sender())
            if request_id is None:
                self.responses.put(
                    Update.failed(state, FailureCode.INVALID_ARG, "the request id is not valid UTF-8")
                )
                continue
            if not self.engine.running:
                self.responses.put(Update.failed(state, FailureCode.UNAVAILABLE, ENGINE_STOPPED))
                continue
            try:
                state.request = parse_request(
                    TritonInputs(request), self.limits, self.tokenize, self.check_request, self.detokenize
                )
            except RequestError as error:
                self.responses.put(Update.failed(state, FailureCode.INVALID_ARG, str(error)))
                continue
            except Exception as error:  # still exactly one FINAL for this request
                self.logger.log_error(f"Error reading request {state.id}: {traceback.format_exc()}")
                self.responses.put(
                    Update.failed(state, FailureCode.INTERNAL, f"Error reading the request: {error}")
                )
                continue
            self.responses.watch(state)
            self._submit(state)
        return None

    def _submit(self, state: RequestState) -> None:
        """To the engine, with its constraint compiled; one not compiled yet waits for the grammar
        stage (never on this thread, which every new request of the model needs)."""
        spec = state.request.sampling.structured_outputs
        if spec is not None:
            try:
                state.grammar = self.grammars.cached(spec)
            except ValueError as error:  # refused meanwhile
                self.responses.put(Update.failed(state, FailureCode.INVALID_ARG, str(error)))
                return
            if state.grammar is None:
                self.grammar_stage.put(state)
                return
        self.engine.submit(state)

    def is_ready(self) -> bool:
        """Model readiness (python_backend r26.03+ asks it for v2/models/<name>/ready): false once
        the engine thread has failed."""
        return self.engine.running

    def _served(self) -> bool:
        """Whether the server still serves this model: false once it unloads it. (A server that shuts
        down stops answering its stubs instead: then the orphan watch ends this process.)"""
        try:
            return pb_utils.is_model_ready(self.model_name, self.model_version)
        except Exception as error:  # "Server not ready"
            self.logger.log_info(f"Readiness of {self.model_name} unknown ({error}): taking it as unloading")
            return False

    def _on_unload(self) -> None:
        self.grammar_stage.close(SHUTDOWN_MESSAGE)
        self.engine.unload()

    def _on_orphaned(self) -> None:
        """The server exited without finalize(): end the requests (nobody can answer them now) and
        write the last snapshot before the process ends; the last instance to go removes the drain
        folder its launcher (gone too, or it would have drained us) leaves behind, and the
        shared-memory region the server would have removed."""
        remove_region(stub_shm_region())
        if self.drain_watch is not None:  # first: the deadline may end the process mid-stop
            self.drain_watch.leave()
        self.grammar_stage.close(SHUTDOWN_MESSAGE)
        self.engine.unload()
        self.engine.stop(timeout_s=ORPHAN_STOP_S)

    def _drain(self) -> None:
        """The launcher stops the server: end every request with a final response and save the
        snapshot now, while the server still relays responses (once signalled it no longer does)."""
        self.logger.log_info(f"{self.model_name}: the server is shutting down; draining")
        self.grammar_stage.close(SERVER_STOPPING, DRAIN_WAIT_S)
        if not self.engine.unload(SERVER_STOPPING).wait(DRAIN_WAIT_S):
            self.logger.log_error(f"{self.model_name}: the engine did not drain within {DRAIN_WAIT_S:g} s")
        sent = threading.Event()
        self.responses.after_queued(sent.set)
        sent.wait(DRAIN_WAIT_S)
        # Once signalled the server relays no IPC: drop the metrics (their destructors call it) and
        # log directly from now on, so that finalize needs nothing from the server.
        self._close_metrics()
        self.logger.log_info(f"{self.model_name}: drained; logging to stderr until the process ends")
        self.logger.direct = self.drained = True

    def _on_engine_stopped(self, reason: str) -> None:
        """The engine failed (every request already got its error): once those errors are sent,
        unload the model as vLLM's backend does for an unhealthy engine."""

        def unload() -> None:
            self.logger.log_error(
                f"The engine of {self.model_name} failed and the model will be unloaded: {reason}"
            )
            try:
                pb_utils.unload_model(self.model_name)
            except Exception as error:  # no explicit model control: the model stays, answering UNAVAILABLE
                self.logger.log_error(UNLOAD_FAILED.format(error=error))

        self.responses.after_queued(unload)

    def finalize(self) -> None:
        """Stop the engine (it answers what is left and takes a last snapshot), then the senders."""
        if self.drain_watch is not None:
            self.drain_watch.stop()
        self.grammar_stage.close(SHUTDOWN_MESSAGE, FINALIZE_SENDS_S)
        self.engine.stop()
        # After a drain a send (a request that came since) may block: the thread is a daemon.
        self.responses.stop(timeout_s=FINALIZE_SENDS_S if self.drained else None)
        self._close_metrics()
        gc.collect()

    def _close_metrics(self) -> None:
        """Apply what is queued, then drop the metrics before their families."""
        writer, self.metric_writer = self.metric_writer, None
        if writer is not None:
            writer.close()
        for metrics in (self.metrics, self.vllm_metrics):
            if metrics is not None:
                metrics.close()
        self.metrics = self.vllm_metrics = None

    def _load(
        self, config: BackendConfig, instance_name: str
    ) -> tuple[LoadedModel, TrieKeeper | None, LookaheadDecoder]:
        loaded = load_model(
            config.model,
            dtype=config.dtype,
            device=config.device,
            threads=config.threads or None,
            linear_kernel=config.linear_kernel,
        )
        keeper = None
        if config.lookahead.use_lookahead:
            check_tree_attention(loaded.model)  # refuse a model whose tree verification is not lossless
            keeper = self._open_trie(config, instance_name, loaded)
        decoder = LookaheadDecoder.for_model(
            loaded, keeper.trie if keeper else None, config.lookahead, config.decoder
        )
        decoder.kv_bytes_per_token  # measured here, so that request checks never run the model
        if config.lookahead.drafting:
            # The planner starts from this model's own cost curve, timed once the other models
            # loading beside this one leave the cores.
            decoder.measure_cost(quiet_wait_s=QUIET_WAIT_S)
        if keeper is not None:
            keeper.stop_words = decoder.stop_word_ids(config.lookahead.stop_words)
        return loaded, keeper, decoder

    def _on_final(self, update: Update) -> None:
        """Record a request's metrics and wait until they are applied, so that a scrape right after
        its final response counts it (as one after vLLM's does)."""
        for metrics in (self.metrics, self.vllm_metrics):
            if metrics is not None:
                metrics.request_finished(update)
        if self.metric_writer is not None and not self.metric_writer.flush():
            self.logger.log_warn(f"The metrics of request {update.state.id} were not applied in time")

    def _open_trie(self, config: BackendConfig, instance_name: str, loaded: LoadedModel) -> TrieKeeper:
        """This instance's global trie: its last snapshot, else the warm-up corpus, else empty."""
        path = config.trie_state_dir / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', instance_name)}.trie"
        claim_snapshot(path, os.getppid())  # this stub's parent is the tritonserver process
        snapshot = load_snapshot(
            path,
            capacity=config.trie.capacity,
            max_depth=config.trie.depth,
            fingerprint=loaded.fingerprint,
            vocab_size=loaded.vocab_size,
        )
        trie = snapshot.trie
        keeper = TrieKeeper(
            trie, path, loaded.fingerprint, config.snapshot_interval_s, self.logger, stream=snapshot.stream
        )
        if trie.node_count == 0 and config.warmup_corpus is not None:
            warm_up(
                trie, config.warmup_corpus, loaded.tokenizer, progress=False, vocab_size=loaded.vocab_size
            )
            keeper.mark_changed()
        self.logger.log_info(f"Trie for {instance_name}: {path} ({trie.node_count} nodes)")
        return keeper

    def _join_fleet(
        self, keeper: TrieKeeper, config: BackendConfig, loaded: LoadedModel, decoder: LookaheadDecoder
    ) -> None:
        """Learn with the other instances of this model through the trie_sync stream, starting from
        what it retains (or from where this instance's snapshot left off)."""
        key = stream_key(config.trie_sync_namespace, loaded.fingerprint)
        source, cursor = keeper.resume_position(key)
        sync = TrieSync(
            config.trie_sync,
            key,
            vocab_size=decoder.vocab_size,
            max_tokens=entry_token_bound(decoder.context_length),
            max_entries=config.trie_sync_max_entries,
            log=self.logger,
            on_count=self.metrics.trie_sync_counted if self.metrics else None,
            source=source,
            cursor=cursor,
        )
        inserted = keeper.join(sync)
        self.logger.log_info(
            f"Trie sync through {redacted(config.trie_sync)}, stream {key}: {inserted} entries inserted "
            f"at start, trie {keeper.trie.node_count} nodes"
        )
