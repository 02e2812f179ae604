"""The shared core (`pdserve.engine`): one LLM engine, imported by the workers, the
offline LLM and the capacity simulator. It imports no Ray, gRPC or HTTP.

    options.py           option(default, help): a documented dataclass field, the one
                         source of CLI flags and schema descriptions
    config.py            frozen, validated EngineConfig / SchedulerConfig / CacheConfig
    model_config.py      the architecture read from an HF config.json
    model_path.py        where a model name points: a local HF directory, or `tiny`
    tiny_model.py        the locally built tiny model; make_draft_model (its draft)
    tokenizer.py         tokenizer.json (+ tokenizer_config.json), the chat template
    detokenizer.py       incremental text and stop strings for one request
    sampling_params.py   per-request sampling settings, vLLM's names and defaults
    validation.py        request checks shared with the router (field-named errors)
    errors.py            typed errors the engine and its workers raise
    outputs.py           RequestOutput: what the engine reports per request each step
    request.py           one request's state: num_computed_tokens catching up
    block_manager.py     pure block accounting: ref counts, chained-hash prefix cache
    scheduler.py         the pure scheduler: schedule() / update(); drafts in free
                         lookahead slots; one stop rule (Request.check_stop)
    steady_batch.py      a batch all decoding, taken whole and updated in one loop;
                         the simulator's n decode steps at once (steps_ahead, advance)
    scheduler_output.py  what the scheduler decides per step, what the runner returns
    kv_cache.py          per-layer KV tensors [2, num_blocks, block_size, Hkv, D]
    attention.py         the attention seam: StepMetadata, the backend base, resolve
    torch_attention.py   SDPA over gathered blocks: length-grouped decodes, causal
                         prefill chunks (any device; the CPU default)
    triton_attention.py  a paged kernel reading blocks in place (the CUDA default)
    step_buffers.py      a step's inputs (StepInputs) in persistent buffers
    cuda_graphs.py       decode steps replayed from graphs captured per batch size
    model/               the Llama-family model: decoder, matmuls, RoPE, weight loading
                         (a tensor-parallel rank's slices only)
    parallel/            tensor parallelism: the sharding, the ranks' group, what rank 0
                         broadcasts per step, the other ranks' loop
    model_runner.py      one step on the device: flat inputs, forward, sampling, draft
                         verification; a sampling row that fails ends only its request
    sampler.py           vLLM's order of penalties and truncations, logprobs; a seeded
                         request's k-th token drawn from (seed, k) wherever sampled
    structured_outputs.py  xgrammar: constraints checked and compiled (cached), each
                         request's matcher synced to its tokens, batched token masks
    spec_decode/         speculative decoding: proposers (n-gram, draft model), verify
    engine.py            LLMEngine: add_request / step / abort, the colocated loop
    engine_loop.py       an engine on its own thread: calls between steps, outputs one
                         batch per step, call_concurrent beside the forward pass
    cpu_memory.py        keeps freed activation memory in-process on CPU (glibc)
    profile.py           a worker's start-up profile: warm-up steps that seed its
                         latency model
    step_shape.py        StepShape, StepTiming: what a step computed, how long it took
    telemetry.py         a worker's telemetry as its scheduler stands, real or simulated
    move_blocks.py       a live migration's block ranges, checked alike at both ends
    latency_model.py     the latency model, pure (numpy): StepCost and TransferCost
                         fitted online over a sliding window (StepModel,
                         TransferModel), PromptShare; its forecasts: router/policy/
"""
