"""Shared pieces of the simulator tests: small profiles and a run on a virtual loop."""
from __future__ import annotations

from pdserve.engine.latency_model import StepCost, TransferCost
from pdserve.engine.model_config import ModelConfig
from pdserve.sim.profile import Profile

# A small model on a CPU core, roughly: 4 ms a step, 50 us a prompt token.
COST = StepCost(base_s=4e-3, prefill_token_s=5e-5, prefill_pair_s=1e-8, decode_seq_s=3e-4,
                decode_context_s=1e-7)
LINK = TransferCost(latency_s=2e-3, per_byte_s=1e-9)


def small_profile(num_kv_blocks: int = 512, noise: float = 0.0, vocab_size: int = 2048,
                  max_model_len: int = 1024) -> Profile:
    return Profile(name="test", source="analytic", step_cost=COST, transfer_cost=LINK,
                   num_kv_blocks=num_kv_blocks, block_size=16, kv_bytes_per_block=1 << 16,
                   max_model_len=max_model_len, vocab_size=vocab_size, step_noise=noise)


def model_profile(model_dir, num_kv_blocks: int = 256, max_model_len: int = 512) -> Profile:
    """The test model's sizes (its time still simulated)."""
    model = ModelConfig.from_dir(model_dir)
    return Profile(name="test-llama", source="analytic", step_cost=COST, transfer_cost=LINK,
                   num_kv_blocks=num_kv_blocks, block_size=16,
                   kv_bytes_per_block=2 * model.num_layers * model.kv_size * 4 * 16,
                   max_model_len=max_model_len, vocab_size=model.vocab_size)
