"""What the router learns for the latency model, without Ray: the prefix index from
telemetry events, the transfer and step fits."""
from __future__ import annotations

import pytest

from pdserve.engine.step_shape import StepShape, StepTiming
from pdserve.engine.worker_messages import WorkerTelemetry
from pdserve.router.cluster_models import ClusterModels
from pdserve.router.prefix_index import PrefixIndex, block_hashes


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


def telemetry(steps=(), stored=(), evicted=()):
    return WorkerTelemetry("w", "both", 0.0, 0, 0, 0, 0, 0, 10, 10, 0, 2048,
                           tuple(steps), tuple(stored), tuple(evicted))


def test_reports_fit_the_step_model_and_fill_the_prefix_index():
    models = ClusterModels()
    steps = [StepTiming(StepShape(decode_seqs=n, decode_context=100 * n), 0.01 + 0.002 * n, 0)
             for n in range(1, 40)]
    cost = models.reported(telemetry(steps, stored=[b"h1"]))
    assert cost.decode_seq_s + 100 * cost.decode_context_s == pytest.approx(0.002, rel=0.05)
    assert models.prefixes.hits([b"h1"]) == {"w": 1}
    models.transferred("p", "w", 1000, 0.003)
    assert ("p", "w") in models.transfer_costs
    models.forget("w")
    assert not models.transfer_costs and models.prefixes.hits([b"h1"]) == {}

