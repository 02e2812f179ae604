"""Frozen, validated engine configuration. Built once, passed in through constructors."""
from __future__ import annotations

from dataclasses import Field, dataclass, field, fields

from pdserve.engine.options import option
from pdserve.engine.spec_decode.config import SpeculativeConfig

POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap", "auto")  # engine/scheduler.py
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("torch", "triton")  # engine/attention.py


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = option(256, "the most requests in one step; 0 = unbounded")
    max_num_batched_tokens: int = option(2048, "tokens per step, shared by decodes and "
                                         "prefill chunks")
    long_prefill_token_threshold: int = option(0, "chunked prefill: the most prompt tokens "
                                               "one request computes per step; 0 = no cap")
    prioritize_prefill: bool = option(False, "spend the token budget on prefill chunks "
                                      "and new prompts before decodes")
    policy: str = option("fcfs", "fcfs, or priority (lower SamplingParams.priority first)",
                         choices=POLICIES)
    waiting_timeout: bool = option(
        True, "a request still waiting for its first token past --waiting-timeout-share "
        "of its TTFT SLO (the router's) preempts the lowest-priority running decode to "
        "be admitted: at most one a step, and never a decode preempted before")
    waiting_timeout_share: float = option(0.5, "the share of its TTFT SLO a request may "
                                          "wait before the waiting timeout applies",
                                          gt=0, le=1)
    preemption_mode: str = option(
        "auto", "what a preempted request's KV becomes: recompute (freed, its tokens "
        "computed again later), swap (copied to the --swap-space host area, copied back "
        "to resume), or auto (per request, whichever costs less: its recompute time "
        "against its bytes over the measured copy bandwidth); without swap space, "
        "recompute", choices=PREEMPTION_MODES)

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 0, "max_num_seqs", "must be >= 0")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        _check(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold",
               "must be >= 0")
        _check(self.policy in POLICIES, "policy", f"must be one of {POLICIES}")
        _check(0 < self.waiting_timeout_share <= 1, "waiting_timeout_share",
               "must be in (0, 1]")
        _check(self.preemption_mode in PREEMPTION_MODES, "preemption_mode",
               f"must be one of {PREEMPTION_MODES}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = option(16, "tokens per KV block")
    enable_prefix_caching: bool = option(True, "reuse the KV of full blocks that share a "
                                         "prefix (chained block hashes)")
    kv_cache_memory_bytes: int | None = option(None, "KV cache budget in bytes, per device "
                                               "(each tensor-parallel rank); unset: a "
                                               "share of free memory")
    num_kv_blocks: int | None = option(None, "KV blocks, overriding the memory budget")
    swap_space: float = option(0.0, "GiB of host memory per device (pinned on cuda) where "
                               "preempted requests' KV waits to resume (--preemption-mode "
                               "swap or auto); 0 = none", ge=0)
    kv_offloading_size: float = option(
        0.0, "GiB of host memory per device (pinned on cuda) holding full KV blocks by "
        "prefix hash, least recently used out first: a prefix evicted from the device is "
        "loaded back from there instead of recomputed; 0 = none", ge=0)

    def __post_init__(self) -> None:
        _check(self.block_size >= 1, "block_size", "must be >= 1")
        _check(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
               "kv_cache_memory_bytes", "must be > 0")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 1,
               "num_kv_blocks", "must be >= 1")
        _check(self.swap_space >= 0, "swap_space", "must be >= 0")
        _check(self.kv_offloading_size >= 0, "kv_offloading_size", "must be >= 0")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    device: str = option("cpu", "cpu, cuda or cuda:N")
    dtype: str | None = option(None, "unset: float32 on cpu, bfloat16 on cuda",
                               choices=DTYPES)
    max_model_len: int | None = option(None, "context length; unset: the model's "
                                       "max_position_embeddings")
    seed: int = option(0, "seeds unseeded sampling")
    tensor_parallel_size: int = option(
        1, "ranks (devices) one worker's model is split across, Megatron-style: Ray actors "
        "in one placement group, one torch.distributed group", ge=1)
    num_threads: int | None = option(None, "torch intra-op threads on cpu; unset: torch's "
                                     "default")
    gpu_memory_utilization: float = option(0.9, "share of GPU memory the worker may use")
    attention_backend: str | None = option(
        None, "torch (SDPA over gathered blocks, any device) or triton (a paged kernel "
        "reading blocks in place); unset: triton on cuda, torch on cpu",
        choices=ATTENTION_BACKENDS)
    enforce_eager: bool = option(False, "never capture CUDA graphs: decode steps run "
                                 "eagerly (graphs need cuda and the triton backend)")
    speculative_config: SpeculativeConfig | None = option(
        None, 'speculative decoding, vLLM\'s shape: {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5} or '
        '{"method": "draft_model", "model": DIR, "num_speculative_tokens": 4}')
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)

    def __post_init__(self) -> None:
        _check(self.device.split(":")[0] in ("cpu", "cuda"), "device", "must be cpu or cuda[:N]")
        _check(self.dtype in (None, *DTYPES), "dtype",
               "must be float32, bfloat16 or float16")
        _check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len",
               "must be >= 1")
        _check(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
               "must be in (0, 1]")
        _check(self.attention_backend in (None, *ATTENTION_BACKENDS), "attention_backend",
               f"must be one of {ATTENTION_BACKENDS}")
        if self.speculative_config is not None:  # a dict (JSON, kwargs) or the config
            object.__setattr__(self, "speculative_config",
                               SpeculativeConfig.of(self.speculative_config))

    @property
    def resolved_dtype(self) -> str:
        if self.dtype is not None:
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"

    @classmethod
    def flat_fields(cls) -> list[Field]:
        """The engine arguments as vLLM spells them: one flat list (CLI flags, LLM kwargs)."""
        own = [f for f in fields(cls) if f.name not in ("model", "scheduler", "cache")]
        return own + list(fields(SchedulerConfig)) + list(fields(CacheConfig))

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        """Flat vLLM-style engine args (max_num_seqs=..., block_size=...) to nested config."""
        sched_keys = {f.name for f in fields(SchedulerConfig)}
        cache_keys = {f.name for f in fields(CacheConfig)}
        own_keys = {f.name for f in fields(cls)} - {"scheduler", "cache", "model"}
        unknown = set(kwargs) - {f.name for f in cls.flat_fields()}
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
