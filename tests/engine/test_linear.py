"""The model's matmuls (engine/model/linear.py): oneDNN over packed weights on a CPU in
float32, F.linear otherwise, and a loaded model actually packed."""
import pytest
import torch
import torch.nn.functional as F

from pdserve import LLM
from pdserve.engine.model.linear import Linear, pack, packs

# The engine packs float32 weights on x86-64 CPUs with oneDNN (CI's machines do).
PACKED = pytest.mark.skipif(not packs("cpu", torch.float32),
                            reason="the engine packs no weights on this machine")


def reference(x, weight, bias):
    out = x.double() @ weight.double().t()
    return out if bias is None else out + bias.double()


@PACKED
@pytest.mark.parametrize("rows", [0, 1, 3, 37, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_float32_exact_to_rounding(rows, bias):
    torch.manual_seed(rows)
    layer = Linear(96, 160, bias=bias)
    weight = layer.weight.detach().clone()
    b = None if layer.bias is None else layer.bias.detach().clone()
    x = torch.randn(rows, 96)
    dense = F.linear(x, weight, b)
    layer.pack()
    assert layer.packed is not None and layer.weight.numel() == 0  # dense copy dropped
    layer.pack()  # a second call keeps what the first packed
    with torch.inference_mode():
        ours = layer(x)
    assert ours.dtype == torch.float32 and ours.shape == (rows, 160)
    # Within float32 rounding of the exact product (|values| ~ 1, K = 96), as MKL's is.
    exact = reference(x, weight, b)
    assert rows == 0 or (ours.double() - exact).abs().max().item() <= 2e-6
    torch.testing.assert_close(ours, dense, atol=1e-5, rtol=1e-5)


@PACKED
def test_packed_linear_takes_batched_and_strided_inputs():
    torch.manual_seed(0)
    layer = Linear(64, 48, bias=True)
    weight, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.pack()
    batched = torch.randn(2, 5, 64)
    strided = torch.randn(7, 128)[:, ::2]
    for x in (batched, strided):
        torch.testing.assert_close(layer(x), F.linear(x, weight, b), atol=1e-5, rtol=1e-5)


def test_other_dtypes_keep_f_linear_bit_for_bit():
    torch.manual_seed(0)
    layer = Linear(32, 16).to(torch.bfloat16)
    weight = layer.weight.detach().clone()
    layer.pack()
    assert layer.packed is None and torch.equal(layer.weight, weight)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, weight, layer.bias))
    assert pack(torch.randn(4, 4, dtype=torch.float64)) is None


@PACKED
@pytest.mark.parametrize("arch", ["llama_gqa", "qwen2_tied"])
def test_a_loaded_model_runs_every_matmul_packed(arch, model_dirs):
    """Loading packs every linear layer, and the logits' weight too (tied embeddings
    get a packed copy and keep the dense table for the lookup)."""
    model = LLM(str(model_dirs[arch]), kv_cache_memory_bytes=8 << 20).engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None and m.weight.numel() == 0 for m in linears)
    assert (model.lm_head is None) == (arch == "qwen2_tied")
    if model.lm_head is None:
        assert model.tied_packed is not None and model.embed_tokens.weight.numel() > 0
