"""Load HF safetensors checkpoints (single file or sharded) into LlamaForCausalLM.

A tensor-parallel rank reads only its slice of each tensor (safetensors' get_slice):
the rows or columns its Shard names (engine/parallel/sharding.py)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.engine.model.llama import LlamaForCausalLM
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel.group import TensorParallelGroup
from pdserve.engine.parallel.sharding import Shard

# HF name -> (our parameter name, shard index inside the fused parameter)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")
_ROW_PARALLEL = ("o_proj", "down_proj")  # split by input columns; bias on rank 0 only
_VOCAB = ("embed_tokens.weight", "lm_head.weight")  # split by rows, the last rank's padded


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def load_model(model_dir: str | Path, config: ModelConfig, device: torch.device,
               dtype: torch.dtype, shard: Shard | None = None,
               group: TensorParallelGroup | None = None) -> LlamaForCausalLM:
    """config: the whole model's; shard: this rank's part (the whole model if None)."""
    shard = shard or Shard.of(config)
    with torch.device("meta"):
        model = LlamaForCausalLM(shard.local_config(config), shard, group)
        # Every checkpoint tensor is checked whole against the whole model's shapes
        # before a rank takes its slice (no memory: on the meta device).
        whole = {n: tuple(p.shape) for n, p in LlamaForCausalLM(config).named_parameters()}
    model = model.to_empty(device=device).to(dtype)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for path in checkpoint_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                target = _copy(name, f.get_slice(name), params, whole, config, shard)
                if target is not None:
                    loaded.add(target)
    missing = {n for n in params if not _covered(n, loaded)}
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks weights for: {sorted(missing)[:8]}")
    model.pack()
    return model.eval()


def _copy(name: str, tensor, params: dict, whole: dict, config: ModelConfig,
          shard: Shard) -> str | None:
    """Copy this rank's part of one checkpoint tensor (a safetensors slice) into place;
    returns the key marking it loaded."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return None
    d = config.head_dim
    m = _LAYER.match(name)
    if m and m.group(3) in _FUSED:
        layer, block, proj, kind = m.groups()
        fused, part = _FUSED[proj]
        target = f"layers.{layer}.{block}.{fused}.{kind}"
        if target not in whole:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        rows = [config.q_size, config.kv_size, config.kv_size][part]
        _check_shape(name, tensor, (rows,) + whole[target][1:])
        first, count = ((shard.first_head, shard.num_heads) if part == 0
                        else (shard.first_kv_head, shard.num_kv_heads))
        sizes = [shard.num_heads * d, shard.num_kv_heads * d, shard.num_kv_heads * d]
        offset = sum(sizes[:part])
        params[target].data[offset:offset + sizes[part]].copy_(
            tensor[first * d:(first + count) * d])
        return f"{target}#{part}"
    target = name.removeprefix("model.")
    if target not in whole:
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    _check_shape(name, tensor, whole[target])
    if target not in params:
        return target  # a row-parallel bias: rank 0's alone to add
    param = params[target].data
    part = _part(m, target, tensor, config, shard)
    param[:part.shape[0]].copy_(part)
    param[part.shape[0]:].zero_()  # a vocab-parallel table's padding rows (last rank)
    return target


def _check_shape(name: str, tensor, expected: tuple) -> None:
    shape = tuple(tensor.get_shape())
    if shape != tuple(expected):
        raise ValueError(f"weight {name!r} has shape {shape}, expected {tuple(expected)}")


def _part(m, target: str, tensor, config: ModelConfig, shard: Shard) -> torch.Tensor:
    """This rank's rows or columns of a tensor other than q/k/v (checked whole)."""
    if shard.is_whole:
        return tensor[:]
    if target in _VOCAB:
        start, end = shard.vocab_range(config.vocab_size)
        return tensor[start:end]
    if m is None:
        return tensor[:]  # norms: whole on every rank
    proj, kind = m.group(3), m.group(4)
    if proj in ("gate_proj", "up_proj"):
        return tensor[shard.first_intermediate:shard.first_intermediate
                      + shard.intermediate_size]
    if proj in _ROW_PARALLEL and kind == "weight":
        first, width = ((shard.first_intermediate, shard.intermediate_size)
                        if proj == "down_proj" else
                        (shard.first_head * config.head_dim, shard.num_heads * config.head_dim))
        return tensor[:, first:first + width]
    return tensor[:]  # a bias of a row-parallel layer (rank 0's, whole)


def _covered(param: str, loaded: set[str]) -> bool:
    if param in loaded:
        return True
    return ".qkv_proj." in param and all(f"{param}#{i}" in loaded for i in range(3))
