"""Build small HF-format models locally: seeded random weights plus a byte-level BPE
tokenizer trained here. Loadable by HF transformers and by pdserve alike."""
from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
# ChatML, with tools as Qwen2.5's template writes them (Hermes: the tools' JSON in a
# system block, calls in <tool_call> blocks, results in <tool_response> blocks).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|im_start|>system\n# Tools\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\nCall a function as <tool_call>\n{\"name\": <name>, \"arguments\": "
    "<args-json>}\n</tool_call><|im_end|>\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + m['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + (m['content'] or '') }}"
    "{% for call in m['tool_calls'] or [] %}"
    "{{ '\n<tool_call>\n' + ({'name': call['function']['name'], "
    "'arguments': call['function']['arguments']} | tojson) + '\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@dataclass(frozen=True)
class TinySpec:
    arch: str = "llama"  # "llama" | "qwen2" (q/k/v bias; tie_word_embeddings as set)
    hidden_size: int = 512
    intermediate_size: int = 1536
    num_layers: int = 6
    num_heads: int = 8
    num_kv_heads: int = 2
    vocab_size: int = 8192  # target for BPE training
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    init_std: float = 0.02
    seed: int = 0
    bias: bool = False  # llama: attention_bias and mlp_bias (every projection a bias)


TINY = TinySpec()


def default_cache_dir() -> Path:
    root = os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve"
    return Path(root)


def tiny_model_dir(cache_dir: Path | None = None) -> Path:
    """The cached default tiny model, built on first use."""
    key = hashlib.sha256(json.dumps(asdict(TINY), sort_keys=True).encode()).hexdigest()[:10]
    path = (cache_dir or default_cache_dir()) / f"tiny-llama-{key}"
    if not (path / "config.json").exists():
        make_tiny_model(path, TINY)
    return path


def make_tiny_model(out_dir: str | Path, spec: TinySpec = TINY,
                    tokenizer: Tokenizer | None = None) -> Path:
    out = Path(out_dir)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tok = tokenizer or train_tokenizer(spec.vocab_size)
    tok.save(str(tmp / "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
        "pad_token": EOS, "chat_template": CHAT_TEMPLATE, "model_max_length":
        spec.max_position_embeddings}, indent=2))
    config = _hf_config(spec, vocab, bos, eos)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}, indent=2))
    save_file(_random_weights(spec, vocab), str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    tmp.replace(out) if not out.exists() else _merge(tmp, out)
    return out


def make_draft_model(target_dir: str | Path, out_dir: str | Path, num_layers: int = 1) -> Path:
    """A draft model for speculative decoding built from a target: its first
    `num_layers` layers, its embeddings, norm and head, its tokenizer. Smaller and
    cheaper, and (unlike random weights) it often guesses what the target says."""
    src, out = Path(target_dir), Path(out_dir)
    config = json.loads((src / "config.json").read_text())
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in [1, {config['num_hidden_layers']}]")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).exists():
            (tmp / name).write_bytes((src / name).read_bytes())
    (tmp / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers},
                                                indent=2))
    kept = {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            layer = name.split(".")[2] if name.startswith("model.layers.") else None
            if layer is None or int(layer) < num_layers:
                kept[name] = f.get_tensor(name)
    save_file(kept, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tmp.replace(out) if not out.exists() else _merge(tmp, out)
    return out


def _merge(tmp: Path, out: Path) -> None:
    for f in tmp.iterdir():
        f.replace(out / f.name)
    tmp.rmdir()


def _hf_config(spec: TinySpec, vocab: int, bos: int, eos: int) -> dict:
    qwen = spec.arch == "qwen2"
    return {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": spec.arch,
        "vocab_size": vocab,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.hidden_size // spec.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": spec.bias,
        "mlp_bias": spec.bias,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
        **({"use_sliding_window": False} if qwen else {}),
    }


def _random_weights(spec: TinySpec, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(spec.seed)
    h, i, d = spec.hidden_size, spec.intermediate_size, spec.hidden_size // spec.num_heads
    kv = spec.num_kv_heads * d

    def normal(*shape):
        return torch.randn(*shape, generator=g) * spec.init_std

    w = {"model.embed_tokens.weight": normal(vocab, h), "model.norm.weight": torch.ones(h)}
    for n in range(spec.num_layers):
        p = f"model.layers.{n}."
        w.update({
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": normal(spec.num_heads * d, h),
            p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h),
            p + "self_attn.o_proj.weight": normal(h, spec.num_heads * d),
            p + "mlp.gate_proj.weight": normal(i, h),
            p + "mlp.up_proj.weight": normal(i, h),
            p + "mlp.down_proj.weight": normal(h, i),
        })
        if spec.arch == "qwen2" or spec.bias:
            w.update({p + "self_attn.q_proj.bias": normal(spec.num_heads * d),
                      p + "self_attn.k_proj.bias": normal(kv),
                      p + "self_attn.v_proj.bias": normal(kv)})
        if spec.bias:
            w.update({p + "self_attn.o_proj.bias": normal(h), p + "mlp.gate_proj.bias": normal(i),
                      p + "mlp.up_proj.bias": normal(i), p + "mlp.down_proj.bias": normal(h)})
    if not spec.tie_word_embeddings:
        w["lm_head.weight"] = normal(vocab, h)
    return {k: v.contiguous() for k, v in w.items()}


def train_tokenizer(vocab_size: int = TINY.vocab_size) -> Tokenizer:
    """Byte-level BPE (as Llama 3 / Qwen2 use) trained on text shipped with Python."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[BOS, EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


def _corpus():
    """Deterministic local text: the standard library's own sources and docs."""
    stdlib = Path(os.__file__).parent
    for name in sorted(["argparse.py", "textwrap.py", "difflib.py", "pydoc.py", "inspect.py",
                        "typing.py", "dataclasses.py", "statistics.py", "fractions.py",
                        "calendar.py", "email/message.py", "http/client.py", "json/decoder.py",
                        "unittest/case.py", "logging/__init__.py", "tarfile.py", "this.py"]):
        path = stdlib / name
        if path.exists():
            yield path.read_text(encoding="utf-8", errors="replace")
    yield sys.copyright
