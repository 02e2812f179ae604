"""The router's metrics, read back from its registry."""
import pytest

from pdserve.router.metrics import RouterMetrics
from pdserve.router.policy.decision import Colocate, Disaggregate
from pdserve.router.slo import Slo


def _samples(metrics: RouterMetrics, name: str, *labels: str) -> dict:
    """The series of one sample name: their labels' values (in `labels`' order) -> value."""
    return {tuple(s.labels[label] for label in labels): s.value
            for m in metrics.registry.collect() for s in m.samples if s.name == name}


def _judged(slo: Slo) -> RouterMetrics:
    """A colocated and a split request, each forecast off in both metrics."""
    metrics = RouterMetrics("m")
    metrics.judged(slo, Colocate("a", ttft_s=0.1, tpot_s=0.012), ttft_s=0.2, tpot_s=0.010)
    metrics.judged(slo, Disaggregate("a", "b", ttft_s=0.3, tpot_s=0.015), ttft_s=0.2,
                   tpot_s=0.020)
    return metrics


def test_forecast_errors_are_kept_apart_by_placement_kind_and_direction():
    errors = _samples(_judged(Slo(ttft_s=1.0, tpot_s=0.05)),
                      "pdserve:router_prediction_relative_error_sum",
                      "metric", "kind", "direction")
    assert errors[("ttft", "colocate", "under")] == 0.5  # 0.1 for 0.2
    assert abs(errors[("tpot", "colocate", "over")] - 0.2) < 1e-9  # 12 ms for 10
    assert abs(errors[("ttft", "disaggregate", "over")] - 0.5) < 1e-9  # 0.3 for 0.2
    assert abs(errors[("tpot", "disaggregate", "under")] - 0.25) < 1e-9  # 15 ms for 20
    assert len(errors) == 4


def test_slo_attainment_is_counted_by_placement_kind():
    slo = Slo(ttft_s=0.25, tpot_s=0.015)
    metrics = _judged(slo)
    metrics.judged(slo, Disaggregate("a", "b", ttft_s=0.3, tpot_s=0.015), ttft_s=0.3,
                   tpot_s=0.010)
    assert _samples(metrics, "pdserve:router_slo_requests_total", "slo", "met", "kind") == {
        ("ttft", "true", "colocate"): 1, ("tpot", "true", "colocate"): 1,
        ("ttft", "false", "disaggregate"): 1, ("tpot", "true", "disaggregate"): 1,
        ("ttft", "true", "disaggregate"): 1, ("tpot", "false", "disaggregate"): 1}


def test_goodput_counts_a_request_once_and_only_when_it_met_every_slo_it_set():
    slo = Slo(ttft_s=0.25, tpot_s=0.015)
    metrics = _judged(slo)  # colocated: both met; split: TTFT met, TPOT missed
    metrics.judged(Slo(ttft_s=0.25), Colocate("a", ttft_s=0.1), ttft_s=0.3, tpot_s=0.5)
    metrics.judged(Slo(), Colocate("a", ttft_s=0.1), ttft_s=0.3, tpot_s=0.5)  # none set
    assert _samples(metrics, "pdserve:router_goodput_requests_total", "met", "kind") == {
        ("true", "colocate"): 1, ("false", "colocate"): 1, ("false", "disaggregate"): 1}


def test_the_ttft_error_is_of_the_part_after_a_wait_for_capacity():
    # Waited 400 ms, then forecast 100 ms more (500 ms from arrival), measured 600 ms:
    # the forecast was off by 100 ms of 200, not of 600.
    metrics = RouterMetrics("m")
    metrics.judged(Slo(ttft_s=1.0), Colocate("a", ttft_s=0.5), ttft_s=0.6, tpot_s=None,
                   waited_s=0.4)
    errors = _samples(metrics, "pdserve:router_prediction_relative_error_sum",
                      "metric", "kind", "direction")
    assert errors == {("ttft", "colocate", "under"): pytest.approx(0.5)}


