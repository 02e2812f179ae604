"""One worker: a Ray actor hosting one engine in role prefill, decode or both."""
