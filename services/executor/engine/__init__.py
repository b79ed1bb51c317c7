"""The engine, as a library: a Llama-family model with continuous batching over a paged KV cache,
in one process, knowing nothing of NATS.

    async with Engine(engine_config({"model.name": "SmolLM2-135M-Instruct"})) as engine:
        # (shared/config.py; an executor: Engine(load_config(path).engine_config(name)))
        engine.start()
        key = engine.add_request(engine.admit(request), sink)   # outputs go to sink(output)
        engine.abort(key)
    # (leaving the block stops it: await engine.stop())

`admit` validates and tokenizes a request as admission does; `add_request` trusts an admitted
one (the executor service hands it admission's WorkItem) and checks only what the engine alone
knows. The step loop runs by itself once started; `generate` is the async-iterator form.

Parts: `scheduler.py` (which sequences run each step), `block_manager.py` (paged KV, prefix
cache), `model_runner.py` and `model.py` (the forward pass), `attention.py`, `linear.py` and
`triton_backend.py` (kernels), `weights.py` (GGUF and safetensors), `sampler.py`,
`sequence.py` and `request_state.py` (a request inside the engine).
"""
