"""Every measurement of the project, run as `python -m bench NAME [ARGS]` (`--help` lists them).

In one process, on the library: `decoding`, `step_kinds`, `forward_cost`, `roofline`, `perplexity`,
`retrieval_cost`, `grammar_cost`, `oracle_bound`, `agreement`, `acceptance`, `device_check`.
Through real servers (tritonserver, the OpenAI endpoint, llama-server, Redis): `load_test`,
`step_profile`, `speedup`, `multi_turn`, `agent_loop`, `genai_perf`, `stall_test`, `structured`,
`peer_llama_cpp`, `busy_neighbour`, `fleet`, with `ab_repository` to serve two revisions side by
side. Prompt sets (prompt_sets.py, json_extraction.py) come from data files that pip packages ship;
stdlib_sets.py builds its own from the interpreter's standard library.
"""

# name -> what it measures (a module of this package with `main(argv) -> int`)
BENCHMARKS = {
    "decoding": "the decoder against transformers' greedy and prompt lookup decoding, in one process",
    "step_kinds": "lookahead against plain decoding, c requests running: each kind of step's time by part",
    "forward_cost": "a forward's cost by tokens fed, stock layers and each fast-path variant",
    "roofline": "each forward width beside this CPU's bandwidth and compute floors; a one-token breakdown",
    "retrieval_cost": "draft retrieval's cost per query on a large trie",
    "grammar_cost": "what a structured-output grammar costs a lookahead step",
    "oracle_bound": "how far a drafter that knows each output could go over plain decoding",
    "perplexity": "perplexity of held-out text on each execution path (packed fp32, integer int8)",
    "agreement": "lookahead on the fast path against transformers' greedy on stock layers",
    "acceptance": "draft-node acceptance estimates on recorded steps: class calibration vs the predictor",
    "device_check": "the forward-cost curve and a decoder benchmark on a random 7B-shaped model",
    "load_test": "perf_analyzer against the served lookahead and baseline models",
    "step_profile": "each server step's wall time by part (forward, drafting, responses...) per concurrency",
    "speedup": "lookahead against the baseline through the server per prompt set, outputs compared",
    "multi_turn": "four-turn coding conversations through the server, each turn resending the last",
    "agent_loop": "a coding agent's tool loop through the OpenAI endpoint: calls, results, answers",
    "genai_perf": "genai-perf through the OpenAI endpoint: TTFT, inter-token latency, tokens/s",
    "stall_test": "whether a long prompt stalls the streams already running",
    "structured": "structured outputs through the server, with and without lookahead",
    "peer_llama_cpp": "llama.cpp's llama-server on the same GGUF file, the CPU peer",
    "busy_neighbour": "decoding through the server beside busy processes, adaptive threads on and off",
    "fleet": "replicas that learn together through Redis against replicas learning alone",
    "ab_repository": "a model repository serving this checkout beside another revision, for one A/B run",
}
