"""The router's request lifecycle against worker stand-ins at the Ray boundary
(tests/router/fakes.py): whatever ends a request, the workers its phase holds are
told to free it, and the router's own counts return to zero. Each test names the
defect of issue #12 it pins down."""
from __future__ import annotations

import asyncio
import pickle
import time

import pytest

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.kv_transfer import (
    KVTransferError,
    LayoutMismatchError,
    PeerLostError,
    TransferAborted,
    TransferRefused,
    TransferTimeout,
)
from pdserve.router.config import RouterConfig, RoutingSpec
from pdserve.router.errors import OverloadedError, WorkerError, WorkerStalled
from pdserve.router.lifecycle import Accepted
from pdserve.router.model_info import ModelInfo
from pdserve.router.placer import Placer
from pdserve.router.router import Router
from pdserve.router.slo import Slo
from pdserve.worker.messages import WorkerStats
from tests.router.fakes import (
    FakeWorker,
    batch,
    prefill_ok,
    reserve_ok,
    resolve,
    worker,
)
from tests.router.fakes import reported as reported_batch

PARAMS = SamplingParams(max_tokens=4, temperature=0)


@pytest.fixture(scope="module")
def tok(llama_dir):
    return Tokenizer(llama_dir)


def _disaggregated(tok, decode: FakeWorker, prefill: FakeWorker, free_blocks: int = 100,
                   **config) -> Router:
    return Router(tok, ModelInfo("m", 512, tok.vocab_size, 16),
                  [worker("p0", prefill, "prefill"), worker("d0", decode, "decode", free_blocks)],
                  RouterConfig(**config))


def _counts(router: Router) -> tuple:
    (d,), (p,) = router.pool.decode.values(), router.pool.prefill.values()
    return (router.num_inflight, d.state.inflight, len(d.flights), p.state.queued,
            p.state.queued_tokens)


async def _drain(stream) -> list:
    return [delta async for delta in stream]


def test_a_stale_full_figure_does_not_latch_overload(tok):
    # Defect 1: a worker last reported full was skipped without being asked, forever.
    async def scenario():
        decode = FakeWorker(reserve=reserve_ok(), start=resolve(None), abort=resolve(None))
        prefill = FakeWorker(prefill=prefill_ok(7), abort=resolve(None))
        router = _disaggregated(tok, decode, prefill, free_blocks=0)
        await router.start()
        stream = router.generate(await router.accept([5, 6, 7], PARAMS))
        first = await stream.__anext__()
        await decode.batches.put(batch("d0", first.request_id, [7, 8], "", "length"))
        rest = await _drain(stream)
        await router.stop()
        return first, rest, decode, router
    first, rest, decode, router = asyncio.run(scenario())
    assert first.token_ids == [7] and rest[-1].finish_reason == "length"
    assert len(decode.calls["reserve"]) == 1
    assert _counts(router) == (0, 0, 0, 0, 0)


@pytest.mark.parametrize("phase", ["reserve", "prefill"])
def test_a_cancel_mid_phase_aborts_every_worker_holding_the_request(tok, phase):
    # Defects 2 and 3: a cancel during prefill never reached the prefill worker; a
    # cancel during reserve left the decode worker's count at +1 and its late
    # reservation unaborted.
    async def scenario():
        decode = FakeWorker(abort=resolve(None),
                           **({"reserve": reserve_ok()} if phase == "prefill" else {}))
        prefill = FakeWorker(abort=resolve(None))  # prefill never answers
        router = _disaggregated(tok, decode, prefill)
        req = await router.accept([5, 6, 7], PARAMS)
        consumer = asyncio.ensure_future(_drain(router.generate(req)))
        await (decode if phase == "reserve" else prefill).wait_call(phase)
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
        await router.stop()
        return decode, prefill, router, req.request_id
    decode, prefill, router, rid = asyncio.run(scenario())
    assert decode.ids("abort") == [rid]
    assert prefill.ids("abort") == ([rid] if phase == "prefill" else [])
    assert _counts(router) == (0, 0, 0, 0, 0)


