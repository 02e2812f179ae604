"""The model: a Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a flat token
batch.

    llama.py    the decoder, HF weight names, q/k/v fused into one matmul at load
    linear.py   its matmuls: on an x86-64 CPU in float32, oneDNN over weights packed
                once at load (as vLLM's CPU backend); F.linear elsewhere
    rope.py     rotary embeddings computed exactly as HF transformers does (float32)
    loader.py   HF safetensors checkpoints (single file or sharded) loaded, then packed
"""
