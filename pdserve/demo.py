"""`pdserve demo` (what `make demo` runs): 1 prefill + 1 decode worker on local Ray,
requests through the SDK and the OpenAI HTTP API; `--offline`, the engine alone."""
from __future__ import annotations

import argparse
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

_TOPICS = ["The history of", "A recipe for", "def fibonacci(n):", "Dear reader,",
           "import numpy as np\n", "In the beginning", "The weather today", "Once upon a time"]


def cluster(args: argparse.Namespace) -> int:
    import ray

    from pdserve import ray_session
    from pdserve.client import Client
    from pdserve.engine.config import EngineConfig
    from pdserve.router.config import PoolSpec
    from pdserve.router.front.server import RouterServer
    from pdserve.router.launch import launch

    t0 = time.perf_counter()
    ray_session.start_local(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        config = EngineConfig.from_kwargs(args.model, max_num_seqs=64, num_threads=1,
                                          long_prefill_token_threshold=256,
                                          kv_cache_memory_bytes=256 << 20)
        srv = RouterServer(launch(config, PoolSpec(1, 1), served_model_name=args.model))
        print(f"cluster up in {time.perf_counter() - t0:.1f}s: 1 prefill + 1 decode worker, "
              f"gRPC {srv.grpc_target}, HTTP {srv.http_url}")
        prompts = _prompts(args.num_prompts)
        with Client(srv.grpc_target) as client:
            for prompt in prompts[:3]:
                out = client.generate(prompt, max_tokens=args.max_tokens, temperature=0,
                                      ignore_eos=True)
                print(f"[gRPC] {prompt!r} -> {out.text[:60]!r}  ttft {out.ttft_s * 1e3:.0f} ms"
                      f"  e2e {out.e2e_s * 1e3:.0f} ms  ({out.usage.completion_tokens} tokens)")
            t1 = time.perf_counter()
            outs = _concurrently(client, prompts, args.max_tokens)
            elapsed = time.perf_counter() - t1
        tokens = sum(len(o.token_ids) for o in outs)
        print(f"[gRPC] {len(outs)} concurrent requests: {tokens} tokens in {elapsed:.2f}s "
              f"({tokens / elapsed:.0f} tok/s), median ttft "
              f"{sorted(o.ttft_s for o in outs)[len(outs) // 2] * 1e3:.0f} ms")
        status, body = _post_json(f"{srv.http_url}/v1/completions", {
            "model": args.model, "prompt": prompts[0], "max_tokens": args.max_tokens,
            "temperature": 0, "ignore_eos": True})
        print(f"[HTTP] /v1/completions {status}: {body['choices'][0]['text'][:60]!r} "
              f"usage {body['usage']['completion_tokens']} tokens")
        srv.stop()
    finally:
        ray.shutdown()
    print(f"demo done in {time.perf_counter() - t0:.1f}s")
    return 0


def offline(args: argparse.Namespace) -> int:
    from pdserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, kv_cache_memory_bytes=512 << 20)
    print(f"loaded {args.model!r} in {time.perf_counter() - t0:.1f}s "
          f"({llm.engine.model_config.num_layers} layers, "
          f"{llm.engine.block_manager.num_blocks} KV blocks)")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outputs = llm.generate(_prompts(args.num_prompts), params)
    elapsed = time.perf_counter() - t0
    for out in outputs[:4]:
        prompt = llm.tokenizer.decode(out.prompt_token_ids)
        print(f"--- {prompt!r} -> {out.text[:80]!r}  "
              f"(ttft {out.metrics.ttft * 1e3:.0f} ms, e2e {out.metrics.e2e * 1e3:.0f} ms)")
    generated = sum(len(o.token_ids) for o in outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    print(f"{len(outputs)} requests, {prompt_tokens} prompt + {generated} output tokens "
          f"in {elapsed:.2f}s: {generated / elapsed:.0f} output tok/s")
    return 0


def _prompts(n: int) -> list[str]:
    return [f"{_TOPICS[i % len(_TOPICS)]} {i}" for i in range(n)]


def _concurrently(client, prompts: list[str], max_tokens: int):
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: client.generate(p, max_tokens=max_tokens, temperature=0,
                                                       ignore_eos=True), prompts))


def _post_json(url: str, payload: dict, timeout_s: float = 60.0) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(payload).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return response.status, json.loads(response.read())