def test_a_reservation_answered_after_its_timeout_is_aborted(tok):
    # Defect 3: a reservation landing after the router gave up held its blocks.
    async def scenario():
        decode = FakeWorker(abort=resolve(None))  # reserve never answers in time
        router = _disaggregated(tok, decode, FakeWorker(), reserve_timeout_s=0.2)
        req = await router.accept([5, 6, 7], PARAMS)
        with pytest.raises(OverloadedError):
            await _drain(router.generate(req))
        await router.stop()
        return decode, router, req.request_id
    decode, router, rid = asyncio.run(scenario())
    assert decode.ids("abort") == [rid]
    assert _counts(router) == (0, 0, 0, 0, 0)


def test_the_same_request_id_twice_at_once_is_invalid_not_overload(tok):
    # Defect 11: concurrent duplicates got RESOURCE_EXHAUSTED (retried by the SDK).
    async def scenario():
        decode = FakeWorker(abort=resolve(None))
        router = _disaggregated(tok, decode, FakeWorker())
        first = asyncio.ensure_future(_drain(router.generate(
            await router.accept([1, 2], PARAMS, "same"))))
        await decode.wait_call("reserve")
        with pytest.raises(InvalidRequestError) as err:
            await _drain(router.generate(await router.accept([3, 4], PARAMS, "same")))
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await router.stop()
        return err.value
    assert asyncio.run(scenario()).field == "request_id"


def test_a_request_the_kv_cache_can_never_hold_is_invalid(tok):
    # Defect 11: the worker's own check came back as a refusal, so 429 forever.
    def refuse(future, *args):
        future.set_exception(InvalidRequestError("max_tokens", "needs 40 KV blocks; "
                                                 "the cache holds 8"))

    async def scenario():
        decode = FakeWorker(reserve=refuse, abort=resolve(None))
        router = _disaggregated(tok, decode, FakeWorker())
        with pytest.raises(InvalidRequestError) as err:
            await _drain(router.generate(await router.accept([1, 2], PARAMS)))
        await router.stop()
        return err.value, router
    err, router = asyncio.run(scenario())
    assert err.field == "max_tokens" and "KV blocks" in str(err)
    assert _counts(router) == (0, 0, 0, 0, 0)


def test_token_one_carries_its_text_and_the_stream_does_not_repeat_it(tok):
    # Defect 12: token #1 went out with empty text; its text came one hop later.
    prompt = tok.encode("The weather today is")
    first_token, second = tok.encode(" sunny and", add_special_tokens=False)[:2]

    async def scenario():
        decode = FakeWorker(reserve=reserve_ok(), start=resolve(None), abort=resolve(None))
        router = _disaggregated(tok, decode, FakeWorker(prefill=prefill_ok(first_token)))
        await router.start()
        stream = router.generate(await router.accept(prompt, PARAMS))
        first = await stream.__anext__()
        full = tok.decode(prompt + [first_token, second])[len(tok.decode(prompt)):]
        await decode.batches.put(batch("d0", first.request_id, [first_token, second], full,
                                       "length"))
        rest = await _drain(stream)
        await router.stop()
        return first, rest, full
    first, rest, full = asyncio.run(scenario())
    assert first.text and full.startswith(first.text)
    assert first.text + "".join(d.text for d in rest) == full
    assert [t for d in rest for t in d.token_ids] == [second]


def test_a_decode_worker_that_stops_stepping_fails_its_requests_within_the_bound(tok):
    # Defect 6: a worker whose engine loop died left every request waiting forever.
    async def scenario():
        engine = FakeWorker(submit=resolve(None), abort=resolve(None))
        router = Router(tok, ModelInfo("m", 512, tok.vocab_size, 16),
                        [worker("e0", engine, "both", 100)],
                        RouterConfig(stall_timeout_s=0.3,  # --migration-limit 0: it fails
                                     routing=RoutingSpec(migration_limit=0)))
        await router.start()
        t0 = time.monotonic()
        with pytest.raises(WorkerStalled):
            await _drain(router.generate(await router.accept([1, 2, 3], PARAMS)))
        elapsed = time.monotonic() - t0
        await router.stop()
        return elapsed, engine, router
    elapsed, engine, router = asyncio.run(scenario())
    assert elapsed < 3, elapsed
    assert len(engine.calls["abort"]) == 1 and router.num_inflight == 0


