"""What the simulator needs to know of a worker: how long its engine steps take (a
StepCost: seconds as a linear function of the step's shape, as the router's latency
model fits it), how long a KV transfer between two workers stays exposed (a
TransferCost), and how much KV it holds. A profile is measured on a machine
(`pdserve profile`, pdserve/sim/measure.py) or built from a model's config and an
accelerator's stated speeds (analytic.py), and says which.

On disk it is JSON (docs/simulator.md):

    {"version": 1, "name": ..., "source": "measured" | "analytic",
     "step_cost": {"base_s", "prefill_token_s", "prefill_pair_s", "decode_seq_s",
                   "decode_context_s"},
     "transfer_cost": {"latency_s", "per_byte_s"},
     "num_kv_blocks", "block_size", "kv_bytes_per_block", "max_model_len",
     "vocab_size", "tensor_parallel_size", "step_noise", "startup_s",
     "host_copy_s_per_block", "notes": [...]}

A worker of tensor_parallel_size N takes N devices; its num_kv_blocks and
kv_bytes_per_block are the worker's (each block's bytes over all its ranks)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.engine.latency_model import StepCost, TransferCost

VERSION = 1
SOURCES = ("measured", "analytic")


@dataclass(frozen=True)
class Profile:
    name: str  # what it profiles: the model and the machine
    source: str  # measured | analytic
    step_cost: StepCost
    transfer_cost: TransferCost
    num_kv_blocks: int  # a worker's KV cache
    block_size: int  # tokens per KV block
    kv_bytes_per_block: int  # one block's KV, all layers (what a transfer moves)
    max_model_len: int
    vocab_size: int
    tensor_parallel_size: int = 1  # devices a worker takes (its ranks)
    # Relative spread of a step's duration around its cost (the measured fit's
    # residuals, as a standard deviation): the simulator draws each step's from it.
    step_noise: float = 0.0
    # A new worker's seconds from being asked for to its engine loaded (process, device,
    # weights, KV allocation): a simulated worker waits this long before it serves.
    startup_s: float = 0.0
    # One block copied between device and host memory, one way (each rank its own
    # share, in parallel): what swapping and the host prefix tier cost. 0: unknown
    # (a profile from before they existed), and then free.
    host_copy_s_per_block: float = 0.0
    notes: tuple[str, ...] = ()  # how it was made: the machine, or the model's assumptions

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, not {self.source!r}")
        for name in ("num_kv_blocks", "block_size", "max_model_len", "vocab_size",
                     "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.kv_bytes_per_block < 0 or not 0 <= self.step_noise < 1:
            raise ValueError("kv_bytes_per_block must be >= 0 and step_noise in [0, 1)")
        if not self.startup_s >= 0 or not self.host_copy_s_per_block >= 0:
            raise ValueError("startup_s and host_copy_s_per_block must be numbers >= 0")
        costs = list(asdict(self.step_cost).values()) + list(asdict(self.transfer_cost).values())
        if any(not c >= 0 for c in costs):
            raise ValueError("every step and transfer cost must be a number >= 0")

    def to_json(self) -> str:
        return json.dumps({"version": VERSION, **asdict(self), "notes": list(self.notes)},
                          indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        data = json.loads(text)
        if data.pop("version", None) != VERSION:
            raise ValueError(f"not a version-{VERSION} pdserve profile")
        try:
            return cls(**{**data, "step_cost": StepCost(**data["step_cost"]),
                          "transfer_cost": TransferCost(**data["transfer_cost"]),
                          "notes": tuple(data.get("notes", ()))})
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a pdserve profile: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        try:
            return cls.from_json(Path(path).read_text())
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")
