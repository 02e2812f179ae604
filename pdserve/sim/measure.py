"""`pdserve profile`: measures one worker on this machine for the simulator. Its
engine steps are timed over a grid of the shapes serving sees and an in-process
prefill -> decode pair's exposed KV transfers are timed by the router's own
sequence; each is fitted by the router's own models (latency_model.StepModel,
TransferModel), so the simulator forecasts with what the router would have learned.
The result is a Profile of source "measured" (profile.py).

The grid, each round run to its end on an otherwise idle engine, all of it once as a
warm-up and then `repeats` times:
    prompts alone            one prompt of each length (chunked as the config says)
    decode batches           DECODE_STEPS steps of a batch, at a short and a long context
    prompts beside decodes   a prompt arriving while a decode batch runs
A round's decodes join as a decode worker's do, their KV taken as transferred
(reserve_remote, admit_remote): no prompt is computed for them. No two prompts share
a block, so the prefix cache never hits.

torch and the engine are imported where they are used: `pdserve --help` imports
`add_profile_parser`."""
from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import os
import platform
import random
import statistics
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from pdserve import cli_flags
from pdserve.engine.block_manager import blocks_for
from pdserve.engine.latency_model import (
    DEFAULT_TRANSFER_COST,
    StepCost,
    StepModel,
    TransferCost,
    TransferModel,
)
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.step_shape import StepTiming
from pdserve.sim.profile import Profile

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.kv_transfer import TransferConfig
    from pdserve.worker.worker import Worker

PROMPT_LENGTHS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
DECODE_CONTEXTS = (128, 1024)  # each at most what the context leaves room for
DECODE_STEPS = 8
MIXED_BATCHES = (4, 16)  # beside MIXED_PROMPTS, at the short context
MIXED_PROMPTS = (64, 256, 1024)
TRANSFER_LENGTHS = (16, 64, 256, 1024, 4096, 16384)
MAX_NOISE = 0.9  # a Profile's step_noise is below 1
_MAX_ROUND_STEPS = 10_000  # a round that cannot finish fails the measurement, not hangs it
_FIRST_TOKEN_ONLY = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


@dataclass(frozen=True)
class Round:
    """A prompt arriving while a decode batch runs; either may be absent."""
    prompt_tokens: int = 0
    decode_seqs: int = 0
    decode_context: int = 0  # each decode's KV length when it joins


@dataclass(frozen=True)
class StepFit:
    cost: StepCost
    noise: float  # standard deviation of measured / predicted - 1, within [0, MAX_NOISE]
    median_error: float  # median of |measured / predicted - 1|
    num_samples: int


@dataclass(frozen=True)
class TransferSample:
    nbytes: int  # KV bytes the prefill worker sent
    seconds: float  # exposed: the last prefill step's end -> KV confirmed on the decode side


# ---- the step grid ------------------------------------------------------------------


def serving_rounds(*, max_model_len: int, num_blocks: int, block_size: int,
                   max_num_seqs: int) -> list[Round]:
    """The grid, less the rounds that would not fit the context, half the KV cache
    (no preemption) or max_num_seqs (0: unbounded)."""
    room = max_model_len - DECODE_STEPS - 1  # for the first token and the steps after
    contexts = sorted({min(c, room) for c in DECODE_CONTEXTS}) if room > 0 else []
    rounds = [Round(prompt_tokens=n) for n in PROMPT_LENGTHS]
    rounds += [Round(decode_seqs=b, decode_context=c) for c in contexts for b in DECODE_BATCHES]
    rounds += [Round(prompt_tokens=n, decode_seqs=b, decode_context=c)
               for c in contexts[:1] for b in MIXED_BATCHES for n in MIXED_PROMPTS]

    def fits(r: Round) -> bool:
        kv = (blocks_for(r.prompt_tokens + 1, block_size)
              + r.decode_seqs * blocks_for(r.decode_context + DECODE_STEPS + 1, block_size))
        seqs = r.decode_seqs + (r.prompt_tokens > 0)
        return (r.prompt_tokens < max_model_len and kv <= num_blocks // 2
                and (not max_num_seqs or seqs <= max_num_seqs))

    return [r for r in rounds if fits(r)]


def engine_rounds(engine: LLMEngine) -> list[Round]:
    blocks = engine.block_manager
    return serving_rounds(max_model_len=engine.max_model_len, num_blocks=blocks.num_blocks,
                          block_size=blocks.block_size,
                          max_num_seqs=engine.config.scheduler.max_num_seqs)


