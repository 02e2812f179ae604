"""Workers as real Ray actors, driven the way the router drives them: reserve on D,
prefill on P (KV streamed P -> D), start on D, read D's step stream. Greedy outputs
equal HF transformers; an abort frees every block; the two swap roles at run time
(weights loaded once) and stay exact; the stream carries telemetry of every step."""
from __future__ import annotations

import random
import threading
import time
from collections import defaultdict

import pytest
import ray

from pdserve import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.kv_transfer import TransferConfig
from pdserve.worker.actor import WorkerActor
from pdserve.worker.messages import Job, PrefillJob
from tests.engine.test_hf_oracle import Oracle
from tests.polling import until

TRANSFER = TransferConfig(timeout_s=30)


class StepReader:
    """Reads a decode worker's StepBatch stream on a thread, per request."""

    def __init__(self, decode):
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.finished: dict[str, str] = {}
        self.reports = []  # WorkerTelemetry, in order
        self._cv = threading.Condition()
        self._stream = decode.steps.remote(30.0)  # stall bound: heartbeats while idle
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for ref in self._stream:
                self._take(ray.get(ref))
        except (Exception, SystemExit):  # Ray shutting down at the end of the module
            return

    def _take(self, batch) -> None:
        with self._cv:
            if batch.telemetry is not None:
                self.reports.append(batch.telemetry)
            for d in batch.deltas:
                self.tokens[d.request_id] += d.token_ids
                if d.finished:
                    self.finished[d.request_id] = d.finish_reason
            self._cv.notify_all()

    def wait_tokens(self, request_id: str, count: int, timeout=60.0) -> None:
        with self._cv:
            assert self._cv.wait_for(lambda: len(self.tokens[request_id]) >= count, timeout)

    def wait(self, request_ids, timeout=120.0) -> None:
        deadline = time.monotonic() + timeout
        with self._cv:
            while not set(request_ids) <= self.finished.keys():
                assert self._cv.wait(deadline - time.monotonic()), "requests did not finish"


@pytest.fixture(scope="module")
def workers(ray_local, llama_dir):
    config = EngineConfig.from_kwargs(str(llama_dir), kv_cache_memory_bytes=32 << 20,
                                      long_prefill_token_threshold=32)
    prefill = WorkerActor.options(num_cpus=1).remote("p0", config, TRANSFER, "prefill")
    decode = WorkerActor.options(num_cpus=1).remote("d0", config, TRANSFER, "decode")
    reader = StepReader(decode)
    return prefill, decode, reader


def run(prefill, decode, prompts: dict[str, list[int]], params: SamplingParams) -> None:
    now = time.time()
    reservations = ray.get([decode.reserve.remote(Job(request_id=rid, prompt_token_ids=p,
                                                        sampling_params=params, arrival_time=now))
                            for rid, p in prompts.items()])
    assert all(r is not None for r in reservations)
    results = ray.get([prefill.prefill.remote(PrefillJob(
                           job=Job(request_id=rid, prompt_token_ids=p, sampling_params=params,
                                   arrival_time=now), target=r))
                       for (rid, p), r in zip(prompts.items(), reservations)])
    ray.get([decode.start.remote(r.request_id, r.first_token) for r in results])


def test_disaggregated_workers_match_hf(workers, llama_dir):
    prefill, decode, reader = workers
    oracle = Oracle(llama_dir)
    rng = random.Random(11)
    shared = [rng.randrange(4, 2000) for _ in range(32)]
    prompts = {f"w{i}": (shared if i % 2 else []) + [rng.randrange(4, 2000) for _ in range(n)]
               for i, n in enumerate([5, 18, 40, 77, 130, 9])}
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    run(prefill, decode, prompts, params)
    reader.wait(prompts)
    for rid, prompt in prompts.items():
        expected, _ = oracle.generate(prompt, 10)
        assert reader.tokens[rid] == expected, f"{rid} ({len(prompt)} prompt tokens) differs"
        assert reader.finished[rid] == "length"


