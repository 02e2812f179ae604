"""What tensor parallelism adds to a step, counted and timed where two cores can say
anything: the all-reduces and their bytes, the logits gather, and rank 0's broadcast
of the step (pickling plus the send), against the step itself.

Rank 1 is a process of its own (as a Ray actor would be), joined to this one over
loopback gloo; on two cores a TP-2 step's time says nothing about a GPU's, so it is
reported, not compared. The baseline is the same steps at TP 1, in the same
run: `broadcast_share` = rank 0's broadcast time / the TP-1 step time (what the
broadcast would cost a step as fast as this machine's whole-model one). The broadcast's
time includes waiting for the other rank to post its receive (to finish the previous
step); `pack_us` is rank 0's own work, describing the step, as timed in the run, and
`pack_alone_us` the same description timed alone in a loop (2 cores shared by two
ranks' processes and their gloo threads inflate the first).

Decode steps at batch 1, 32 and 128 over 256-token contexts, --rounds rounds each;
medians with [min, max]. The per-step collectives of a real-size model (bf16) follow
from the same counts: `--config llama-3-70b` prints them for TP 2, 4 and 8.
Prints JSON and the ratio last; writes the JSON to --out."""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.report import save_json  # noqa: E402
from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.engine import LLMEngine  # noqa: E402
from pdserve.engine.model_config import ModelConfig  # noqa: E402
from pdserve.engine.parallel.follower import Follower  # noqa: E402
from pdserve.engine.parallel.group import TensorParallelGroup  # noqa: E402
from pdserve.engine.parallel.messages import Forward  # noqa: E402
from pdserve.kv_transfer import rendezvous  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.engine.tiny_model import tiny_model_dir  # noqa: E402

CONFIGS = Path(__file__).parent / "configs"
CONTEXT, DECODE_STEPS = 256, 16
PACKS = 2000  # a step described this many times in a row, nothing else running


def _follow(config: EngineConfig, port: int) -> None:
    store = rendezvous.connect("127.0.0.1", port, 120)
    group = TensorParallelGroup.join(store, 1, 2, "127.0.0.1", torch.device("cpu"))
    Follower(config, group).serve()


@contextmanager
def two_process_engine(config: EngineConfig):
    """Rank 0's engine here, rank 1 in a spawned process, until the engine closes."""
    store = rendezvous.serve("127.0.0.1", 120)
    rank1 = mp.get_context("spawn").Process(target=_follow, args=(config, store.port))
    rank1.start()
    engine = LLMEngine(config, TensorParallelGroup.join(store, 0, 2, "127.0.0.1",
                                                        torch.device("cpu")))
    try:
        yield engine
    finally:
        engine.close()
        rank1.join(timeout=60)


def decode_steps(engine: LLMEngine, batch: int, round_: int) -> tuple[float, dict]:
    """Seconds per decode step of `batch` sequences (prefills excluded), and what the
    group's counters gained per decode step (TP > 1)."""
    params = SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{round_}-{i}", [7 + (i + j) % 900 for j in range(CONTEXT)], params)
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()  # the prompts
    group = engine.runner.group
    before = dict(vars(group.stats)) if group else {}
    began, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        if steps == DECODE_STEPS // 2 and group is not None:
            step = engine.runner._prepare(  # a decode step of this batch, described alone
                [(r, 1) for r in engine.scheduler.running], {})
        engine.step()
        steps += 1
    seconds = (time.perf_counter() - began) / steps
    if group is None:
        return seconds, {}
    counts = {k: (v - before[k]) / steps for k, v in vars(group.stats).items()}
    began = time.perf_counter()
    for _ in range(PACKS):
        group.pack(Forward(step=step))
    counts["pack_alone_s"] = (time.perf_counter() - began) / PACKS
    return seconds, counts


def spread(values: list[float]) -> list[float]:
    return [statistics.median(values), min(values), max(values)]


