"""Router settings, frozen and validated where built."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouterConfig:
    reserve_timeout_s: float = 10.0  # a decode worker's answer to reserve
    prefill_timeout_s: float = 120.0  # prefill incl. the KV transfer
    start_timeout_s: float = 30.0
    control_timeout_s: float = 5.0  # abort and stats calls to a worker
    retry_after_s: float = 1.0  # told to clients on overload
    max_inflight: int = 0  # 0 = no router-side cap

    def __post_init__(self) -> None:
        for name in ("reserve_timeout_s", "prefill_timeout_s", "start_timeout_s",
                     "control_timeout_s", "retry_after_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.max_inflight < 0:
            raise ValueError("max_inflight must be >= 0")