def test_a_dead_decode_stream_fails_its_requests_and_takes_the_worker_out(tok):
    async def scenario():
        engine = FakeWorker(submit=resolve(None), abort=resolve(None))
        router = Router(tok, ModelInfo("m", 512, tok.vocab_size, 16),
                        [worker("e0", engine, "both", 100)],  # --migration-limit 0: it fails
                        RouterConfig(routing=RoutingSpec(migration_limit=0)))
        await router.start()
        consumer = asyncio.ensure_future(_drain(router.generate(
            await router.accept([1, 2, 3], PARAMS))))
        await engine.wait_call("submit")
        await engine.batches.put(RuntimeError("actor died (pid=4242, ip=10.1.2.3)"))
        with pytest.raises(WorkerError) as err:
            await consumer
        with pytest.raises(OverloadedError):  # no live engine worker is left
            await _drain(router.generate(await router.accept([1, 2, 3], PARAMS)))
        await router.stop()
        return err.value
    assert "RuntimeError" in str(asyncio.run(scenario()))


@pytest.mark.parametrize("error", [
    InvalidRequestError("top_p", "must be in (0, 1]"),
    KVTransferError("r1", "broken"), LayoutMismatchError(None, "head_dim differs"),
    TransferRefused("r2", "not expected"), TransferTimeout("r3", "late"),
    TransferAborted("r4", "aborted"), PeerLostError("r5", "gone"),
    OverloadedError("full", 2.5)])
def test_every_error_crossing_a_process_boundary_round_trips(error):
    # Defect 10: two-argument errors did not unpickle, so Ray handed the router an
    # opaque wrapper and field names were lost.
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error)
    assert vars(back) == vars(error)


class Ticking:
    """A clock a microsecond further on at each read: the router measures whatever
    this test does between two tokens (on a busy machine, more than a step's
    forecast) as next to nothing."""

    def __init__(self) -> None:
        self.now = time.time()

    def time(self) -> float:
        self.now += 1e-6
        return self.now

    def monotonic(self) -> float:
        return self.time()


def test_finished_requests_calibrate_the_forecasts_of_the_workers_they_ran_on(tok):
    """The fakes answer at once: measured far below forecast, so the prefill worker's
    TTFT and the decode worker's TPOT factors (split placements) fall below 1. Once
    the decode worker's process restarts, what was measured of the old one is gone."""
    async def scenario():
        d0 = FakeWorker(reserve=reserve_ok(), start=resolve(None), abort=resolve(None),
                        stats=resolve(WorkerStats(num_blocks=100, free_blocks=100)),
                        address=resolve("d0-again"))
        prefill = FakeWorker(prefill=prefill_ok(7), abort=resolve(None), connect=resolve(None))
        router = Router(tok, ModelInfo("m", 512, tok.vocab_size, 16),
                        [worker("p0", prefill, "prefill"), worker("d0", d0, "decode", 100)],
                        clock=Ticking())
        await router.start()
        stream = router.generate(await router.accept([5, 6, 7], PARAMS))
        first = await stream.__anext__()
        await d0.batches.put(batch("d0", first.request_id, [7, 8], "", "length"))
        await _drain(stream)
        factors = (router.workers["p0"].state.calibration.factors,
                   router.workers["d0"].state.calibration.factors,
                   router.placer.snapshot().workers)
        await router.pool.supervision.rejoin(router.workers["d0"])  # as after Ray restarted its process
        after = {w.worker_id: w.calibration.factors for w in router.placer.snapshot().workers}
        await router.stop()
        return factors, after, router.models
    (p0, d0, snapshot), after, models = asyncio.run(scenario())
    assert set(p0) == {("ttft", "disaggregate")} and p0[("ttft", "disaggregate")] < 1
    assert set(d0) == {("tpot", "disaggregate")} and d0[("tpot", "disaggregate")] < 1
    assert {w.worker_id: w.calibration.factors for w in snapshot} == {"p0": p0, "d0": d0}
    assert after == {"p0": p0, "d0": {}} and set(models.calibrators) == {"p0"}


