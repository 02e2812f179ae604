"""Load HF safetensors checkpoints (single file or sharded) into LlamaForCausalLM."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.engine.model.llama import LlamaForCausalLM
from pdserve.engine.model_config import ModelConfig

# HF name -> (our parameter name, shard index inside the fused parameter)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")


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
               dtype: torch.dtype) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for path in checkpoint_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                target = _copy(name, f.get_tensor(name), params, config)
                if target is not None:
                    loaded.add(target)
    missing = {n for n in params if not _covered(n, loaded)}
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks weights for: {sorted(missing)[:8]}")
    model.pack()
    return model.eval()


def _copy(name: str, tensor: torch.Tensor, params: dict, config: ModelConfig) -> str | None:
    """Copy one checkpoint tensor into place; returns the key marking it loaded."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return None
    m = _LAYER.match(name)
    if m and m.group(3) in _FUSED:
        layer, block, proj, kind = m.groups()
        fused, shard = _FUSED[proj]
        target = f"layers.{layer}.{block}.{fused}.{kind}"
        sizes = [config.q_size, config.kv_size, config.kv_size]
        offset = sum(sizes[:shard])
        params[target].data[offset:offset + sizes[shard]].copy_(tensor)
        return f"{target}#{shard}"
    target = name.removeprefix("model.")
    if target not in params:
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    if params[target].shape != tensor.shape:
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(params[target].shape)}")
    params[target].data.copy_(tensor)
    return target


def _covered(param: str, loaded: set[str]) -> bool:
    if param in loaded:
        return True
    return ".qkv_proj." in param and all(f"{param}#{i}" in loaded for i in range(3))