def test_abort_mid_stream_frees_blocks_on_both_workers(workers):
    prefill, decode, reader = workers
    params = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    run(prefill, decode, {"long": list(range(10, 90))}, params)
    reader.wait_tokens("long", 3)
    ray.get(decode.abort.remote("long"))
    reader.wait(["long"])
    assert reader.finished["long"] == "abort"
    assert 3 <= len(reader.tokens["long"]) < 500
    for worker in (decode, prefill):
        stats = ray.get(worker.stats.remote())
        assert stats["free_blocks"] == stats["num_blocks"], stats


def test_the_stream_reports_every_step_with_its_shape_and_prefix_events(workers):
    prefill, decode, reader = workers
    before = len(reader.reports)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = list(range(100, 164))  # 4 full blocks
    run(prefill, decode, {"t0": prompt}, params)
    reader.wait(["t0"])
    reports = reader.reports[before:]
    steps = [s for r in reports for s in r.steps]
    # the prompt's KV arrived: the decode worker runs 5 decode steps (token #1 came
    # from the prefill worker), each of one sequence over the growing context
    assert [s.shape.decode_seqs for s in steps][-5:] == [1] * 5
    assert [s.shape.decode_context for s in steps][-5:] == list(range(65, 70))
    assert all(s.shape.prefill_tokens == 0 and s.duration_s > 0 for s in steps)
    stored = [h for r in reports for h in r.prefix_stored]
    assert len(stored) == 4 and len(set(stored)) == 4  # the prompt's full blocks
    last = reports[-1]
    assert last.role == "decode" and last.running == 0 and last.reserved == 0
    assert last.free_blocks == last.num_blocks


def test_a_worker_refuses_calls_of_another_role_and_swaps_roles_when_idle(workers, llama_dir):
    prefill, decode, reader = workers
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with pytest.raises(ray.exceptions.RayTaskError, match="WrongRoleError"):
        ray.get(prefill.reserve.remote(Job(request_id="x", prompt_token_ids=[1, 2, 3],
                                           sampling_params=params, arrival_time=time.time())))
    # busy (a reservation held): no role change
    assert ray.get(decode.reserve.remote(Job(
        request_id="held", prompt_token_ids=list(range(10, 40)), sampling_params=params,
        arrival_time=time.time())))
    with pytest.raises(ray.exceptions.RayTaskError, match="WorkerBusyError"):
        ray.get(decode.set_role.remote("prefill"))
    ray.get(decode.abort.remote("held"))
    reader.wait(["held"])  # the abort's final delta: the reservation is freed
    assert reader.finished["held"] == "abort"
    assert ray.get(decode.stats.remote())["reserved"] == 0
    pids = ray.get([prefill.pid.remote(), decode.pid.remote()])
    ray.get([prefill.set_role.remote("decode"), decode.set_role.remote("prefill")])
    new_decode, new_prefill = prefill, decode
    swapped = StepReader(new_decode)
    oracle = Oracle(llama_dir)
    prompts = {f"s{i}": list(range(200 + i, 240 + 7 * i)) for i in range(3)}
    run(new_prefill, new_decode, prompts, params)
    swapped.wait(prompts)
    for rid, prompt in prompts.items():
        assert swapped.tokens[rid] == oracle.generate(prompt, 8)[0], rid
    assert ray.get([prefill.pid.remote(), decode.pid.remote()]) == pids  # no reload
    ray.get([prefill.set_role.remote("prefill"), decode.set_role.remote("decode")])


def test_a_worker_no_router_asks_for_its_stats_ends_itself(ray_local, llama_dir):
    """A shared pool's detached worker whose every router is gone (orphan_after_s):
    alive for as long as a router keeps asking for its stats, past the bound; ended
    for good once none asks for that long."""
    config = EngineConfig.from_kwargs(str(llama_dir), kv_cache_memory_bytes=8 << 20,
                                      max_model_len=256)
    after_s = 1.5
    actor = WorkerActor.options(num_cpus=0.5).remote("orphan", config, TRANSFER, "decode",
                                                     after_s)
    began = time.monotonic()
    while time.monotonic() - began < 2 * after_s:  # a router asking every third of it
        ray.get(actor.stats.remote(), timeout=30)
        time.sleep(after_s / 3)  # the asking period

    def ended() -> bool:  # pid, not stats: asking for its stats would keep it alive
        try:
            ray.get(actor.pid.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            return True
        return False
    assert until(ended, timeout_s=30, every_s=0.2), "the orphaned worker did not end"
