"""The decoder's elementwise ops against HF transformers' own functions, to the bit:
RoPE (rotated for q's and k's heads at once, in place of HF's rotate_half) and the
MLP (SiLU computed in place on the gate's output), in float32 and bfloat16."""
import pytest
import torch
from transformers.models.llama.configuration_llama import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, apply_rotary_pos_emb

from pdserve.engine.model.llama import MLP
from pdserve.engine.model.rope import RotaryEmbedding
from pdserve.engine.model_config import ModelConfig

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def config() -> ModelConfig:
    return ModelConfig.from_hf_dict({
        "model_type": "llama", "vocab_size": 64, "hidden_size": HEADS * HEAD_DIM,
        "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "rope_theta": 10000.0, "rms_norm_eps": 1e-6})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_over_q_and_k_at_once_equals_hf(dtype):
    gen = torch.Generator().manual_seed(0)
    tokens = 37
    positions = torch.randint(0, 500, (tokens,), generator=gen)
    rope = RotaryEmbedding(config(), 512, "cpu", dtype)
    # q and k side by side, as the fused projection lays them out (a view: v follows)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
    qk = qkv[:, :(HEADS + KV_HEADS) * HEAD_DIM].view(tokens, HEADS + KV_HEADS, HEAD_DIM)
    ours = rope.tables(positions).apply(qk)
    q, k = qk.split([HEADS, KV_HEADS], dim=1)
    cos, sin = rope.cos[positions], rope.sin[positions]  # [T, D]: HF's cos[position_ids]
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    assert torch.equal(ours[:, :HEADS], hf_q)
    assert torch.equal(ours[:, HEADS:], hf_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlp_equals_hf(dtype):
    torch.manual_seed(0)
    cfg = config()
    hf = LlamaMLP(LlamaConfig(hidden_size=cfg.hidden_size,
                              intermediate_size=cfg.intermediate_size, hidden_act="silu"))
    ours = MLP(cfg)
    ours.load_state_dict(hf.state_dict())
    hf, ours = hf.to(dtype), ours.to(dtype)
    x = torch.randn(53, cfg.hidden_size).to(dtype) * 4
    with torch.no_grad():
        assert torch.equal(ours(x), hf(x))
