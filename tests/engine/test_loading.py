"""Loading real HF directories: sharded checkpoints, llama3 rope scaling, tokenizer."""
import json
import shutil

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve import LLM
from pdserve.cli import main as cli_main
from pdserve.engine.model_config import ModelConfig


def hf_next_logits(model_dir, tokens):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1]


def test_sharded_checkpoint_loads_the_same_weights(llama_dir, tmp_path):
    sharded = tmp_path / "sharded"
    shutil.copytree(llama_dir, sharded)
    weights = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: weights[k] for k in keys}, str(sharded / file))
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in halves.items() for k in ks}}))
    tokens = list(range(10, 60))
    ours = LLM(str(sharded), kv_cache_memory_bytes=8 << 20).engine.score(tokens)
    torch.testing.assert_close(ours, hf_next_logits(sharded, tokens), atol=1e-4, rtol=0)


def test_llama3_rope_scaling_matches_hf(llama_dir, tmp_path):
    scaled = tmp_path / "llama3"
    shutil.copytree(llama_dir, scaled)
    config = json.loads((scaled / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    config["rope_theta"] = 500000.0
    (scaled / "config.json").write_text(json.dumps(config))
    assert ModelConfig.from_dir(scaled).rope_scaling.rope_type == "llama3"
    tokens = list(range(5, 305))
    ours = LLM(str(scaled), kv_cache_memory_bytes=8 << 20).engine.score(tokens)
    torch.testing.assert_close(ours, hf_next_logits(scaled, tokens), atol=1e-4, rtol=0)


def test_tokenizer_matches_transformers(llama_dir):
    ours = LLM(str(llama_dir), kv_cache_memory_bytes=8 << 20).tokenizer
    theirs = AutoTokenizer.from_pretrained(llama_dir)
    for text in ["Hello, world!", "def f(x):\n    return x * 2", "naïve café — ünïcode ✓", " "]:
        ids = ours.encode(text)
        assert ids == theirs(text).input_ids
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "Hi there"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


def test_make_tiny_model_cli_writes_a_model_transformers_loads(tmp_path, capsys):
    assert cli_main(["make-tiny-model", str(tmp_path / "tiny")]) == 0
    files = {p.name for p in (tmp_path / "tiny").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "generation_config.json"} <= files
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny")
    params = sum(p.numel() for p in hf.parameters())
    assert 10e6 < params < 100e6  # "tens of millions"
    assert str(tmp_path / "tiny") in capsys.readouterr().out