def test_telemetry_on_the_stream_moves_placement_without_any_scrape(tok):
    """A decode worker that reports full ranks last; once its next report says it has
    room, it is chosen again: no stats call, no refusal needed. (Without calibration:
    the fakes' instant tokens would teach it that d1 is fast.)"""
    async def scenario():
        d0 = FakeWorker(reserve=reserve_ok(), start=resolve(None), abort=resolve(None))
        d1 = FakeWorker(reserve=reserve_ok(), start=resolve(None), abort=resolve(None))
        prefill = FakeWorker(prefill=prefill_ok(7), abort=resolve(None))
        router = Router(tok, ModelInfo("m", 512, tok.vocab_size, 16),
                        [worker("p0", prefill, "prefill"), worker("d0", d0, "decode", 100),
                         worker("d1", d1, "decode", 100)],
                        RouterConfig(routing=RoutingSpec(calibrate=False)))
        reported = asyncio.Event()
        hear = router.pool.on_report

        def heard(worker, report):
            hear(worker, report)
            if worker.worker_id == "d0":
                reported.set()
        router.pool.on_report = heard
        await router.start()

        async def place() -> str:
            stream = router.generate(await router.accept([5, 6, 7], PARAMS))
            first = await stream.__anext__()
            chosen = next(a for a in (d0, d1) if first.request_id in a.ids("reserve"))
            name = "d0" if chosen is d0 else "d1"
            await chosen.batches.put(batch(name, first.request_id, [7, 8], "", "length"))
            await _drain(stream)
            return name
        await d0.batches.put(reported_batch("d0", "decode", free_blocks=0))
        await reported.wait()
        full = await place()
        reported.clear()
        await d0.batches.put(reported_batch("d0", "decode", free_blocks=100))
        await reported.wait()
        again = await place()
        await router.stop()
        return full, again, d0, d1
    full, again, d0, d1 = asyncio.run(scenario())
    assert (full, again) == ("d1", "d0")
    assert not d0.calls["stats"] and not d1.calls["stats"]


def test_a_worker_silent_past_the_bound_is_evicted_and_one_that_speaks_again_is_not(tok):
    """Telemetry silent past stall_timeout_s: out of service at once; silent for
    revive_timeout_s more: evicted. A worker that reports again in time stays."""
    async def scenario():
        quiet = FakeWorker(abort=resolve(None))
        back = FakeWorker(abort=resolve(None))
        router = Router(tok, ModelInfo("m", 512, tok.vocab_size, 16),
                        [worker("e0", quiet, "both", 100), worker("e1", back, "both", 100)],
                        RouterConfig(stall_timeout_s=0.2, revive_timeout_s=0.6))
        changes = asyncio.Queue()
        router.on_change.append(lambda: changes.put_nowait(dict(router.worker_states())))
        await router.start()
        seen = []
        try:
            async with asyncio.timeout(10):
                while not seen or "e0" in seen[-1]:
                    seen.append(await changes.get())
                    if seen[-1].get("e1") == "stalled":  # e1 speaks again; e0 never does
                        await back.batches.put(reported_batch("e1", "both", 100))
        finally:
            await router.stop()
        return seen, router
    seen, router = asyncio.run(scenario())
    assert any(s.get("e0") == "stalled" for s in seen)
    assert any(s.get("e1") == "serving" and s.get("e0") == "stalled" for s in seen)
    assert list(router.workers) == ["e1"] and router.worker_states() == {"e1": "serving"}


