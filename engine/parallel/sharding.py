"""Which slice of each weight a tensor-parallel rank holds (Megatron-LM's split), pure.

    q heads           column-parallel: rank r holds heads [r*H/N, (r+1)*H/N)
    k/v heads         column-parallel by KV head; with more ranks than KV heads each
                      KV head is replicated on N/Hkv ranks (the ranks whose query
                      heads use it)
    gate/up           column-parallel: a slice of the intermediate size
    o_proj, down_proj row-parallel: the matching input slice, one all-reduce each;
                      the bias is added on rank 0 only, before the sum
    embed, lm_head    vocab-parallel: ceil(V/N) rows each, the last rank's tail padded
                      with zeros; the lookup summed over ranks, logits gathered

A rank's own shapes are a ModelConfig of its local heads and intermediate size
(`local_config`), so its attention, KV cache and transfer layout read as a whole
model's."""
from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.engine.model_config import ModelConfig

FLAG = "tensor_parallel_size"


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Raises ValueError naming the flag where the model cannot be split `size` ways."""
    if size < 1:
        raise ValueError(f"{FLAG} must be >= 1, not {size}")
    problems = []
    if config.num_heads % size:
        problems.append(f"its {config.num_heads} attention heads")
    if config.num_kv_heads % size and size % config.num_kv_heads:
        problems.append(f"its {config.num_kv_heads} KV heads (nor is {size} a multiple "
                        "of them)")
    if config.intermediate_size % size:
        problems.append(f"its intermediate size {config.intermediate_size}")
    if problems:
        raise ValueError(f"{FLAG} {size} does not divide " + " or ".join(problems)
                         + "; choose a size that divides them")


def kv_head_range(num_heads: int, num_kv_heads: int, size: int, rank: int
                  ) -> tuple[int, int]:
    """(first, count) of the KV heads rank `rank` of `size` holds: those its query heads
    read (GQA: query head h reads KV head h // (H / Hkv)); one, replicated, past Hkv
    ranks."""
    first = rank * (num_heads // size) // (num_heads // num_kv_heads)
    return first, max(num_kv_heads // size, 1)


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int
    first_head: int
    num_heads: int
    first_kv_head: int
    num_kv_heads: int
    first_intermediate: int
    intermediate_size: int
    first_vocab: int
    vocab_rows: int  # this rank's embedding / lm_head rows, padding included

    @classmethod
    def of(cls, config: ModelConfig, size: int = 1, rank: int = 0) -> "Shard":
        check_tensor_parallel(config, size)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in a group of {size}")
        heads = config.num_heads // size
        first_kv_head, kv_heads = kv_head_range(config.num_heads, config.num_kv_heads,
                                                size, rank)
        inter = config.intermediate_size // size
        vocab = -(-config.vocab_size // size)
        return cls(rank=rank, size=size, first_head=rank * heads, num_heads=heads,
                   first_kv_head=first_kv_head,
                   num_kv_heads=kv_heads, first_intermediate=rank * inter,
                   intermediate_size=inter, first_vocab=rank * vocab, vocab_rows=vocab)

    @property
    def is_whole(self) -> bool:
        return self.size == 1

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The model as this rank sees it: its heads, KV heads, intermediate size."""
        return replace(config, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                       intermediate_size=self.intermediate_size)

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """The real token ids among this rank's rows: [start, end)."""
        return min(self.first_vocab, vocab_size), min(self.first_vocab + self.vocab_rows,
                                                      vocab_size)
