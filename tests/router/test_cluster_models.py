"""What the router learns for the latency model, without Ray: the prefix index from
telemetry events, the transfer and step fits."""
from __future__ import annotations

from dataclasses import replace

import pytest

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.step_shape import StepShape, StepTiming
from pdserve.router.config import RouterConfig
from pdserve.router.model_info import ModelInfo
from pdserve.router.policy.cluster_models import ClusterModels
from pdserve.router.policy.prefix_index import PrefixIndex, block_hashes
from pdserve.worker.messages import WorkerTelemetry, net_prefix_events

MODEL = ModelInfo("m", 4096, 1000, block_size=16, kv_bytes_per_block=1000)


def test_the_prefix_index_counts_each_workers_leading_blocks():
    prompt = list(range(100, 165))  # 65 tokens: 4 full blocks a worker could hit
    hashes = block_hashes(prompt, 16)
    assert len(hashes) == 4 and block_hashes(prompt[:64], 16) == hashes[:3]
    index = PrefixIndex()
    index.update("a", tuple(hashes), ())
    index.update("b", tuple(hashes[:2]), ())
    index.update("c", tuple(hashes[1:]), ())  # no first block: no hit at all
    assert index.hits(hashes) == {"a": 4, "b": 2}
    index.update("a", (), (hashes[2],))  # evicted: a's run of hits stops there
    assert index.hits(hashes) == {"a": 2, "b": 2}
    index.forget("b")
    assert index.hits(hashes) == {"a": 2}
    assert index.hits(block_hashes(list(range(7, 60)), 16)) == {}


def test_a_block_s_holders_shrink_back_to_none_as_they_evict_it():
    hashes = block_hashes(list(range(17)), 16)
    index = PrefixIndex()
    index.update("a", tuple(hashes), ())
    index.update("a", tuple(hashes), ())  # stored again by its holder: still one
    index.update("b", tuple(hashes), ())
    assert index.hits(hashes) == {"a": 1, "b": 1}
    index.update("a", (), tuple(hashes))
    index.update("a", (), tuple(hashes))  # evicted where it is not held: nothing
    assert index.hits(hashes) == {"b": 1}
    index.update("b", (), tuple(hashes))
    assert index.hits(hashes) == {} and len(index) == 0


def test_a_block_evicted_and_stored_again_within_one_report_stays_indexed():
    # A 4-block cache: a's 2 full blocks are stored, evicted by 3 blocks of other
    # tokens, then computed and stored again, all between two reports.
    bm = BlockManager(4, 4)
    bm.record_prefix_events = True

    def run(rid, tokens):
        r = Request(rid, tokens, SamplingParams(), 0.0)
        hits = bm.get_computed_blocks(r)
        assert bm.allocate_slots(r, r.num_tokens - len(hits) * 4, hits)
        r.num_computed_tokens = r.num_tokens
        bm.cache_full_blocks(r, r.num_tokens)
        bm.free(r)
    a = list(range(9))
    run("a", a)
    run("other", list(range(50, 62)))
    run("a-again", a)
    stored, evicted = net_prefix_events(bm.take_prefix_events())
    assert not set(stored) & set(evicted)
    index = PrefixIndex()
    index.update("w", stored, evicted)
    assert index.hits(block_hashes(a, 4)) == {"w": 2}
    # and as two reports merged on the way (the first with a's blocks stored)
    first = telemetry(stored=block_hashes(a, 4))
    second = telemetry(stored=block_hashes(a, 4)[:1], evicted=block_hashes(a, 4)[1:])
    both = telemetry(evicted=block_hashes(a, 4)).merged(telemetry(stored=block_hashes(a, 4)))
    index = PrefixIndex()
    index.update("w", both.prefix_stored, both.prefix_evicted)
    assert index.hits(block_hashes(a, 4)) == {"w": 2}
    merged = first.merged(second)
    assert merged.prefix_stored == tuple(block_hashes(a, 4)[:1])
    assert merged.prefix_evicted == tuple(block_hashes(a, 4)[1:])


