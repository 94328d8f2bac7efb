"""The engine: the core loop, the offline API, and the process boundary to the HTTP front end.

    engine_core.py       EngineCore: schedule -> execute -> update (in-process, or in the engine process)
    llm.py               LLM: the offline API (generate / chat; add_request / step)
    output_processor.py  prompt validation and tokenization in; detokenization, stop strings, n > 1 out
    detokenizer.py       incremental detokenization
    tokenizer.py         the Hugging Face tokenizer, wrapped
    cli.py               `backboard generate`; the engine flags (from config.EngineArgs)

    The process boundary (front end <-> engine process):
    messages.py          the typed messages that cross it (msgspec structs, msgpack frames)
    transport.py         the ZeroMQ sockets and their addresses (ipc:// or tcp://)
    core_proc.py         the engine process: EngineCore behind the sockets
    async_llm.py         AsyncLLM: the front end's client (spawns the engine, routes its outputs)
    request_stream.py    what a caller gets per request: RequestStream of RequestDeltas, timings, errors
"""
