"""The front door: validation, tokenization, (prefill, decode) choice, streaming."""