def telemetry(steps=(), stored=(), evicted=()):
    return WorkerTelemetry("w", "both", 0.0, 0, 0, 0, 0, 0, 10, 10, 0, 2048,
                           tuple(steps), tuple(stored), tuple(evicted))


def test_reports_fit_the_step_model_and_fill_the_prefix_index():
    models = ClusterModels()
    steps = [StepTiming(StepShape(decode_seqs=n, decode_context=100 * n), 0.01 + 0.002 * n, 0)
             for n in range(1, 40)]
    cost, share = models.reported(telemetry(steps, stored=[b"h1"]))
    assert share == 0.0  # decodes only
    assert cost.decode_seq_s + 100 * cost.decode_context_s == pytest.approx(0.002, rel=0.05)
    assert models.prefixes.hits([b"h1"]) == {"w": 1}
    models.transferred("p", "w", 1000, 0.003, now=0.0)
    assert ("p", "w") in models.transfer_costs
    models.forget("w")
    assert not models.transfer_costs and models.prefixes.hits([b"h1"]) == {}



def _steps(cost, at, slowdown=1.0):
    """A worker's steps as its start-up profile runs them: prompts alone, then a
    decode batch; `slowdown` as measured while another worker shared its cores."""
    shapes = [StepShape(prefill_tokens=n, prefill_pairs=n * (n + 1) // 2)
              for n in (8, 32, 128, 512)] + [StepShape(decode_seqs=4, decode_context=4 * k)
                                             for k in range(256, 264)]
    return [StepTiming(s, slowdown * cost.duration(s), at + i * 0.01)
            for i, s in enumerate(shapes)]


def test_a_model_inflated_under_contention_recovers_once_its_worker_idles():
    # The self-starvation trap of #14: steps measured while both workers shared the
    # CPU make a worker look 3x slower; the policy refuses every request whose TTFT
    # that forecast breaks, refused requests make no steps, and the model would never
    # learn otherwise. Its steps age out instead: once the idle reports are
    # step_max_age_s past them, the forecast is the worker's profile again and the same
    # request is admitted.
    from pdserve.engine.latency_model import StepCost
    from pdserve.router.policy.cluster_state import ClusterState, RequestView, WorkerState
    from pdserve.router.policy.decision import Colocate, Reject
    from pdserve.router.policy.goodput import decide
    from pdserve.router.slo import Slo
    true = StepCost(base_s=0.010, prefill_token_s=1e-4, prefill_pair_s=0.0,
                    decode_seq_s=0.001, decode_context_s=0.0)

    def report(steps, now):
        return WorkerTelemetry("w", "both", now, 0, 0, 0, 0, 0, 1000, 1000, 0, 2048,
                               tuple(steps))

    def placed(cost):
        worker = WorkerState("w", "both", telemetry=report((), 0.0), heard_at=0.0,
                             num_blocks=1000, step_cost=cost)
        view = RequestView(1000, 63, slo=Slo(ttft_s=0.2, tpot_s=0.05), max_tokens=10)
        return decide(view, ClusterState((worker,), 0.0, RouterConfig(adaptive=True), MODEL))

    models = ClusterModels(step_max_age_s=60.0)
    profile, _ = models.reported(report(_steps(true, at=0.0), now=1.0))
    assert profile.duration(StepShape(prefill_tokens=1000)) == pytest.approx(0.110, rel=0.05)
    assert isinstance(placed(profile), Colocate)  # 110 ms of a 200 ms SLO
    contended, _ = models.reported(report(
        [t for at in range(10, 40, 2) for t in _steps(true, at=float(at), slowdown=3.0)],
        now=40.0))
    assert isinstance(placed(contended), Reject)  # about 3 x 110 ms
    assert models.reported(report((), now=60.0))[0] == contended  # still too recent
    recovered, _ = models.reported(report((), now=40.0 + 61.0))  # idle for the max age
    assert recovered.duration(StepShape(prefill_tokens=1000)) == pytest.approx(0.110, rel=0.05)
    assert isinstance(placed(recovered), Colocate)


def test_a_pair_whose_transfers_were_inflated_is_chosen_again_once_they_age_out():
    # The transfer side of the trap: d0's link measured slow (200 ms + 1 ms per block)
    # while it was contended, so the policy sends every request to d1, no transfer
    # to d0 completes, and its fit would never recover. Once its transfers are older
    # than the max age, its cost is the prior again and the lighter d0 wins.
    from pdserve.engine.latency_model import DEFAULT_TRANSFER_COST, StepCost
    from pdserve.router.policy.cluster_state import ClusterState, RequestView, WorkerState
    from pdserve.router.policy.decision import Disaggregate
    from pdserve.router.policy.goodput import decide
    from pdserve.router.slo import Slo
    cost = StepCost(base_s=0.010, prefill_token_s=1e-4, prefill_pair_s=0.0,
                    decode_seq_s=0.001, decode_context_s=0.0)

    def worker(wid, role, running=0):
        t = WorkerTelemetry(wid, role, 0.0, 0, 0, running, 0, 0, 1000, 1000, 0, 2048)
        return WorkerState(wid, role, telemetry=t, heard_at=0.0, num_blocks=1000,
                           step_cost=cost)

    def placed(models):
        workers = (worker("p", "prefill"), worker("d0", "decode", running=2),
                   worker("d1", "decode", running=3))
        view = RequestView(100, 7, slo=Slo(ttft_s=1.0, tpot_s=0.05), max_tokens=10)
        return decide(view, ClusterState(workers, 0.0, RouterConfig(), MODEL,
                                         transfer=models.transfer_costs))

    models = ClusterModels(step_max_age_s=60.0)
    for i in range(20):
        models.transferred("p", "d0", 7000, 0.2 + 0.007 + 0.001 * (i % 3), now=10.0 + i)
        models.transferred("p", "d1", 7000, 0.002 + 0.007, now=10.0 + i)
    assert placed(models) == Disaggregate("p", "d1")  # d0's 200 ms outweighs its lighter batch
    for i in range(20):  # d1 keeps being measured; d0 gets nothing
        models.transferred("p", "d1", 7000, 0.009, now=40.0 + i)
    models.age_transfers(now=60.0)
    assert placed(models) == Disaggregate("p", "d1")  # still too recent
    models.age_transfers(now=29.0 + 61.0)  # d0's last transfer is past the max age
    assert models.transfer_costs[("p", "d0")] == DEFAULT_TRANSFER_COST
    assert placed(models) == Disaggregate("p", "d0")


def test_host_tier_events_index_the_host_tier_apart_with_its_load_cost():
    """A worker's host tier is indexed apart from its device cache; the placer counts
    a prompt's host blocks past its device hits as cached, priced at the worker's
    measured load time."""
    from types import SimpleNamespace

    from pdserve.router.placer import Placer
    prompt = list(range(100, 165))
    hashes = block_hashes(prompt, 16)  # 4 blocks
    models = ClusterModels()
    models.reported(replace(telemetry(stored=hashes[:1]), host_prefix_stored=tuple(hashes),
                            host_load_s_per_block=0.002))
    assert models.prefixes.hits(hashes) == {"w": 1}
    assert models.host_prefixes.hits(hashes) == {"w": 4}
    placer = SimpleNamespace(models=models, model=MODEL, config=RouterConfig())
    cached, load_s = Placer._prefix_hits(placer, lambda: hashes)
    assert cached == {"w": 64} and load_s == {"w": pytest.approx(3 * 0.002)}
    models.reported(replace(telemetry(), host_prefix_evicted=tuple(hashes[2:])))
    cached, load_s = Placer._prefix_hits(placer, lambda: hashes)
    assert cached == {"w": 32} and load_s == {"w": pytest.approx(0.002)}
    models.forget("w")
    assert models.host_prefixes.hits(hashes) == {} and "w" not in models.host_load_s
