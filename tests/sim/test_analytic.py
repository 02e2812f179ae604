"""The analytic profile of a tensor-parallel worker: FLOPs, weights and KV heads split
N ways, its collectives over the node's link, the model refused where it does not fit."""
from __future__ import annotations

import json

import pytest

from pdserve.engine.model_config import ModelConfig
from pdserve.engine.step_shape import StepShape
from pdserve.sim.analytic import (
    ACCELERATORS,
    NAMED_CONFIGS,
    Efficiency,
    Roofline,
    analytic_profile,
)
from pdserve.sim.profile import Profile

LLAMA_8B = ModelConfig.from_hf_dict(NAMED_CONFIGS["llama-3-8b"])
PREFILL = StepShape(prefill_tokens=2048, prefill_pairs=2048 * 2049 // 2)
DECODE_ONE = StepShape(decode_seqs=1, decode_context=1024)


def roof(tp: int, accel: str = "h100") -> Roofline:
    return Roofline(LLAMA_8B, ACCELERATORS[accel], Efficiency(), tp)


def test_a_split_model_computes_faster_but_pays_its_collectives():
    assert roof(1).collectives_s(2048, 1) == 0.0
    assert roof(4).seconds(PREFILL) < roof(2).seconds(PREFILL) < roof(1).seconds(PREFILL)
    # Not 4x: the fixed overhead and 65 all-reduces of [2048, 4096] stay.
    assert roof(4).seconds(PREFILL) > roof(1).seconds(PREFILL) / 4
    assert roof(4).collectives_s(2048, 1) > 65 * 2 * 3 / 4 * 2048 * 4096 * 2 / 450e9
    # One decode: the collectives' latencies, and PCIe is slower than NVLink.
    assert roof(8, "l40s").collectives_s(1, 1) > roof(8, "h100").collectives_s(1, 1)


def test_a_70b_model_fits_four_h100s_not_two_and_keeps_more_kv_on_eight():
    config = NAMED_CONFIGS["llama-3-70b"]
    for n in (1, 2):
        with pytest.raises(ValueError, match=f"does not fit {n} x NVIDIA H100.*"
                                             f"tensor_parallel_size {n}"):
            analytic_profile("llama-3-70b", config, "h100", tensor_parallel_size=n)
    four = analytic_profile("llama-3-70b", config, "h100", tensor_parallel_size=4)
    eight = analytic_profile("llama-3-70b", config, "h100", tensor_parallel_size=8)
    assert (four.tensor_parallel_size, eight.tensor_parallel_size) == (4, 8)
    assert eight.num_kv_blocks > 2 * four.num_kv_blocks  # the weights' share halves too
    assert four.kv_bytes_per_block == eight.kv_bytes_per_block  # the worker's, whole
    assert any("NVLink 4" in note for note in four.notes)
    assert eight.step_cost.base_s < four.step_cost.base_s  # weights read 8 ways
    assert eight.startup_s == four.startup_s  # one node's disk reads the model once


def test_k_and_v_projections_are_replicated_past_the_kv_heads():
    model = ModelConfig.from_hf_dict(NAMED_CONFIGS["llama-3-70b"])  # 8 KV heads
    eight, sixteen = (Roofline(model, ACCELERATORS["h100"], Efficiency(), n) for n in (8, 16))
    assert eight.rank_layer_params == pytest.approx(eight.layer_params / 8)
    assert sixteen.rank_layer_params > sixteen.layer_params / 16
    kv_proj = model.num_layers * 2 * model.hidden_size * model.head_dim  # one KV head's
    assert sixteen.rank_layer_params - kv_proj / 2 == pytest.approx(
        sixteen.layer_params / 16)


def test_a_size_the_model_cannot_split_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="tensor_parallel_size 8 does not divide its 28 "
                                         "attention heads"):
        analytic_profile("qwen2-7b", NAMED_CONFIGS["qwen2-7b"], "h100", tensor_parallel_size=8)


def test_a_profile_carries_its_tensor_parallel_size_and_old_files_read_as_one(tmp_path):
    profile = analytic_profile("llama-3-8b", NAMED_CONFIGS["llama-3-8b"], "h100",
                               tensor_parallel_size=2)
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == profile
    data = json.loads(profile.to_json())
    del data["tensor_parallel_size"]
    assert Profile.from_json(json.dumps(data)).tensor_parallel_size == 1
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        Profile.from_json(json.dumps({**data, "tensor_parallel_size": 0}))
