"""`python -m scripts.peer_llama_cpp`: see client.peer_llama_cpp."""

from client.peer_llama_cpp import main

if __name__ == "__main__":
    raise SystemExit(main())
