"""The prefill role: batched / chunked prefill with prefix caching, KV streamed out."""