def measure_steps(engine: LLMEngine, *, repeats: int = 3, seed: int = 0) -> list[StepTiming]:
    """The grid's steps on an idle engine that serves nothing afterwards: its prefix
    cache is left holding the admitted decodes' blocks, whose KV was never computed."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    rounds, rng = engine_rounds(engine), random.Random(seed)
    for r in rounds:  # warm-up: first calls and allocator growth stay out of the fit
        run_round(engine, r, rng)
    return [t for _ in range(repeats) for r in rounds for t in run_round(engine, r, rng)]


def run_round(engine: LLMEngine, r: Round, rng: random.Random) -> list[StepTiming]:
    """Runs one round to its end on an idle engine; returns its steps' timings."""
    vocab = engine.model_config.vocab_size
    tag = f"__measure-{engine.num_steps}"  # every round takes a step: ids never repeat
    decode = SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0, ignore_eos=True)
    for i in range(r.decode_seqs):
        rid = f"{tag}-d{i}"
        if engine.reserve_remote(rid, unrelated_prompt(rng, r.decode_context, vocab),
                                 decode) is None:
            raise RuntimeError(f"no KV room for the round {r}")
        engine.admit_remote(rid, first_token=rng.randrange(vocab))
    if r.prompt_tokens:
        engine.add_request(f"{tag}-p", unrelated_prompt(rng, r.prompt_tokens, vocab),
                           _FIRST_TOKEN_ONLY)
    return _steps_until_idle(engine)


def unrelated_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    """Random ids above the first few (special tokens): no two such prompts share a
    first block, so none hits the prefix cache."""
    return [rng.randrange(4, vocab) for _ in range(n)]


def _steps_until_idle(engine: LLMEngine) -> list[StepTiming]:
    timings = []
    for _ in range(_MAX_ROUND_STEPS):
        if not engine.has_unfinished():
            return timings
        before = engine.num_steps
        engine.step()
        if engine.num_steps > before:  # an empty step is not timed
            timings.append(engine.step_timings[-1])
    raise RuntimeError(f"a measurement round made no end within {_MAX_ROUND_STEPS} steps")


def fit_steps(timings: Sequence[StepTiming]) -> StepFit:
    """As the router fits a worker seeded by these steps, every one of them kept."""
    cost = StepModel.seeded(timings, window=max(len(timings), 1)).cost()
    errors = [t.duration_s / max(cost.duration(t.shape), 1e-12) - 1 for t in timings]
    return StepFit(cost=cost, noise=min(statistics.pstdev(errors), MAX_NOISE) if errors else 0.0,
                   median_error=statistics.median(abs(e) for e in errors) if errors else 0.0,
                   num_samples=len(timings))


# ---- KV transfers -------------------------------------------------------------------


def transfer_lengths(max_model_len: int) -> list[int]:
    return [n for n in TRANSFER_LENGTHS if n < max_model_len]


def measure_transfer(config: EngineConfig, *, lengths: Sequence[int], repeats: int = 3,
                     timeout_s: float = 60.0, seed: int = 0) -> list[TransferSample]:
    """Two in-process workers, prefill and decode, paired over kv_transfer: each
    length's prompt goes through the router's sequence once as a warm-up, then
    `repeats` times. Each worker's cache holds a few of the longest prompt: a
    transfer's cost does not depend on the cache's size, and both share this device."""
    from pdserve.kv_transfer import TransferConfig

    if repeats < 1 or not lengths:
        raise ValueError("repeats must be >= 1 and lengths not empty")
    blocks = 4 * blocks_for(max(lengths) + 1, config.cache.block_size)
    config = replace(config, cache=replace(config.cache, num_kv_blocks=blocks))
    transfer = TransferConfig(timeout_s=timeout_s, connect_timeout_s=timeout_s)
    before = set(threading.enumerate())
    try:
        return _measure_pair(config, transfer, lengths, repeats, seed)
    finally:
        # Worker.shutdown leaves the pair's gloo groups in reference cycles: until they
        # are collected, the decode side's pair threads stay blocked on them, and a
        # process that exits meanwhile aborts (std::terminate).
        gc.collect()
        deadline = time.monotonic() + timeout_s
        for thread in set(threading.enumerate()) - before:
            thread.join(max(deadline - time.monotonic(), 0))