def measure(model: str, batches: list[int], rounds: int, threads: int | None) -> dict:
    base = dict(kv_cache_memory_bytes=256 << 20, max_num_seqs=max(batches),
                max_num_batched_tokens=max(2048, CONTEXT * 8), num_threads=threads)
    rows = {}
    whole = LLMEngine(EngineConfig.from_kwargs(model, **base))
    with two_process_engine(EngineConfig.from_kwargs(model, tensor_parallel_size=2,
                                                     **base)) as tp:
        for batch in batches:
            one, two, per = [], [], []
            for r in range(rounds):
                one.append(decode_steps(whole, batch, r)[0])
                seconds, counts = decode_steps(tp, batch, r)
                two.append(seconds)
                per.append(counts)
            rows[batch] = {
                "tp1_step_ms": spread([s * 1e3 for s in one]),
                "tp2_step_ms": spread([s * 1e3 for s in two]),
                "broadcast_us": spread([c["broadcast_s"] * 1e6 for c in per]),
                "pack_us": spread([c["pack_s"] * 1e6 for c in per]),
                "pack_alone_us": spread([c["pack_alone_s"] * 1e6 for c in per]),
                "broadcast_bytes": statistics.mean(c["broadcast_bytes"] for c in per),
                "all_reduces_per_step": statistics.mean(c["all_reduces"] for c in per),
                "all_reduce_bytes_per_step": statistics.mean(c["all_reduce_bytes"] for c in per),
                "gathers_per_step": statistics.mean(c["gathers"] for c in per),
                "broadcast_share": spread([c["broadcast_s"] / o for c, o in zip(per, one)]),
            }
    return rows


def real_size(config_name: str, batches: list[int]) -> dict:
    """Per decode step of a real-size model in bf16, from the same counts: 2 all-reduces
    per layer and one for the embedding, each of a [batch, hidden] buffer, of which a
    ring all-reduce sends 2 (N - 1) / N from each rank; the logits gather brings
    [batch, vocab / N] from each of the N - 1 other ranks to rank 0."""
    model = ModelConfig.from_hf_dict(json.loads((CONFIGS / f"{config_name}.json").read_text()))
    mib = 1 << 20
    out = {}
    for size in (2, 4, 8):
        ring = 2 * (size - 1) / size
        out[size] = {b: {"all_reduces": 2 * model.num_layers + 1,
                         "buffer_mib": (2 * model.num_layers + 1) * b * model.hidden_size * 2 / mib,
                         "sent_per_rank_mib": ring * (2 * model.num_layers + 1) * b
                         * model.hidden_size * 2 / mib,
                         "gather_to_rank0_mib": (size - 1) * b * -(-model.vocab_size // size)
                         * 2 / mib}
                     for b in batches}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a local HF dir; default: the tiny model")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per rank (two ranks share this machine's cores)")
    parser.add_argument("--config", default="llama-3-70b", help="a config in configs/")
    parser.add_argument("--out", default="bench-results/tensor_parallel.json")
    args = parser.parse_args()
    model = args.model or str(tiny_model_dir())
    result = {"when": datetime.datetime.now().isoformat(timespec="seconds"),
              "model": model, "context": CONTEXT, "rounds": args.rounds,
              "measured": measure(model, args.batches, args.rounds, args.threads),
              args.config: real_size(args.config, args.batches)}
    print(json.dumps(result, indent=2))
    save_json(args.out, result)
    for batch, row in result["measured"].items():
        b = row["broadcast_us"]
        print(f"batch {batch}: broadcast {b[0]:.0f} us [{b[1]:.0f}, {b[2]:.0f}] per step "
              f"(describing it {row['pack_us'][0]:.0f} us in the run, "
              f"{row['pack_alone_us'][0]:.1f} us alone; {row['broadcast_bytes']:.0f} B); "
              f"{row['all_reduces_per_step']:.0f} all-reduces of "
              f"{row['all_reduce_bytes_per_step'] / 1024:.0f} KiB; broadcast / TP-1 step = "
              f"{row['broadcast_share'][0]:.3f}")


if __name__ == "__main__":
    main()