def test_speculative_decoding_counters_follow_the_workers_cumulative_figures():
    """vLLM's names: drafts, draft tokens, accepted tokens and accepted per position,
    per worker, grown by each report's cumulative figures (a restarted worker's start
    from zero again)."""
    from pdserve.worker.messages import WorkerTelemetry
    metrics = RouterMetrics("m")

    def report(drafts, tokens, accepted, per_pos):
        return WorkerTelemetry(worker_id="w", role="decode", time=0.0, waiting=0,
                               waiting_tokens=0, running=1, context_tokens=10, reserved=0,
                               free_blocks=1, num_blocks=2, num_preemptions=0,
                               spec_num_drafts=drafts, spec_num_draft_tokens=tokens,
                               spec_num_accepted_tokens=accepted,
                               spec_accepted_per_pos=per_pos)
    metrics.observe_worker(report(2, 8, 5, (2, 2, 1, 0)))
    metrics.observe_worker(report(3, 12, 6, (3, 2, 1, 0)))
    metrics.observe_worker(report(1, 4, 4, (1, 1, 1, 1)))  # restarted
    total = {name: _samples(metrics, f"pdserve:spec_decode_{name}_total", "worker")
             for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    assert total == {"num_drafts": {("w",): 4}, "num_draft_tokens": {("w",): 16},
                     "num_accepted_tokens": {("w",): 10}}
    per_pos = _samples(metrics, "pdserve:spec_decode_num_accepted_tokens_per_pos_total",
                       "position")
    assert per_pos == {("0",): 4, ("1",): 3, ("2",): 2, ("3",): 1}
    metrics.forget_worker("w")
    assert not _samples(metrics, "pdserve:spec_decode_num_accepted_tokens_per_pos_total",
                        "position")


def test_preemptions_by_the_waiting_timeout_are_a_gauge_of_their_own():
    from pdserve.worker.messages import WorkerTelemetry
    metrics = RouterMetrics("m")
    metrics.observe_worker(WorkerTelemetry(
        worker_id="w", role="both", time=0.0, waiting=0, waiting_tokens=0, running=1,
        context_tokens=10, reserved=0, free_blocks=1, num_blocks=2, num_preemptions=5,
        num_preemptions_for_waiting=3))
    assert _samples(metrics, "pdserve:num_preemptions_for_waiting", "worker") == {("w",): 3}
    assert _samples(metrics, "pdserve:num_preemptions", "worker") == {("w",): 5}


def test_swap_and_host_tier_figures_reach_the_gauges_from_a_real_engine(llama_dir):
    """An engine swapping under pressure and serving prefixes from its host tier: its
    telemetry (engine/telemetry.py, as a worker sends it) carries the figures, and the
    router exports them under vLLM-style names."""
    from pdserve import LLM, SamplingParams
    from pdserve.engine.telemetry import report
    from tests.engine.test_hf_oracle import host_gib, random_prompts
    llm = LLM(str(llama_dir), num_kv_blocks=20, preemption_mode="swap",
              swap_space=host_gib(llama_dir, 64), kv_offloading_size=host_gib(llama_dir, 64))
    engine = llm.engine
    engine.block_manager.record_prefix_events = True
    prompts = random_prompts(engine.model_config.vocab_size, seed=3)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    llm.generate(prompts, [params] * len(prompts))
    llm.generate(prompts, [params] * len(prompts))
    t = report("w", "both", engine.scheduler, 0.0, ())
    stats, host = engine.stats, engine.block_manager.host
    assert t.num_swapped_out == stats.num_swapped_out > 0
    assert t.num_blocks_swapped_in == stats.num_blocks_swapped_in
    assert t.host_prefix_cache_hits == stats.host_prefix_cache_hits > 0
    assert t.host_blocks_stored == host.num_stored > 0
    assert t.host_num_blocks == host.num_blocks and t.host_load_s_per_block > 0
    assert len(t.host_prefix_stored) == host.num_prefix_blocks_held
    metrics = RouterMetrics("m")
    metrics.observe_worker(t)
    for name, value in (("num_requests_swapped_out", t.num_swapped_out),
                        ("num_blocks_swapped_out", t.num_blocks_swapped_out),
                        ("num_blocks_swapped_in", t.num_blocks_swapped_in),
                        ("num_requests_swapped", 0),
                        ("cpu_prefix_cache_hits", t.host_prefix_cache_hits),
                        ("cpu_prefix_cache_blocks_stored", t.host_blocks_stored),
                        ("cpu_prefix_cache_blocks_loaded", t.host_blocks_loaded),
                        ("cpu_cache_usage_perc", t.host_used_blocks / t.host_num_blocks)):
        assert _samples(metrics, f"pdserve:{name}", "worker") == {("w",): value}, name
