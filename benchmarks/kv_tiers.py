"""Host memory's KV tiers, side by side in one process on one model: each arm's engine
built once, the rounds interleaved (every arm runs once per round on the same
requests; ratios are taken within a round), repeated to show the spread.

1. Sessions under memory pressure, the host prefix tier off and on. --sessions
   multi-turn sessions take turns one at a time (round robin: while one session's
   user thinks, the others' turns run). Each turn's prompt is the session's history
   (its last prompt and the reply the engine gave) plus a new message, so a later
   turn can hit its history; the device cache holds about --resident sessions'
   histories, so by a session's next turn the others have pushed its history out of
   the device (the tier's case). TTFT of turns 2 and later (p50, p90), prefix hits by
   tier, and goodput: turns per second within --slo-ttft-ms. Both arms must give the
   same tokens (greedy). Target: >= 2x lower TTFT p50 on later turns.
2. No reuse, the tier off and on: random prompts decoded together, output tokens/s
   (the tier stores every full block as it is computed and gets no hit back: what
   write-through costs). Target: <= 5% throughput lost.
3. Swap against recompute: a --swap-prompt-len prompt preempted behind a longer-lived
   request (preemption_mode recompute, then swap), and the time from its re-admission
   to its next token (a recompute's prefill, against copying its blocks back and one
   decode step; prefix caching off in both, so neither finds the victim's blocks
   still cached). Target: resume >= 1.5x faster.

`--device cuda` runs every arm on a GPU (bfloat16 there unless `--dtype` says).

Prints each part's figures, the ratios last; writes the JSON to --out.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from pdserve import LLM, SamplingParams
from pdserve.bench.report import save_json, show, spread
from pdserve.engine.kv_cache import bytes_per_block
from pdserve.engine.model_path import resolve_model_path


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def generate_one(llm: LLM, rid: str, prompt: list[int], n: int):
    """One request alone through the engine: its output (metrics included)."""
    engine = llm.engine
    engine.add_request(rid, prompt, greedy(n))
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                return out
    raise RuntimeError(f"{rid} did not finish")


# ---- 1. sessions ------------------------------------------------------------------------

def session_plan(args, vocab: int, round_: int) -> list[dict]:
    """Each session's first message, later messages and reply lengths (seeded)."""
    rng = random.Random(args.seed + 1000 * round_)
    return [{"first": [rng.randrange(4, vocab) for _ in range(args.first_len)],
             "messages": [[rng.randrange(4, vocab) for _ in range(args.message_len)]
                          for _ in range(args.turns - 1)]}
            for _ in range(args.sessions)]


def run_sessions(llm: LLM, plan: list[dict], args, tag: str) -> dict:
    """Turn by turn, each session's turn in order (round robin)."""
    prompts = [s["first"] for s in plan]
    records, outputs = [], []
    engine = llm.engine
    stats_before = (engine.stats.prefix_cache_hits, engine.stats.host_prefix_cache_hits)
    began = time.perf_counter()
    for turn in range(args.turns):
        for i, session in enumerate(plan):
            out = generate_one(llm, f"{tag}-s{i}-t{turn}", prompts[i], args.reply_len)
            m = out.metrics
            records.append({"turn": turn + 1, "ttft_s": m.first_token_time - m.arrival_time,
                            "prompt_tokens": len(prompts[i]),
                            "cached": out.num_cached_tokens,
                            "host_cached": out.num_host_cached_tokens})
            outputs.append(out.token_ids)
            if turn + 1 < args.turns:
                prompts[i] = prompts[i] + out.token_ids + session["messages"][turn]
    elapsed = time.perf_counter() - began
    later = [r for r in records if r["turn"] >= 2]
    ttfts = sorted(r["ttft_s"] for r in later)
    within = sum(r["ttft_s"] * 1e3 <= args.slo_ttft_ms for r in records)
    return {"ttft_p50_later_s": statistics.median(ttfts),
            "ttft_p90_later_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
            "ttft_p50_first_s": statistics.median(r["ttft_s"] for r in records
                                                  if r["turn"] == 1),
            "goodput_rps": within / elapsed, "elapsed_s": elapsed,
            "hit_share_later": {
                "device": sum(r["cached"] - r["host_cached"] for r in later)
                / sum(r["prompt_tokens"] for r in later),
                "host": sum(r["host_cached"] for r in later)
                / sum(r["prompt_tokens"] for r in later)},
            "prefix_cache_hits": engine.stats.prefix_cache_hits - stats_before[0],
            "host_prefix_cache_hits": engine.stats.host_prefix_cache_hits - stats_before[1],
            "outputs": outputs}