def test_a_request_waits_for_kv_while_its_ttft_slo_allows_and_is_refused_when_not(tok):
    # The decode worker reports no free KV. A request whose TTFT SLO leaves time
    # waits (no 429), and is placed when the worker's next report frees blocks; one
    # whose SLO not even an idle worker could meet is refused at once, as 400 (the
    # wait's own bound: test_a_refusal_waits_only_while_capacity_is_predicted_to_
    # free_in_time). Nothing is left held either way.
    async def scenario():
        decode = FakeWorker(reserve=reserve_ok(), start=resolve(None), abort=resolve(None))
        prefill = FakeWorker(prefill=prefill_ok(7), abort=resolve(None))
        router = _disaggregated(tok, decode, prefill, free_blocks=0)
        await router.start()
        patient = router.generate(await router.accept([5, 6, 7], PARAMS,
                                                      slo=Slo(ttft_s=30.0)))
        first = asyncio.ensure_future(patient.__anext__())
        await asyncio.wait({first}, timeout=0.3)  # a bound: it must still be waiting
        waiting = not first.done() and not decode.calls["reserve"]
        with pytest.raises(InvalidRequestError, match="slo_ttft_ms 0.1 cannot be met"):
            await _drain(router.generate(await router.accept([5, 6, 8], PARAMS,
                                                              slo=Slo(ttft_s=1e-4))))
        await decode.batches.put(reported_batch("d0", "decode", 100))
        token = await asyncio.wait_for(first, 10)
        await decode.batches.put(batch("d0", token.request_id, [7, 8], "", "length"))
        rest = await _drain(patient)
        waits = router.metrics.waited._value.get()
        placed = router.metrics.registry.get_sample_value(
            "pdserve:router_placement_waiters_total", {"model_name": "m", "outcome": "placed"})
        assert placed == 1  # the patient one; the other never waited
        await router.stop()
        return waiting, token, rest, waits, router
    waiting, token, rest, waits, router = asyncio.run(scenario())
    assert waiting and token.token_ids == [7] and rest[-1].finish_reason == "length"
    assert waits >= 1
    assert _counts(router) == (0, 0, 0, 0, 0)


def test_a_refusal_waits_only_while_capacity_is_predicted_to_free_in_time():
    # A 1 s TTFT SLO, placed at 0.1 s once capacity frees: 0.9 s to wait. A refusal
    # for harm whose first broken request ends in 2 s is answered at once (waiting
    # would only turn a fast 429 into a slow one); one ending in 0.5 s waits; so for
    # TPOT, by when the batch's first request ends. A KV refusal carries no
    # prediction of when capacity frees: it waits.
    from pdserve.router.policy.decision import Reject
    req = Accepted("r", [1, 2], PARAMS, arrival_time=100.0, slo=Slo(ttft_s=1.0))

    def wait(kind, retry_after_s, ttft_s=0.1):
        return Placer.may_wait(req, Reject("", retry_after_s, kind, ttft_s=ttft_s))
    assert wait("harm", 2.0) == 0.0
    assert wait("harm", 0.5) == pytest.approx(0.9)
    assert wait("tpot", 2.0) == 0.0 and wait("tpot", 0.5) == pytest.approx(0.9)
    assert wait("kv", 2.0) == pytest.approx(0.9)
    # forecast 0.1 s after waiting 0.6 already: 0.3 s left to wait
    assert wait("kv", 2.0, ttft_s=0.7) == pytest.approx(0.3)
    assert wait("harm", 0.5, ttft_s=0.7) == 0.0  # frees after the TTFT SLO's deadline
    assert wait("ttft", 0.0) == 0.0
    assert Placer.may_wait(Accepted("r", [1], PARAMS, 100.0),
                            Reject("", 0.5, "harm", 0.1)) == 0.0  # no TTFT SLO: nothing to wait for


def test_a_wait_for_capacity_is_bounded_by_max_wait_ms(tok):
    # No free KV, and a TTFT SLO that would allow a 30 s wait: with max_wait_ms=50
    # the 429 comes after about 50 ms, and the wait is recorded as refused; with 0
    # it comes at once and nothing waited.
    async def refusal(max_wait_ms):
        decode = FakeWorker(reserve=reserve_ok(), start=resolve(None), abort=resolve(None))
        prefill = FakeWorker(prefill=prefill_ok(7), abort=resolve(None))
        router = _disaggregated(tok, decode, prefill, free_blocks=0,
                                routing=RoutingSpec(max_wait_ms=max_wait_ms))
        await router.start()
        try:
            began = time.monotonic()
            with pytest.raises(OverloadedError, match="KV"):
                await asyncio.wait_for(_drain(router.generate(await router.accept(
                    [5, 6, 7], PARAMS, slo=Slo(ttft_s=30.0)))), 10)
            took = time.monotonic() - began
        finally:
            await router.stop()
        waits = router.metrics.registry.get_sample_value(
            "pdserve:router_placement_wait_seconds_sum",
            {"model_name": "m", "outcome": "refused"})
        return took, waits, _counts(router)
    took, waits, counts = asyncio.run(refusal(50))
    assert 0.05 <= took < 5 and 0.05 <= waits < 5
    assert counts == (0, 0, 0, 0, 0)
    took, waits, counts = asyncio.run(refusal(0))
    assert took < 5 and waits is None and counts == (0, 0, 0, 0, 0)


