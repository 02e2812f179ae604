"""Live migration: a draining worker's running requests move to other decode-capable
workers while they keep decoding, so a drain (admin, the planner's scale-down, a role
change) takes about as long as copying their KV, not as long as their longest
remaining decode. Per request (Llumnix's stages; decode_worker/moves.py the workers'
side):

    1. the policy picks a target (placement.Placer.place_moved: the request as it
       stands, off its source); the target takes it over (blocks, its own prefix hits
       counted) under a new id (Flight.new_key)
    2. the source's whole blocks are copied while it decodes on, then those filled
       meanwhile (at most MAX_ROUNDS copies, while a round has MIN_ROUND_BLOCKS new);
       the moves off one worker then wait for each other (PauseGate)
    3. the source pauses it; once its last delta (marked paused) came through the
       source's step stream, the router holds it on the target, which is told the
       tokens made since, and the rest is copied, the last block partly filled
    4. once that copy landed the target decodes on; the source's copy is aborted.
       The pause its client sees: steps 3 and 4.

A step that fails before the pause gives up the move (the target's blocks freed; the
request decodes on where it was, and the drain waits for it); one that fails after it
falls back to replay (request_runner: the request is placed again as its prompt plus
its tokens). A request that ends meanwhile, or moves by replay, gives the move up."""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from dataclasses import dataclass
from typing import Callable

from pdserve.engine.block_manager import blocks_for
from pdserve.router.clock import Clock
from pdserve.router.config import RouterConfig
from pdserve.router.errors import WorkerError, short_reason
from pdserve.router.lifecycle import Flight, Phase
from pdserve.router.metrics import RouterMetrics
from pdserve.router.placer import Placer
from pdserve.router.policy.decision import Colocate
from pdserve.router.pool.pool import Pool
from pdserve.router.pool.workers import WorkerHandle
from pdserve.worker.messages import BlockCopy, IncomingCopy

log = logging.getLogger(__name__)

MAX_ROUNDS = 3  # copies while the request decodes on (Llumnix: at most 3 stages)
MIN_ROUND_BLOCKS = 2  # another round only when it has this many new blocks to copy
MAX_TRIES = 3  # moves of one request off one draining worker


@dataclass(frozen=True)
class MoveRecord:
    """One request moved live, as measured here (LiveMover.records)."""
    request_id: str
    source: str
    target: str
    rounds: int  # copies while it decoded on
    blocks_before: int  # blocks those copied
    blocks_final: int  # blocks the last copy moved, while it was paused
    final_copy_s: float
    pause_call_s: float  # the pause asked -> the source answered (at its step boundary)
    held_s: float  # the pause asked -> its last delta came through, the target grown
    pause_s: float  # from the pause asked to the last copy landed (the target decodes it
    #                 from its next step boundary)