# ---- 2. no reuse ------------------------------------------------------------------------

def run_no_reuse(llm: LLM, args, round_: int) -> dict:
    rng = random.Random(args.seed + 7 + 1000 * round_)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[rng.randrange(4, vocab) for _ in range(args.no_reuse_prompt_len)]
               for _ in range(args.no_reuse_requests)]
    began = time.perf_counter()
    outs = llm.generate(prompts, [greedy(args.no_reuse_output_len)] * len(prompts))
    elapsed = time.perf_counter() - began
    assert all(o.num_cached_tokens == 0 for o in outs), "the no-reuse load must not hit"
    return {"tokens_per_s": sum(len(o.token_ids) for o in outs) / elapsed,
            "outputs": [o.token_ids for o in outs]}


# ---- 3. swap against recompute --------------------------------------------------------------

def run_resume(llm: LLM, args, round_: int, tag: str) -> dict:
    """A long-lived request first, then the victim (the latest arrival: preempted when
    the pool runs out, re-admitted once the long-lived one ended); the victim's
    resume: the step that takes it back, which gives its next token (a whole
    recompute fits one step's budget)."""
    engine = llm.engine
    rng = random.Random(args.seed + 13 + 1000 * round_)
    vocab = engine.model_config.vocab_size
    long_lived = [rng.randrange(4, vocab) for _ in range(64)]
    victim = [rng.randrange(4, vocab) for _ in range(args.swap_prompt_len)]
    engine.add_request(f"{tag}-long", long_lived, greedy(args.swap_long_output_len))
    engine.step()
    vid = f"{tag}-victim"
    engine.add_request(vid, victim, greedy(args.swap_victim_output_len))
    request = engine.scheduler.requests[vid]
    resume_s, outputs, swapped = None, {}, engine.stats.num_swapped_out
    while engine.has_unfinished():
        was = request.status.value
        began = time.perf_counter()
        outs = engine.step()
        took = time.perf_counter() - began
        for out in outs:
            if out.finished:
                outputs[out.request_id] = out.token_ids
            if out.request_id == vid and out.new_token_ids and resume_s is None \
                    and was in ("preempted", "swapped"):
                resume_s = took
    if resume_s is None:
        raise RuntimeError("the victim was never preempted: raise --swap-long-output-len")
    return {"resume_s": resume_s, "outputs": [outputs[f"{tag}-long"], outputs[vid]],
            "swapped": engine.stats.num_swapped_out - swapped}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-len", type=int, default=512)
    ap.add_argument("--message-len", type=int, default=64)
    ap.add_argument("--reply-len", type=int, default=32)
    ap.add_argument("--resident", type=float, default=2.5,
                    help="sessions' whole histories the device cache holds")
    ap.add_argument("--slo-ttft-ms", type=float, default=250.0)
    ap.add_argument("--no-reuse-requests", type=int, default=16)
    ap.add_argument("--no-reuse-prompt-len", type=int, default=256)
    ap.add_argument("--no-reuse-output-len", type=int, default=64)
    ap.add_argument("--swap-prompt-len", type=int, default=2048)
    ap.add_argument("--swap-victim-output-len", type=int, default=64)
    ap.add_argument("--swap-long-output-len", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--out", default="bench-results/kv_tiers.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model_path(args.model)
    base = dict(device=args.device, dtype=args.dtype)
    probe = LLM(str(model_dir), num_kv_blocks=64, **base)
    block = bytes_per_block(probe.engine.model_config, 16, probe.engine.runner.dtype)
    vocab = probe.engine.model_config.vocab_size
    del probe
    last_prompt = args.first_len + (args.turns - 1) * (args.reply_len + args.message_len)
    history_blocks = -(-(last_prompt + args.reply_len) // 16)
    session_blocks = int(args.resident * history_blocks)
    tier_gib = 4 * args.sessions * history_blocks * block / (1 << 30)
    # The victim and the long-lived request fit as they are admitted, with no block to
    # spare: the first of them to need another preempts the victim (the latest).
    swap_blocks = -(-args.swap_prompt_len // 16) + 1 + -(-65 // 16)
    swap_gib = 2 * swap_blocks * block / (1 << 30)
    engines = {
        "sessions/off": LLM(str(model_dir), num_kv_blocks=session_blocks, **base),
        "sessions/tier": LLM(str(model_dir), num_kv_blocks=session_blocks,
                             kv_offloading_size=tier_gib, **base),
        "no-reuse/off": LLM(str(model_dir), **base),
        "no-reuse/tier": LLM(str(model_dir), kv_offloading_size=tier_gib, **base),
        # The victim alone fits; beside the long-lived request, not to its end.
        # Prefix caching off: neither arm finds the victim's blocks still cached (both
        # would take most of them back from the device, and measure nothing).
        "resume/recompute": LLM(str(model_dir), num_kv_blocks=swap_blocks,
                                preemption_mode="recompute", swap_space=swap_gib,
                                enable_prefix_caching=False,
                                max_num_batched_tokens=args.swap_prompt_len + 64, **base),
        "resume/swap": LLM(str(model_dir), num_kv_blocks=swap_blocks, preemption_mode="swap",
                           swap_space=swap_gib, enable_prefix_caching=False,
                           max_num_batched_tokens=args.swap_prompt_len + 64, **base)}
    for llm in engines.values():  # warm-up
        llm.generate([list(range(10, 40))], greedy(4))
    runs: dict[str, list] = {name: [] for name in engines}
    for round_ in range(args.repeats):
        order = list(engines) if round_ % 2 == 0 else list(reversed(engines))
        plan = session_plan(args, vocab, round_)
        for name in order:
            llm = engines[name]
            if name.startswith("sessions"):
                runs[name].append(run_sessions(llm, plan, args, f"r{round_}"))
            elif name.startswith("no-reuse"):
                runs[name].append(run_no_reuse(llm, args, round_))
            else:
                runs[name].append(run_resume(llm, args, round_, f"r{round_}"))
        print(f"round {round_ + 1}/{args.repeats} done", flush=True)
    exact = {part: all(a["outputs"] == b["outputs"]
                       for a, b in zip(runs[f"{part}/{x}"], runs[f"{part}/{y}"]))
             for part, x, y in (("sessions", "off", "tier"), ("no-reuse", "off", "tier"),
                                ("resume", "recompute", "swap"))}
    assert all(run["swapped"] > 0 for run in runs["resume/swap"]), "the swap arm never swapped"
    ratios = {
        "sessions_ttft_p50_later_x": spread([
            off["ttft_p50_later_s"] / tier["ttft_p50_later_s"]
            for off, tier in zip(runs["sessions/off"], runs["sessions/tier"])]),
        "sessions_goodput_x": spread([
            tier["goodput_rps"] / off["goodput_rps"] if off["goodput_rps"] else None
            for off, tier in zip(runs["sessions/off"], runs["sessions/tier"])]),
        "no_reuse_throughput_x": spread([
            tier["tokens_per_s"] / off["tokens_per_s"]
            for off, tier in zip(runs["no-reuse/off"], runs["no-reuse/tier"])]),
        "resume_faster_x": spread([
            rec["resume_s"] / swap["resume_s"]
            for rec, swap in zip(runs["resume/recompute"], runs["resume/swap"])])}
    figures = {name: {key: spread([r[key] for r in rs])
                      for key in rs[0] if key not in ("outputs", "hit_share_later")}
               for name, rs in runs.items()}
    for name in ("sessions/off", "sessions/tier"):
        figures[name]["hit_share_later"] = {
            tier: spread([r["hit_share_later"][tier] for r in runs[name]])
            for tier in ("device", "host")}
    result = {"model": str(model_dir), "device": args.device,
              "threads": torch.get_num_threads(), "args": vars(args),
              "sizes": {"block_bytes": block, "session_device_blocks": session_blocks,
                        "history_blocks": history_blocks, "tier_gib": tier_gib,
                        "swap_device_blocks": swap_blocks, "swap_gib": swap_gib},
              "figures": figures, "exact": exact, "ratios": ratios,
              "targets": {"sessions_ttft_p50_later_x": ">= 2", "no_reuse_throughput_x": ">= 0.95",
                          "resume_faster_x": ">= 1.5"}}
    save_json(args.out, result)
    for name, figs in figures.items():
        print(name, {k: show(v, 4) if "median" in v else
                     {t: show(s, 3) for t, s in v.items()} for k, v in figs.items()})
    print("same tokens in both arms:", exact)
    print("ratios (median [min, max] over rounds):")
    for name, value in ratios.items():
        print(f"  {name}: {show(value)}")
    return 0 if all(exact.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
