"""Drives a simulated cluster's router with a workload, as `pdserve bench run` drives
a server: requests go out at their arrival times (the same arrival processes and
trace timestamps), optionally capped in flight, each with the run's SLOs; its
first token and its end are recorded in virtual time, in a bench RequestRecord, so
the same summary and reports follow. Sessions (bench/sessions.py) start at their
arrival times and send each turn once the one before has ended and its think time
has passed on the virtual clock; max_concurrency then caps sessions under way."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable, Iterable

from pdserve.bench.arrivals import arrivals, trace_times
from pdserve.bench.metrics import SLO, RequestRecord
from pdserve.bench.sessions import Session, play
from pdserve.bench.workloads import BenchRequest
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.errors import OverloadedError
from pdserve.router.router import Router
from pdserve.router.slo import Slo


@dataclass
class SimRecord(RequestRecord):
    """A request's record without a time per token (a run may make hundreds of
    millions): its first and last output times and the count. Its inter-token gaps
    are counted by the workers (itl.py)."""
    output_tokens: int = 0

    @property
    def num_output_tokens(self) -> int:
        return self.output_tokens

    @property
    def itls(self) -> list[float]:
        return []


@dataclass(frozen=True)
class Load:
    """How the workload is sent (bench run's flags of the same names)."""
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int = 0  # 0 = no cap
    seed: int = 0  # arrivals
    slo: SLO = SLO()  # sent with every request, as bench run sends its --goodput


async def drive(router: Router, requests: Iterable[BenchRequest | Session], load: Load,
                until: Callable[[RequestRecord], bool] | None = None,
                ) -> tuple[list[RequestRecord], float]:
    """Sends every request and plays every session; returns their records, in the
    requests' order (a session's turns in order), and the run's duration (virtual
    seconds from the first send to the last request's end).
    One sender walks the requests (a list, or an iterator drawing each as it is due)
    and starts each at its time: the loop holds the requests in flight and one timer,
    not one sleeping task per request of the run. `until(record)`, called as each
    request ends, returning True stops the run there: nothing more is sent, the
    requests in flight are cancelled, and only the records of those that ended return."""
    loop = asyncio.get_running_loop()
    if isinstance(requests, list) and requests and all(
            isinstance(r, BenchRequest) and r.timestamp is not None for r in requests):
        offsets: Iterable[float] = trace_times([r.timestamp for r in requests])
    else:
        offsets = arrivals(load.request_rate, load.burstiness, load.seed)
    cap = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    slo = Slo.from_ms(load.slo.ttft_ms, load.slo.tpot_ms)
    records: list[list[RequestRecord]] = []  # item i's: a request's, or a session's turns'
    in_flight: set[asyncio.Task] = set()
    stopped = asyncio.Event()

    async def send(i: int, request_id: str, req: BenchRequest,
                   reply: list[int] | None = None) -> RequestRecord:
        record = await _send(router, request_id, req, slo, reply)
        records[i].append(record)
        if until is not None and until(record):
            stopped.set()
        return record

    async def one(i: int, item: BenchRequest | Session) -> None:
        try:
            if isinstance(item, Session):
                await play(item, lambda req, reply: send(i, f"sim-{i}-{req.turn}", req, reply))
            else:
                await send(i, f"sim-{i}", item)
        finally:
            if cap is not None:
                cap.release()

    start = loop.time()
    for i, (req, offset) in enumerate(zip(requests, offsets)):
        if (wait := start + offset - loop.time()) > 0:
            await asyncio.sleep(wait)
        if cap is not None:
            await cap.acquire()  # in arrival order, as a bench client's queue
        if stopped.is_set():
            break
        records.append([])
        task = loop.create_task(one(i, req))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    rest = asyncio.gather(*in_flight, return_exceptions=True)
    if not stopped.is_set():
        stop = loop.create_task(stopped.wait())
        await asyncio.wait([rest, stop], return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
    if stopped.is_set():
        for task in in_flight:
            task.cancel()
        await rest
    return [record for ended in records for record in ended], loop.time() - start


async def _send(router: Router, request_id: str, req: BenchRequest, slo: Slo,
                reply: list[int] | None = None) -> RequestRecord:
    """reply (given): the output token ids are put there."""
    now = router.clock.time
    record = SimRecord(now(), num_prompt_tokens=len(req.prompt), session=req.session,
                       turn=req.turn)
    if isinstance(req.prompt, str):
        raise InvalidRequestError("prompt", "the simulator takes token-id prompts")
    params = SamplingParams(max_tokens=req.max_tokens, temperature=0, ignore_eos=True)
    try:
        accepted = await router.accept(list(req.prompt), params, request_id, slo=slo)
        async for delta in router.generate(accepted):
            if delta.token_ids:
                if record.first_output_time is None:
                    record.first_output_time = now()
                    placed = router.forecast_of(request_id)
                    record.predicted_ttft = getattr(placed, "ttft_s", None)
                    record.predicted_tpot = getattr(placed, "tpot_s", None)
                record.output_tokens += len(delta.token_ids)
                if reply is not None:
                    reply += delta.token_ids
            if delta.finished:
                record.num_cached_tokens = delta.num_cached_tokens
                record.num_host_cached_tokens = delta.num_host_cached_tokens
        record.end_time = now()
    except OverloadedError:
        record.rejected = True
        record.end_time = now()
    except Exception as exc:  # a failed request is a result, never a crash of the run
        record.error = f"{type(exc).__name__}: {exc}"
    return record
