"""Starting and stopping the serving processes: tritonserver with the Python backend (backend/),
the OpenAI-compatible endpoint (frontend/) beside it. `python -m launcher` serves a model
repository; tests and measurement tools start the same processes through `start_server` and
`start_frontend`."""