class PauseGate:
    """The moves off one draining worker pause together, once each has made the copies
    it makes while decoding on (or given up): a pause then overlaps no other move's
    bulk copy from the same source, which shares its process and its lanes, and the
    pauses land at the same step boundaries. Measured with 8 moves at once, a pause
    asked while the other moves' first copies were under way took up to 3.5 decode
    steps to be answered. The wait is bounded (timeout_s), and a move that starts once
    the gate opened passes at once."""

    def __init__(self) -> None:
        self._moves = self._arrived = 0
        self._open = asyncio.Event()

    def enter(self) -> None:
        """A move that will arrive, or leave."""
        self._moves += 1

    def leave(self) -> None:
        """A move that ends without arriving (it gave up, or failed)."""
        self._moves -= 1
        self._check()

    async def arrive(self, timeout_s: float) -> None:
        self._arrived += 1
        self._check()
        try:
            await asyncio.wait_for(self._open.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass  # the others are slow: this one pauses on its own

    def _check(self) -> None:
        if self._arrived >= self._moves:
            self._open.set()


class GaveUp(Exception):
    """The move stops: the request ended, moved by replay, or a step failed before the
    pause (it decodes on at its source)."""


class LiveMover:
    def __init__(self, pool: Pool, placer: Placer, metrics: RouterMetrics,
                 config: RouterConfig, clock: Clock,
                 abort_on: Callable[[WorkerHandle, str], None]):
        """abort_on(worker, key): frees a request's id on a worker, bounded, in the
        background (request_runner)."""
        self.pool, self.placer, self.metrics = pool, placer, metrics
        self.config, self.clock, self.abort_on = config, clock, abort_on
        self._copies = itertools.count()
        self.moving: dict[str, asyncio.Task] = {}  # request id -> its move
        self.records: deque[MoveRecord] = deque(maxlen=256)  # the last moves made
        self._unpairing: set[asyncio.Task] = set()  # drained workers' pairs being closed

    async def evacuate(self, source: WorkerHandle, drained: asyncio.Event) -> None:
        """Moves this router's running requests off the draining `source` until it
        holds none: each once it streams (a request still prefilling, or whose move
        gave up, is looked at again when a move ends, or every second; MAX_TRIES
        moves each at most, then it ends where it is)."""
        tries: dict[str, int] = {}
        started: set[asyncio.Task] = set()
        try:
            await self._evacuate(source, drained, tries, started, PauseGate())
        finally:
            if started and source.state.role == "decode":  # once its last copies are sent
                task = asyncio.ensure_future(self._unpair(source, started))
                self._unpairing.add(task)
                task.add_done_callback(self._unpairing.discard)

    async def _evacuate(self, source: WorkerHandle, drained: asyncio.Event,
                        tries: dict[str, int], started: set[asyncio.Task],
                        gate: PauseGate) -> None:
        while not drained.is_set():
            for flight in list(source.flights.values()):
                if flight.phase is Phase.STREAMING and flight.request_id not in self.moving \
                        and not flight.unforked \
                        and tries.get(flight.key, 0) < MAX_TRIES:
                    tries[flight.key] = tries.get(flight.key, 0) + 1
                    gate.enter()  # now: the moves started together wait for each other
                    task = self.moving[flight.request_id] = asyncio.ensure_future(
                        self.move(flight, source, gate))
                    started.add(task)
            wait = {asyncio.ensure_future(drained.wait()), *self.moving.values()}
            done, pending = await asyncio.wait(wait, timeout=1.0,
                                               return_when=asyncio.FIRST_COMPLETED)
            for task in pending - set(self.moving.values()):
                task.cancel()

    async def _unpair(self, source: WorkerHandle, moves: set[asyncio.Task]) -> None:
        """A worker in role decode sends KV only to move requests: the pairs it opened
        for that close once those moves are done (a departing target could not tell it
        to: pairing.py tells the workers that prefill). Its drain is over by the time
        the last move's request is held elsewhere, before its last copy is sent."""
        await asyncio.wait(moves, timeout=self.config.prefill_timeout_s)
        targets = [w.address for w in self.pool.workers.values()
                   if w is not source and w.state.decodes and w.address]
        try:
            await asyncio.wait_for(source.client.disconnect(targets),
                                   self.config.control_timeout_s)
        except Exception as exc:
            log.warning("%s could not close the pairs it moved requests over: %s",
                        source.worker_id, short_reason(exc))

    async def move(self, flight: Flight, source: WorkerHandle,
                   gate: PauseGate | None = None) -> bool:
        """True once the request decodes on another worker. gate: the moves off
        `source` it pauses with, entered already (default: it pauses on its own)."""
        if gate is None:
            gate = PauseGate()
            gate.enter()
        arrived: list[bool] = []
        try:
            began = self.clock.monotonic()
            record = await self._move(flight, source, gate, arrived)
        except GaveUp as why:
            log.info("request %s stays on %s: %s", flight.request_id, source.worker_id, why)
            self.metrics.live_moves.labels(self.metrics.model_name, "gave_up").inc()
            return False
        except Exception as exc:  # after the pause: it is placed again (replay)
            log.warning("request %s could not move off %s live (%s): it is placed again",
                        flight.request_id, source.worker_id, short_reason(exc))
            self.metrics.live_moves.labels(self.metrics.model_name, "replayed").inc()
            if flight.decode is not None and not flight.released:
                flight.queue.put_nowait(WorkerError(
                    f"live migration off {source.worker_id} failed: {short_reason(exc)}"))
            return False
        finally:
            self.moving.pop(flight.request_id, None)
            if not arrived:
                gate.leave()
        self.metrics.live_moves.labels(self.metrics.model_name, "moved").inc()
        self.metrics.migrations.labels(self.metrics.model_name, "drain", "decode").inc()
        self.metrics.migration_pause.observe(record.pause_s)
        self.records.append(record)
        log.info("request %s moved off %s live in %.3fs (paused %.1f ms)", flight.request_id,
                 source.worker_id, self.clock.monotonic() - began, record.pause_s * 1e3)
        return True

    async def _move(self, flight: Flight, source: WorkerHandle, gate: PauseGate,
                    arrived: list[bool]) -> MoveRecord:
        """The stages. Raises GaveUp before the pause, anything else after it."""
        key_s, timeout_s = flight.key, self.config.control_timeout_s
        target, key_t, res, job = await self._take_over(flight, source)
        held = len(job.output_token_ids)  # outputs the target holds
        copied = cached = res.num_cached_blocks
        prompt, bs, rounds = len(flight.req.prompt_token_ids), self.placer.model.block_size, 0
        try:
            while rounds < MAX_ROUNDS:  # while it decodes on at the source
                self._still_there(flight, source, key_s)
                seen = flight.num_output_tokens
                whole = (prompt + seen - 1) // bs  # computed at the source by now
                if whole - copied < (MIN_ROUND_BLOCKS if rounds else 1):
                    break
                copied += await self._copy(source, key_s, target, IncomingCopy(
                    request_id=key_t, transfer_id=self._transfer_id(key_t), first_block=copied,
                    token_ids=flight.output_token_ids[held:seen], text_sent=flight.text_sent))
                held, rounds = seen, rounds + 1
            arrived.append(True)
            await gate.arrive(timeout_s)
            self._still_there(flight, source, key_s)
            flight.paused = asyncio.Event()
            pause_at = self.clock.monotonic()
            paused = await asyncio.wait_for(source.client.pause(key_s), timeout_s)
            paused_at = self.clock.monotonic()
            if paused is None:
                raise GaveUp("it is no longer running there")
        except BaseException as exc:
            flight.paused = None
            self.abort_on(target, key_t)
            if isinstance(exc, Exception) and not isinstance(exc, GaveUp):
                raise GaveUp(f"moving it to {target.worker_id} failed: "
                             f"{short_reason(exc)}") from None
            raise
        try:  # paused: from here a failure replays it
            # The rest of its KV, at least its last block (the target decodes on once a
            # copy lands: there must be one).
            end = blocks_for(paused.num_computed_tokens, bs)
            final = IncomingCopy(
                request_id=key_t, transfer_id=self._transfer_id(key_t),
                first_block=min(copied, end - 1),
                token_ids=paused.output_token_ids[held:], text_sent=paused.text_sent,
                final=True)
            expecting = asyncio.ensure_future(asyncio.wait_for(
                target.client.expect_copy(final), timeout_s))
            try:  # while the target readies, its last tokens come through the stream
                await asyncio.wait_for(flight.paused.wait(), timeout_s)
            finally:
                blocks = await expecting
            self._still_there(flight, source, key_s)
            held_at = self.clock.monotonic()
            # Held on the target before the last copy: once that lands the target decodes
            # on, and its first delta must find the request there.
            source.unhold(flight)
            flight.key, flight.decode = key_t, target
            target.hold(flight)
            copy_at = self.clock.monotonic()
            await self._send(source, key_s, target, final, blocks)
            done_at = self.clock.monotonic()
        except BaseException:
            self.abort_on(target, key_t)
            self.abort_on(source, key_s)
            raise
        finally:
            flight.paused = None
        self.abort_on(source, key_s)
        return MoveRecord(request_id=flight.request_id, source=source.worker_id,
                          target=target.worker_id, rounds=rounds,
                          blocks_before=copied - cached, blocks_final=len(blocks),
                          final_copy_s=done_at - copy_at, pause_call_s=paused_at - pause_at,
                          held_s=held_at - pause_at, pause_s=done_at - pause_at)

    async def _take_over(self, flight: Flight, source: WorkerHandle):
        """The target chosen by the policy and its reservation, under a new id."""
        req = flight.moved
        refused: frozenset[str] = frozenset()
        while True:
            try:
                decision = await self.placer.place_moved(flight, req, refused,
                                                         frozenset({source.worker_id}))
            except Exception as exc:
                raise GaveUp(f"no target: {short_reason(exc)}") from None
            target = self.pool.workers[decision.worker if isinstance(decision, Colocate)
                                       else decision.decode]
            if target is source:
                raise GaveUp("no other worker can take it")
            self._still_there(flight, source, flight.key)
            key_t = flight.new_key()
            job = flight.job(key_t)
            try:
                res = await asyncio.wait_for(target.client.take_over(job, self.pool.subscriber),
                                             self.config.reserve_timeout_s)
            except Exception as exc:
                self.abort_on(target, key_t)
                raise GaveUp(f"{target.worker_id} could not take it over: "
                             f"{short_reason(exc)}") from None
            if res is not None:
                return target, key_t, res, job
            refused |= {target.worker_id}

    def _transfer_id(self, key: str) -> str:
        return f"{key}\x1fcopy-{next(self._copies)}"

    async def _copy(self, source: WorkerHandle, key_s: str, target: WorkerHandle,
                    incoming: IncomingCopy) -> int:
        """The target grows and expects the copy; the source sends it. Returns the
        blocks copied."""
        blocks = await asyncio.wait_for(target.client.expect_copy(incoming),
                                        self.config.control_timeout_s)
        await self._send(source, key_s, target, incoming, blocks)
        return len(blocks)

    async def _send(self, source: WorkerHandle, key_s: str, target: WorkerHandle,
                    incoming: IncomingCopy, blocks: list[int]) -> None:
        if blocks:
            await asyncio.wait_for(source.client.send_blocks(BlockCopy(
                transfer_id=incoming.transfer_id, request_id=key_s,
                first_block=incoming.first_block, target_address=target.address,
                target_blocks=blocks, final=incoming.final)), self.config.prefill_timeout_s)

    @staticmethod
    def _still_there(flight: Flight, source: WorkerHandle, key: str) -> None:
        if flight.released or flight.key != key or flight.decode is not source \
                or flight.phase is not Phase.STREAMING or flight.cancelled.is_set():
            raise GaveUp("it ended, or moved otherwise")
