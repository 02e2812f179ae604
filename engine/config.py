"""Frozen, validated engine configuration. Built once, passed in through constructors."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # 0 = unbounded
    max_num_batched_tokens: int = 2048  # shared by decodes and prefill chunks
    long_prefill_token_threshold: int = 0  # per-request chunk cap; 0 = no cap
    prioritize_prefill: bool = False
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 0, "max_num_seqs", "must be >= 0")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        _check(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold",
               "must be >= 0")
        _check(self.policy in POLICIES, "policy", f"must be one of {POLICIES}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None  # None: a share of free memory
    num_kv_blocks: int | None = None  # overrides the memory budget (tests, simulator)

    def __post_init__(self) -> None:
        _check(self.block_size >= 1, "block_size", "must be >= 1")
        _check(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
               "kv_cache_memory_bytes", "must be > 0")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 1,
               "num_kv_blocks", "must be >= 1")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    device: str = "cpu"
    dtype: str | None = None  # None: float32 on cpu, bfloat16 on cuda
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on cpu; None: torch's default
    gpu_memory_utilization: float = 0.9
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)

    def __post_init__(self) -> None:
        _check(self.device.split(":")[0] in ("cpu", "cuda"), "device", "must be cpu or cuda[:N]")
        _check(self.dtype in (None, "float32", "bfloat16", "float16"), "dtype",
               "must be float32, bfloat16 or float16")
        _check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len",
               "must be >= 1")
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
               "must be in (0, 1]")

    @property
    def resolved_dtype(self) -> str:
        if self.dtype is not None:
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        """Flat vLLM-style engine args (max_num_seqs=..., block_size=...) to nested config."""
        sched_keys = {f.name for f in fields(SchedulerConfig)}
        cache_keys = {f.name for f in fields(CacheConfig)}
        own_keys = {f.name for f in fields(cls)} - {"scheduler", "cache", "model"}
        unknown = set(kwargs) - sched_keys - cache_keys - own_keys
        if unknown:
            raise TypeError(f"unknown engine argument(s): {sorted(unknown)}")
        return cls(
            model=model,
            scheduler=SchedulerConfig(**{k: v for k, v in kwargs.items() if k in sched_keys}),
            cache=CacheConfig(**{k: v for k, v in kwargs.items() if k in cache_keys}),
            **{k: v for k, v in kwargs.items() if k in own_keys},
        )


def _check(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise ValueError(f"{name} {why}")
