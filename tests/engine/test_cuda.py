"""The engine on a GPU (skipped where torch sees none; `scripts/gpu_check.sh` runs it).

- float32 on CUDA: greedy outputs equal HF transformers' (float32) under every
  scheduling path, speculation included, as on the CPU (the oracle test's rule: where
  a sequence first differs, the logits agree within 1e-3 and the tokens are a near-tie).
- bfloat16 on CUDA, the serving default there: HF in bfloat16 on the same GPU is the
  reference. The logits of both are compared with HF's float32 ones on the same
  sequences, and ours may stray at most twice as far as HF's own; and greedy outputs
  are compared in vLLM's manner (`check_logprobs_close`): where the two first differ,
  each one's token is among the other's five most likely, and the rest is not compared.
"""
from __future__ import annotations

import statistics

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve import LLM, SamplingParams
from pdserve.engine.tiny_model import make_draft_model
from tests.engine.test_hf_oracle import (
    KV_BYTES,
    MAX_TOKENS,
    Oracle,
    assert_matches_hf,
    random_prompts,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="the engine on a GPU needs one (this machine has none)")

TOP = 5  # check_logprobs_close's num_logprobs
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
PATHS = {
    "defaults": {},
    "chunked_prefill_and_prefix_caching": {
        "long_prefill_token_threshold": 24, "max_num_batched_tokens": 96,
        "enable_prefix_caching": True},
    "preemption": {"num_kv_blocks": 20},
    # the default backend there is the Triton kernel; SDPA over gathered blocks too
    "torch_attention": {"attention_backend": "torch"},
    "ngram": {"speculative_config": NGRAM},
    "draft_model": {},  # the draft's path is known only once the fixture built it
}


@pytest.fixture(scope="module", params=["llama_gqa", "qwen2_tied"])
def arch(request, model_dirs):
    return model_dirs[request.param], Oracle(model_dirs[request.param])


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


@pytest.mark.parametrize("path", list(PATHS))
def test_float32_on_cuda_equals_hf(arch, path, tmp_path):
    model_dir, oracle = arch
    kw = dict(PATHS[path])
    if path == "draft_model":
        draft = make_draft_model(model_dir, tmp_path / "draft", 1)
        kw["speculative_config"] = {"method": "draft_model", "model": str(draft),
                                    "num_speculative_tokens": 3}
    if "num_kv_blocks" not in kw:
        kw["kv_cache_memory_bytes"] = KV_BYTES
    llm = LLM(str(model_dir), device="cuda", dtype="float32", **kw)
    prompts = random_prompts(llm.engine.model_config.vocab_size, seed=7)
    outputs = [o.token_ids for o in llm.generate(prompts, [greedy(n) for n in MAX_TOKENS])]
    if path == "preemption":
        assert llm.engine.stats.num_preemptions > 0
        assert llm.engine.block_manager.num_free_blocks == 20
    if "speculative_config" in kw:
        assert llm.engine.stats.spec_decode_num_accepted_tokens > 0
    assert_matches_hf(llm, oracle, prompts, outputs)


def _hf_logits(model, sequence: list[int], device: str) -> torch.Tensor:
    """Next-token logits [len, vocab] (float32, on the CPU) at every position."""
    with torch.no_grad():
        out = model(torch.tensor([sequence], device=device)).logits[0]
    return out.float().cpu()


def test_bfloat16_on_cuda_within_tolerance_of_hf(arch):
    model_dir, oracle = arch
    llm = LLM(str(model_dir), device="cuda", kv_cache_memory_bytes=KV_BYTES)
    assert llm.engine.config.resolved_dtype == "bfloat16"
    hf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda")
    hf16.eval()
    prompts = random_prompts(llm.engine.model_config.vocab_size, seed=8)

    # Logits on the same sequences (each prompt and HF's float32 continuation), at
    # three points of the continuation, against HF's float32 logits.
    ours_err, hf_err = [], []
    for prompt, n in zip(prompts, MAX_TOKENS):
        expected, _ = oracle.generate(prompt, n)
        sequence = prompt + expected
        ref = _hf_logits(oracle.model, sequence, "cpu")
        theirs = _hf_logits(hf16, sequence, "cuda")
        for length in (len(prompt), len(prompt) + n // 2, len(sequence) - 1):
            ours = llm.engine.score(sequence[:length]).float().cpu()
            ours_err.append((ours - ref[length - 1]).abs().max().item())
            hf_err.append((theirs[length - 1] - ref[length - 1]).abs().max().item())
    print(f"max |logits - HF float32|: ours in bfloat16 {statistics.mean(ours_err):.4f} "
          f"mean, {max(ours_err):.4f} max; HF in bfloat16 {statistics.mean(hf_err):.4f} "
          f"mean, {max(hf_err):.4f} max")
    assert statistics.mean(ours_err) <= 2 * statistics.mean(hf_err)
    assert max(ours_err) <= 2 * max(hf_err)

    # Greedy outputs, check_logprobs_close's rule.
    ours = llm.generate(prompts, [greedy(n, top_logprobs=TOP) for n in MAX_TOKENS])
    same = 0
    for prompt, n, out in zip(prompts, MAX_TOKENS, ours):
        with torch.no_grad():
            hf = hf16.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=n,
                               do_sample=False, eos_token_id=None, pad_token_id=0,
                               output_logits=True, return_dict_in_generate=True)
        hf_tokens = hf.sequences[0, len(prompt):].tolist()
        k = next((i for i, (a, b) in enumerate(zip(hf_tokens, out.token_ids)) if a != b), None)
        if k is None:
            same += 1
            continue
        hf_top = set(hf.logits[k][0].float().topk(TOP).indices.tolist())
        assert out.token_ids[k] in hf_top, (
            f"prompt of {len(prompt)} tokens, output {k}: our token {out.token_ids[k]} is "
            f"not among HF's {TOP} most likely {sorted(hf_top)}")
        assert hf_tokens[k] in out.top_logprobs[k], (
            f"prompt of {len(prompt)} tokens, output {k}: HF's token {hf_tokens[k]} is not "
            f"among our {TOP} most likely {sorted(out.top_logprobs[k])}")
    print(f"greedy outputs identical to HF bfloat16 in {same} of {len(prompts)} prompts")
