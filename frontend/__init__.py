"""An OpenAI-compatible HTTP endpoint in front of tritonserver, speaking to it only through the
models' gRPC contract (the vLLM backend's), so it serves any tritonserver that holds them."""