def test_max_wait_ms_must_be_a_finite_number_at_least_zero():
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="max_wait_ms"):
            RoutingSpec(max_wait_ms=bad)
    assert RoutingSpec().max_wait_s == float("inf")
    assert RoutingSpec(max_wait_ms=40).max_wait_s == 0.04


def test_a_request_for_n_choices_stays_in_flight_until_its_last_choice_ends(tok):
    """n = 2, disaggregated: the prefill's two first tokens go out at once (choice 1's
    from its draw), the decode worker is started with choice 1's token, and when
    choice 0 finishes first the request is still in flight: an abort then ends
    choice 1 on the worker, its stream with "abort"."""
    from pdserve.engine.request import choice_id

    async def scenario():
        decode = FakeWorker(reserve=reserve_ok(), start=resolve(None), abort=resolve(None))
        router = _disaggregated(tok, decode, FakeWorker(prefill=prefill_ok(7, choices=(9,))))
        await router.start()
        req = await router.accept([5, 6, 7], SamplingParams(max_tokens=8, n=2))
        stream = router.generate(req)
        firsts = [await stream.__anext__(), await stream.__anext__()]
        await decode.batches.put(batch("d0", req.request_id, [7, 8], "", "stop"))
        ended = await stream.__anext__()
        while not ended.finished:
            ended = await stream.__anext__()
        in_flight = router.num_inflight
        found = router.requests.abort(req.request_id)
        rest = await _drain(stream)
        await router.stop()
        return firsts, ended, in_flight, found, rest, decode, router, req.request_id
    firsts, ended, in_flight, found, rest, decode, router, rid = asyncio.run(scenario())
    assert sorted((d.index, d.token_ids) for d in firsts) == [(0, [7]), (1, [9])]
    assert decode.calls["start"][0][0] == (rid, 7, [9])  # choice 1 forks there
    assert (ended.index, ended.finish_reason) == (0, "stop")
    assert in_flight == 1 and found
    assert [(d.index, d.finish_reason) for d in rest] == [(1, "abort")]
    assert choice_id(rid, 1) in decode.ids("abort")
    assert _counts(router) == (0, 0, 0, 0, 0)


def test_a_leader_that_ends_before_its_start_returns_leaves_its_choices_starting(tok):
    """n = 2, disaggregated: choice 0 stops at its first token, and its last delta
    comes on the step stream before the start call's answer. The start also started
    choice 1: the leader's release must not cancel it (choice 1 would be failed as
    "could not start", and moved, for nothing)."""
    from pdserve.engine.request import choice_id

    async def scenario():
        decode = FakeWorker(reserve=reserve_ok(), abort=resolve(None))  # start: held
        router = _disaggregated(tok, decode, FakeWorker(prefill=prefill_ok(7, choices=(9,))))
        await router.start()
        req = await router.accept([5, 6, 7], SamplingParams(max_tokens=3, n=2))
        stream = router.generate(req)
        deltas = [await stream.__anext__(), await stream.__anext__()]
        await decode.wait_call("start")
        await decode.batches.put(batch("d0", req.request_id, [7], "", "stop"))
        while not (deltas[-1].index == 0 and deltas[-1].finished):
            deltas.append(await stream.__anext__())
        decode.calls["start"][0][1].set_result(None)  # the start's answer, late
        await decode.batches.put(batch("d0", choice_id(req.request_id, 1), [9, 4, 5], "",
                                       "length"))
        deltas += await _drain(stream)
        await router.stop()
        return deltas, decode, router
    deltas, decode, router = asyncio.run(scenario())
    ones = [d for d in deltas if d.index == 1]
    assert [t for d in ones for t in d.token_ids] == [9, 4, 5]
    assert ones[-1].finish_reason == "length"
    assert len(decode.calls["reserve"]) == 1 and len(decode.calls["start"]) == 1
    assert _counts(router) == (0, 0, 0, 0, 0)