def _measure_pair(config: EngineConfig, transfer: TransferConfig, lengths: Sequence[int],
                  repeats: int, seed: int) -> list[TransferSample]:
    with contextlib.ExitStack() as stack:
        # Shut down in reverse order: the prefill worker first, so that the decode
        # worker's pair threads see their sender go.
        decode, prefill = (_worker(stack, f"measure-{role}", config, transfer, role)
                           for role in ("decode", "prefill"))
        prefill.connect([decode.address])
        rng, ids = random.Random(seed), itertools.count()
        vocab = prefill.loop.engine.model_config.vocab_size

        def sample(n: int) -> TransferSample:
            return _transfer(prefill, decode, f"__measure-t{next(ids)}",
                             unrelated_prompt(rng, n, vocab), transfer.timeout_s)

        for n in lengths:
            sample(n)
        return [sample(n) for _ in range(repeats) for n in lengths]


def _worker(stack: contextlib.ExitStack, worker_id: str, config: EngineConfig,
            transfer: TransferConfig, role: str) -> Worker:
    from pdserve.worker.worker import Worker

    worker = Worker(worker_id, config, transfer, role=role)
    stack.callback(worker.shutdown)
    return worker


def _transfer(prefill: Worker, decode: Worker, request_id: str, prompt: list[int],
              timeout_s: float) -> TransferSample:
    """The router's sequence: reserve on the decode worker, prefill into that
    reservation, start there (max_tokens=1: it finishes at once, freeing its blocks)."""
    from pdserve.worker.messages import Job, PrefillJob

    job = Job(request_id=request_id, prompt_token_ids=prompt,
              sampling_params=_FIRST_TOKEN_ONLY, arrival_time=time.time())
    reservation = decode.reserve(job).result(timeout_s)
    if reservation is None:
        raise RuntimeError(f"the decode worker has no room for {len(prompt)} tokens")
    result = prefill.prefill(PrefillJob(job=job, target=reservation)).result(timeout_s)
    decode.start(request_id, result.first_token).result(timeout_s)
    return TransferSample(nbytes=result.kv_bytes_sent, seconds=result.transfer_seconds)


def fit_transfer(samples: Sequence[TransferSample]) -> TransferCost:
    model = TransferModel(window=max(len(samples), 1))
    for s in samples:
        model.observe(s.nbytes, s.seconds)
    return model.cost()


# ---- the profile --------------------------------------------------------------------


def refit(profile: Profile, steps: Sequence[StepTiming], transfers: Sequence[TransferSample],
          note: str) -> Profile:
    """The profile with its step cost, noise and (given any transfers) transfer cost
    fitted anew from these samples: a live cluster's telemetry, say, which measures
    the steps under the contention of everything else that runs beside them."""
    fit = fit_steps(steps)
    return replace(profile, step_cost=fit.cost, step_noise=fit.noise,
                   transfer_cost=fit_transfer(transfers) if transfers else profile.transfer_cost,
                   notes=(*profile.notes, f"refitted from {len(steps)} steps and "
                          f"{len(transfers)} transfers {note}; the fit's median relative "
                          f"error {fit.median_error:.1%}"))


def measure(config: EngineConfig, *, transfer: bool = True, repeats: int = 3) -> Profile:
    import torch

    from pdserve.llm import start_engine, stop_engine

    if config.tensor_parallel_size > 1:
        import ray
        if not ray.is_initialized():
            ray.init()  # before the clock: a cluster's worker finds Ray running
    began = time.perf_counter()
    engine, ranks = start_engine(config)  # at tensor_parallel_size > 1, its ranks on Ray
    try:
        startup_s = time.perf_counter() - began  # weights read, device set up, KV allocated
        rounds = engine_rounds(engine)
        steps = fit_steps(measure_steps(engine, repeats=repeats))
        cache = _cache_fields(engine)
        host_copy_s = host_copy_seconds(engine)
        model_name = Path(engine.config.model).name
    finally:
        stop_engine(engine, ranks)
    del engine  # the pair below needs its device memory
    gc.collect()
    if config.device.startswith("cuda"):
        torch.cuda.empty_cache()
    tp = config.tensor_parallel_size
    if transfer and tp > 1:
        transfer_cost, transfer_note = DEFAULT_TRANSFER_COST, (
            f"KV transfer not measured: served workers do not take tensor_parallel_size "
            f"{tp} yet; latency_model's default cost")
    else:
        transfer_cost, transfer_note = (
            _measured_transfer(config, cache["max_model_len"], repeats) if transfer
            else (DEFAULT_TRANSFER_COST,
                  "KV transfer not measured: latency_model's default cost"))
    machine = machine_name(config.device)
    return Profile(
        name=f"{model_name} on {config.device if tp == 1 else f'{tp} x {config.device}'} "
             f"({machine})", source="measured", tensor_parallel_size=tp,
        step_cost=steps.cost, transfer_cost=transfer_cost, step_noise=steps.noise,
        startup_s=startup_s, host_copy_s_per_block=host_copy_s,
        notes=(f"machine: {machine}, {os.cpu_count()} CPUs, {platform.platform()}",
               (f"torch {torch.__version__}, intra-op threads: {torch.get_num_threads()}, "
                f"dtype {config.resolved_dtype}"),
               (f"{steps.num_samples} steps measured: {len(rounds)} rounds x {repeats}, "
                f"after a warm-up; the fit's median relative error {steps.median_error:.1%}"),
               transfer_note,
               f"device <-> host copies (swap, host prefix tier): {host_copy_s * 1e6:.1f} us "
               "a block each way, measured on rank 0's shard (the others copy theirs "
               "alongside)",
               f"start-up: the engine loaded in {startup_s:.1f} s in this process (a "
               "cluster worker's own process and placement come on top)"),
        **cache)


