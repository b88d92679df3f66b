"""Triton Python backend: model entry point, request handling, engine thread, responses, metrics."""
