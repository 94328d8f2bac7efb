"""The OpenAI-compatible HTTP server (`backboard serve`).

    cli.py        the command line; resolves the model (folder, hub id, or the embedded demo)
    launcher.py   start-up and shutdown: engine process + uvicorn, graceful drain on SIGTERM
    api.py        the FastAPI app: routes, API key, readiness
    serving.py    completions / chat completions: the engine client -> JSON or SSE
    protocol.py   request schemas -> SamplingParams
    responses.py  OpenAI response shapes (bodies, chunks, logprobs, usage)
    errors.py     OpenAI-style error bodies for every failure
    metrics.py    Prometheus metrics

The engine runs in its own process behind backboard.engine.async_llm.AsyncLLM.
"""