def host_copy_seconds(engine: LLMEngine, num_blocks: int = 16) -> float:
    """One block's copy between the device and host memory, one way (the mean of the
    two ways, each the least of three tries over num_blocks blocks), on this engine's
    rank: what swap preemption and the host prefix tier pay a block."""
    from pdserve.engine.host_kv_cache import HostKVCache

    runner = engine.runner
    host = HostKVCache(runner.model_config, num_blocks, runner.block_size, runner.device,
                       runner.dtype)
    store_s, load_s = host.seconds_per_block(runner.kv_caches, num_blocks)
    return (store_s + load_s) / 2


def _cache_fields(engine: LLMEngine) -> dict:
    """The Profile's fields that describe the worker's KV cache and context."""
    from pdserve.engine.kv_cache import bytes_per_block

    blocks, model = engine.block_manager, engine.model_config
    # The whole worker's bytes of a block (every rank's heads): what a transfer moves.
    return dict(num_kv_blocks=blocks.num_blocks, block_size=blocks.block_size,
                kv_bytes_per_block=bytes_per_block(model, blocks.block_size,
                                                   engine.runner.dtype),
                max_model_len=engine.max_model_len, vocab_size=model.vocab_size)


def _measured_transfer(config: EngineConfig, max_model_len: int,
                       repeats: int) -> tuple[TransferCost, str]:
    lengths = transfer_lengths(max_model_len)
    samples = measure_transfer(config, lengths=lengths, repeats=repeats)
    return fit_transfer(samples), (
        f"{len(samples)} KV transfers measured between two in-process workers on "
        f"{config.device}: prompts of {', '.join(map(str, lengths))} tokens x {repeats}, "
        "after a warm-up")


def machine_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return _cpu_model() or platform.processor() or platform.machine()


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return ""


# ---- the command --------------------------------------------------------------------


def add_profile_parser(sub) -> None:
    profile = sub.add_parser(
        "profile", help="measure a worker's step and KV transfer costs on this machine "
        "for `pdserve sim --profile`",
        description="Time a worker's engine steps over the shapes serving sees and a "
        "prefill -> decode pair's KV transfers on this machine's device, fit them as the "
        "router does, and write the profile `pdserve sim --profile` reads.")
    profile.add_argument("--model", default="tiny", help="a local HF directory, or `tiny` "
                         "(default: %(default)s)")
    profile.add_argument("--out", required=True, help="the profile (JSON) to write")
    profile.add_argument("--repeats", type=int, default=3,
                         help="measured passes, after a warm-up (default: %(default)s)")
    profile.add_argument("--no-transfer", dest="transfer", action="store_false",
                         help="measure no KV transfer; the profile keeps the default cost")
    cli_flags.add_engine_flags(profile)
    profile.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    profile = measure(cli_flags.engine_config(args, args.model), transfer=args.transfer,
                      repeats=args.repeats)
    profile.save(args.out)
    print(profile.name)
    for name, value in {**asdict(profile.step_cost), **asdict(profile.transfer_cost),
                        "step_noise": profile.step_noise}.items():
        print(f"  {name:18} {value:.4g}")
    for note in profile.notes:
        print(f"  - {note}")
    print(f"wrote {args.out}")
    return 0
