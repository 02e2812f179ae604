"""The decode role: block reservation, KV import, continuous batching, streaming."""
