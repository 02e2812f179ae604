"""The pure scheduler: `schedule() -> SchedulerOutput`, then `update(output, sampled)`.

Lifecycle: add_request -> waiting -> (admitted, blocks allocated) running -> finished.
Under KV pressure a running request is preempted, the lowest-ranked first. Its KV is
recomputed (its blocks freed; it goes back to the front of the waiting queue) or
swapped (its computed blocks copied to host memory; it waits in `swapped` and
resumes where it was once blocks are free, before any new request is admitted):
preemption_mode says which; auto chooses per request by cost (`swap_is_cheaper`,
from the engine's latency model and measured copy bandwidth). A full swap area falls
back to recompute. No torch, no I/O; the clock, for the waiting timeout, and the
costs are passed in.

The waiting timeout (the seeds' rule): a request still waiting for its first token
past waiting_timeout_share of its TTFT SLO, behind a full batch (no blocks, or
max_num_seqs running), preempts the lowest-priority running decode and is admitted
in its place. Bounded so that decodes' TPOT is not traded away for it: at most one
such preemption a step, never of a decode preempted before (each decode pays at most
one recompute for the rule), never of one of higher priority, and only where the
victim's blocks make the room.
"""
from __future__ import annotations

import itertools
from typing import Callable, Sequence

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.request import FinishReason, Request, RequestStatus
from pdserve.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput, SchedulerStats
from pdserve.engine.steady_batch import SteadyBatch

# The most prompt positions a step computes logits for, for prompt logprobs: each is a
# vocabulary-wide row (151k floats for Qwen2: 256 rows, 155 MB, and a copy for the
# log-softmax), beyond the rows sampling takes. A scoring prompt's chunks are cut to
# what is left of it.
PROMPT_LOGPROB_ROWS = 256


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 num_lookahead_tokens: int = 0, clock: Callable[[], float] | None = None,
                 swap_is_cheaper: Callable[[int, int], bool] | None = None):
        """num_lookahead_tokens: KV slots past its scheduled tokens a decoding request
        keeps when they are free (a draft model writes its drafts' KV there). clock:
        the time requests' arrival_time is on (the waiting timeout reads it; None:
        no waiting timeout). swap_is_cheaper(tokens, blocks): preemption_mode auto's
        rule, whether copying a victim's blocks out and back costs less than
        recomputing its tokens (None: swap whenever there is room)."""
        self.config = config
        self.clock = clock if config.waiting_timeout else None
        self.block_manager = block_manager
        self.num_lookahead_tokens = num_lookahead_tokens
        host = block_manager.host
        self._can_swap = config.preemption_mode != "recompute" and host is not None \
            and host.num_swap_blocks > 0
        self.swap_is_cheaper = swap_is_cheaper
        self.requests: dict[str, Request] = {}
        self._scored_rows = PROMPT_LOGPROB_ROWS  # this step's left (_score)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []  # preempted with their KV in host memory
        self.stats = SchedulerStats()
        self._order: dict[str, int] = {}  # request id -> arrival sequence number
        self._seq = itertools.count()
        # The running batch as the last update left it, when each of its requests is
        # one token behind (a decode): schedule() takes it whole while it is unchanged.
        self._steady: SteadyBatch | None = None
        self._forked: list[tuple[str, Request]] = []  # (parent id, choice): take_forked

    # ---- queue management -------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._order[request.request_id] = next(self._seq)
        self.waiting.append(request)

    def finish_requests(self, request_ids, reason: FinishReason) -> list[Request]:
        """Finish (abort, or stop on text) requests between steps; frees their blocks."""
        done = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is not None:
                self._finish(request, reason)
                done.append(request)
        return done

    def reserve(self, request: Request) -> bool:
        """Decode role: allocate blocks for a prompt whose KV another worker computes.
        Leading blocks found in the local prefix cache count as computed and need not
        arrive. False (nothing changed) when the pool lacks room."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if self.swapped:
            return False  # swapped requests resume before new ones take blocks
        bm = self.block_manager
        hits = bm.get_computed_blocks(request)
        host_hits = bm.get_host_hits(request, len(hits))
        num_hit_tokens = (len(hits) + len(host_hits)) * bm.block_size
        if not bm.allocate_slots(request, request.num_tokens - num_hit_tokens, hits, host_hits):
            return False
        request.num_computed_tokens = num_hit_tokens
        request.status = RequestStatus.WAITING_FOR_KV
        self.requests[request.request_id] = request
        self._order[request.request_id] = next(self._seq)
        self._count_admission(request, num_hit_tokens, len(host_hits))
        return True

    def admit_prefilled(self, request_id: str, first_token: int,
                        choices: Sequence[int] = ()) -> Request:
        """The prompt's KV landed: the request joins the batch with its prompt (and a
        moved request's outputs so far) computed and the prefill worker's next token
        appended; choices: n > 1, the first tokens of its choices 1 .. n-1, forked
        from it here (take_forked; those a stop token or max_tokens 1 ends at once
        are finished and freed)."""
        request = self.requests[request_id]
        if request.status is not RequestStatus.WAITING_FOR_KV:
            raise ValueError(f"request {request_id} is not waiting for KV")
        if len(choices) != request.num_choices - 1:
            raise ValueError(f"request {request_id} has {request.num_choices} choices, "
                             f"not {len(choices) + 1}")
        request.num_computed_tokens = request.num_tokens
        self.block_manager.cache_full_blocks(request, request.num_computed_tokens)
        if choices:
            self._fork(request, [(token, None, None) for token in choices], [])
        request.append_output(first_token)
        self.stats.generation_tokens += 1
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return request

    def take_forked(self) -> list[tuple[str, Request]]:
        """The choices forked since the last call (n > 1), each running with its first
        token (or finished by it), with the id of the request they forked from: the
        engine tracks and reports them."""
        forked, self._forked = self._forked, []
        return forked

    # ---- live migration: a running request's KV copied to another worker -------

    def pause(self, request_id: str) -> Request | None:
        """The source: a running request leaves the batch, its KV kept (for a last copy;
        it is finished, its blocks freed, once it runs elsewhere). None when it is not
        running: finished, or preempted (its KV is gone)."""
        request = self.requests.get(request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
            return None
        self.running.remove(request)
        request.status = RequestStatus.PAUSED
        return request

    def grow(self, request_id: str, token_ids: list[int]) -> bool:
        """The target: the tokens the request generated on its source since it was
        reserved here (as its outputs), and blocks for them. False, nothing changed,
        when the pool lacks room."""
        request = self.requests[request_id]
        if request.status is not RequestStatus.WAITING_FOR_KV:
            raise ValueError(f"request {request_id} is not waiting for KV")
        needed = request.num_tokens + len(token_ids) - request.num_computed_tokens
        if not self.block_manager.allocate_slots(request, needed):
            return False
        request.extend_output(token_ids)
        return True

    def resume_moved(self, request_id: str) -> Request:
        """The target: its KV landed, all but its last token's (the source sampled that
        and never ran it): it joins the batch, that token next."""
        request = self.requests[request_id]
        if request.status is not RequestStatus.WAITING_FOR_KV:
            raise ValueError(f"request {request_id} is not waiting for KV")
        request.num_computed_tokens = request.num_tokens - 1
        self.block_manager.cache_full_blocks(request, request.num_computed_tokens)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return request

    def propose(self, drafts: dict[str, list[int]]) -> None:
        """Speculative decoding: draft tokens for running requests, verified in their
        next step (vLLM's update_draft_token_ids)."""
        for rid, tokens in drafts.items():
            request = self.requests.get(rid)
            if tokens and request is not None and request.status is RequestStatus.RUNNING:
                request.spec_token_ids = tokens
                self._steady = None

    def drop_outputs(self, request: Request, num: int) -> None:
        """A verified run's last `num` tokens taken back (a stop string ended it)."""
        request.drop_outputs(num)
        self.stats.generation_tokens -= max(num, 0)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_schedulable(self) -> bool:
        """Work a step could do now (copies between the tiers count); requests waiting
        for their KV are not."""
        return bool(self.waiting or self.running or self.swapped
                    or self.block_manager.has_copies)

    # ---- one step ---------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """The next step; its copies between the tiers (out.kv_copies) run before its
        forward pass, and update() is called after it."""
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        steady = self._steady
        if steady is not None and steady.holds(self.running, self.waiting or self.swapped,
                                               budget):
            out = steady.schedule()
            if out is not None:
                if bm.has_copies:
                    out.kv_copies = bm.take_copies()
                return out
        out = SchedulerOutput()
        self._scored_rows = PROMPT_LOGPROB_ROWS
        if self.config.policy == "priority":
            self.running.sort(key=self._rank)
        if self.config.prioritize_prefill:
            prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
            budget = self._schedule_running(prefills, budget, out)
            budget = self._admit_waiting(budget, out)
            scheduled = set(map(id, out.requests))  # admitted one token short
            decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1
                       and id(r) not in scheduled]
            budget = self._schedule_running(decodes, budget, out)
            # after the decodes: blocks they need are never taken for a resumption
            self._resume_swapped(budget, out)
        else:
            budget = self._schedule_running(list(self.running), budget, out)
            budget = self._resume_swapped(budget, out)
            self._admit_waiting(budget, out)
        out.total_num_scheduled_tokens = sum(out.num_scheduled)
        out.num_running = len(self.running)
        if bm.has_copies:
            out.kv_copies = bm.take_copies()
        return out

    def update(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Advance progress counters, append sampled tokens, finish what stopped (the
        stop rule: Request.check_stop, for every path). The copies taken so far ran
        (a forward pass followed them on every rank): their blocks are unpinned."""
        bm = self.block_manager
        if out.requests or not bm.copies_on_other_ranks:
            bm.release_copies()
        steady = self._steady
        if out.steady and steady is not None \
                and not (result.logprobs or result.top_logprobs or result.failed):
            generated, events = steady.update(self.running, result.sampled_token_ids)
            self.stats.generation_tokens += generated
            finished = []
            for request in events:
                if self._stopped(request):
                    finished.append(request)
                else:
                    steady.going_on(request)
            steady.requests = list(self.running)
            return finished
        finished = self._update(out, result)
        self._steady = None if result.choices else SteadyBatch.after(
            out, self.running, self.block_manager)  # (forked choices: not in `out`)
        return finished

    def _update(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        finished = []
        sampled, failed, choices = result.sampled_token_ids, result.failed, result.choices
        logprobs, tops = result.logprobs, result.top_logprobs
        plain = not (logprobs or tops)  # the common step: tokens alone
        bs = self.block_manager.block_size
        cache_full_blocks = self.block_manager.cache_full_blocks
        running = RequestStatus.RUNNING
        generated = 0
        spec = out.spec_token_ids
        for request, n in zip(out.requests, out.num_scheduled):
            if request.status is not running:
                continue
            rid = request.request_id
            if spec and rid in spec:
                if self._update_verified(request, spec[rid], result):
                    finished.append(request)
                continue
            before = request.num_computed_tokens
            request.num_computed_tokens = computed = before + n
            if computed // bs != before // bs:
                cache_full_blocks(request, computed)
            if computed != request.num_tokens:
                continue  # a partial prefill chunk samples nothing
            if rid in failed:
                request.error = failed[rid]
                self._finish(request, FinishReason.ERROR)
                finished.append(request)
                continue
            if choices and rid in choices:
                self._fork(request, choices[rid], finished)
            generated += 1
            if plain:  # Request.append_output inlined: per request per step
                token = sampled[rid]
                request.output_token_ids.append(token)
                request.num_tokens = computed + 1
                # check_stop's rule can hold only then (and is read only then)
                if token not in request.stop_token_set \
                        and computed + 1 < request.max_num_tokens:
                    continue
            else:
                request.append_output(sampled[rid], logprobs.get(rid), tops.get(rid))
            if self._stopped(request):
                finished.append(request)
        self.stats.generation_tokens += generated
        return finished

    def _fork(self, request: Request, draws: list[tuple], finished: list[Request]) -> None:
        """Parallel sampling, at the request's first token (its KV computed, its own
        token not yet appended): the first tokens of its other choices kept, and
        where it runs on here (forks_here) each choice joins the batch as a request
        of its own sharing its blocks (BlockManager.fork); choices that finish at once
        go to `finished`."""
        request.choices, request.num_choices = draws, 1
        if not request.forks_here:
            return
        computed = request.num_computed_tokens
        for index, (token, logprob, top) in enumerate(draws, 1):
            child = request.fork(index)
            self.block_manager.fork(request, child, computed)
            child.num_computed_tokens = computed
            child.append_output(token, logprob, top)
            child.status = RequestStatus.RUNNING
            self.requests[child.request_id] = child
            self._order[child.request_id] = next(self._seq)
            self.running.append(child)
            self._forked.append((request.request_id, child))
            self.stats.generation_tokens += 1
            if self._stopped(child):
                finished.append(child)

    def _stopped(self, request: Request) -> bool:
        """Finished by its last token (Request.check_stop: a stop token, or its length)."""
        reason = request.check_stop()
        if reason is None:
            return False
        self._finish(request, reason)
        return True

    def _update_verified(self, request: Request, drafts: list[int],
                         result: ModelRunnerOutput) -> bool:
        """A request that verified drafts: its KV is kept up to the last accepted draft
        (the rejected drafts' slots are written over later), the emitted tokens are
        appended up to a stop, and the blocks they complete are cached. True when it
        finished."""
        rid = request.request_id
        if rid in result.failed:
            request.error = result.failed[rid]
            self._finish(request, FinishReason.ERROR)
            return True
        verified = result.verified[rid]
        stats, accepted = self.stats, verified.num_accepted
        stats.spec_decode_num_drafts += 1
        stats.spec_decode_num_draft_tokens += len(drafts)
        stats.spec_decode_num_accepted_tokens += accepted
        per_pos = stats.spec_decode_num_accepted_tokens_per_pos
        per_pos.extend([0] * (len(drafts) - len(per_pos)))
        for j in range(accepted):
            per_pos[j] += 1
        computed = request.num_computed_tokens + 1 + accepted
        tokens, logprobs, tops = verified.token_ids, verified.logprobs, verified.top_logprobs
        reason = None
        for i, token in enumerate(tokens):
            request.append_output(token, logprobs[i] if logprobs else None,
                                  tops[i] if tops else None)
            reason = request.check_stop()
            if reason is not None:
                del tokens[i + 1:]  # what follows a stop is not output
                break
        stats.generation_tokens += len(tokens)
        request.num_computed_tokens = computed = min(computed, request.num_tokens)
        self.block_manager.cache_full_blocks(request, computed)
        if reason is None:
            return False
        self._finish(request, reason)
        return True

    # ---- internals ----------------------------------------------------------

    def _schedule_running(self, requests: list[Request], budget: int,
                          out: SchedulerOutput) -> int:
        threshold = self.config.long_prefill_token_threshold
        bm = self.block_manager
        bs = bm.block_size
        append_block = bm.append_block
        running = RequestStatus.RUNNING
        scheduled, counts = out.requests, out.num_scheduled
        add_request, add_count = scheduled.append, counts.append
        for request in requests:
            if budget <= 0:
                break
            if request.status is not running:
                continue  # preempted earlier in this step
            if request.shared_tail:  # a choice's block its siblings share: copied first
                while not bm.own_tail(request):
                    victim = max(self.running, key=self._rank)
                    budget += self._preempt(victim, out)
                    if victim is request:
                        break
                if request.status is not running:
                    continue
            computed = request.num_computed_tokens
            n = request.num_tokens - computed
            if n == 1 and (request.spec_token_ids or self.num_lookahead_tokens) \
                    and request.num_choices == 1:  # (else its first token draws n)
                n = self._schedule_speculative(request, budget, out)
                if n:
                    budget -= n
                    continue
                n = 1  # no room for drafts or lookahead: a plain decode
            if n == 1:  # a decode: its last block has room, or one more block is free
                room = len(request.block_ids) * bs - computed
                if room > 0 or (room == 0 and append_block(request)):
                    add_request(request)
                    add_count(1)
                    budget -= 1
                    continue
            if threshold and n > threshold:
                n = threshold
            if n > budget:
                n = budget
            if request.scores_prompt and not (n := self._score(n)):
                continue
            fits = computed + n <= len(request.block_ids) * bs
            while not fits and not bm.allocate_slots(request, n):
                victim = max(self.running, key=self._rank)
                budget += self._preempt(victim, out)
                if victim is request:
                    break
            else:
                add_request(request)
                add_count(n)
                budget -= n
        return budget

    def _schedule_speculative(self, request: Request, budget: int,
                              out: SchedulerOutput) -> int:
        """A decode with its drafts (as many as the budget leaves room for) and the
        lookahead slots; the tokens scheduled, or 0 when the blocks are not free:
        speculation never preempts."""
        # At most what the budget leaves room for, and never past max_tokens or the
        # context (drafts proposed before the request gained tokens may be stale).
        room = min(budget - 1, request.max_num_tokens - request.num_tokens - 1)
        drafts, request.spec_token_ids = request.spec_token_ids[:max(room, 0)], []
        n = 1 + len(drafts)
        bm, lookahead = self.block_manager, self.num_lookahead_tokens
        if not (bm.allocate_slots(request, n + lookahead)
                or (lookahead and bm.allocate_slots(request, n))):
            return 0
        out.requests.append(request)
        out.num_scheduled.append(n)
        if drafts:
            out.spec_token_ids[request.request_id] = drafts
        return n

    def _resume_swapped(self, budget: int, out: SchedulerOutput) -> int:
        """Swapped requests back into the batch, in rank order, before any new one:
        their blocks copied back (or found still cached), their next tokens scheduled.
        None in a step that had to preempt."""
        if not self.swapped or out.preempted_request_ids:
            return budget
        cfg, bm, stats = self.config, self.block_manager, self.stats
        threshold = cfg.long_prefill_token_threshold
        unforked = self._unforked_choices() if cfg.max_num_seqs else 0
        while self.swapped and budget > 0:
            request = min(self.swapped, key=self._rank)
            if cfg.max_num_seqs and (len(self.running) + unforked + _seats(request)
                                     > cfg.max_num_seqs):
                break
            n = min(request.num_tokens - request.num_computed_tokens, budget,
                    threshold or budget)
            if request.scores_prompt and not (n := self._score(n)):
                break
            copied = bm.swap_in(request, n)
            if copied < 0:
                break
            self.swapped.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            unforked += _seats(request) - 1
            stats.num_swapped_in += 1
            stats.num_blocks_swapped_in += copied
            out.requests.append(request)
            out.num_scheduled.append(n)
            budget -= n
        return budget

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> int:
        if out.preempted_request_ids:
            return budget  # no room for newcomers in a step that had to preempt
        cfg = self.config
        bm = self.block_manager
        unforked = self._unforked_choices() if cfg.max_num_seqs and self.waiting else 0
        while self.waiting and budget > 0:
            request = (min(self.waiting, key=self._rank) if cfg.policy == "priority"
                       else self.waiting[0])
            if self.swapped and not self._overdue(request):
                break  # swapped requests resume first
            # its seats: the choices it forks (n > 1) run at once
            full = cfg.max_num_seqs and (len(self.running) + unforked + _seats(request)
                                         > cfg.max_num_seqs)
            if full and not self._overdue(request):
                break
            hits = bm.get_computed_blocks(request)
            host_hits = bm.get_host_hits(request, len(hits))
            num_hit_tokens = (len(hits) + len(host_hits)) * bm.block_size
            n = request.num_tokens - num_hit_tokens
            if cfg.long_prefill_token_threshold:
                n = min(n, cfg.long_prefill_token_threshold)
            n = min(n, budget)
            if request.scores_prompt and not (n := self._score(n)):
                break
            if full or not bm.allocate_slots(request, n, hits, host_hits):
                if not self._overdue(request):
                    break
                # the room its chunk and its host hits' blocks take
                budget += self._preempt_for(request, n + len(host_hits) * bm.block_size, out)
                if not out.preempted_request_ids:
                    break
                hits = bm.get_computed_blocks(request)  # the victim's freeing moved none
                host_hits = bm.get_host_hits(request, len(hits))
                num_hit_tokens = (len(hits) + len(host_hits)) * bm.block_size
                n = min(request.num_tokens - num_hit_tokens, budget,
                        cfg.long_prefill_token_threshold or budget)
                if request.scores_prompt:
                    n = self._score(n) or 1
                if not bm.allocate_slots(request, n, hits, host_hits):
                    break
                self._admit(request, n, num_hit_tokens, len(host_hits), out)
                break  # one admission by the rule a step; nobody else after a preemption
            self._admit(request, n, num_hit_tokens, len(host_hits), out)
            unforked += _seats(request) - 1
            budget -= n
        return budget

    def _unforked_choices(self) -> int:
        """The seats the running requests for n > 1 take once they fork, beyond their
        own."""
        return sum(_seats(r) - 1 for r in self.running if r.num_choices > 1)

    def _score(self, n: int) -> int:
        """A chunk of a request scoring its prompt (prompt logprobs: a vocabulary-wide
        logits row per token), cut to the rows this step has left of
        PROMPT_LOGPROB_ROWS, which it takes; 0: none left (it waits for the next)."""
        n = min(n, self._scored_rows)
        self._scored_rows -= n
        return n

    def _overdue(self, request: Request) -> bool:
        """Waiting for its first token past its share of its TTFT SLO."""
        return (self.clock is not None and request.ttft_slo_s is not None
                and not request.output_token_ids and request.num_preemptions == 0
                and self.clock() - request.arrival_time
                > self.config.waiting_timeout_share * request.ttft_slo_s)

    def _preempt_for(self, request: Request, tokens: int, out: SchedulerOutput) -> int:
        """The waiting timeout's victim preempted (the budget it gave back): the
        lowest-priority running decode never preempted before, of no higher priority
        than `request`, whose blocks, with those free, hold `tokens` more tokens (the
        next chunk of `request` past its prefix hits)."""
        bm = self.block_manager
        need = -(-tokens // bm.block_size)
        # (a victim's blocks are free again within the step whether it is recomputed
        # or swapped: a swap's copies run before the forward pass that writes them)
        candidates = [r for r in self.running
                      if r.num_tokens - r.num_computed_tokens == 1 and r.num_preemptions == 0
                      and self._rank(r)[0] >= self._rank(request)[0]
                      and bm.num_free_blocks + len(r.block_ids) >= need]
        if not candidates:
            return 0
        victim = max(candidates, key=self._rank)
        self.stats.num_preemptions_for_waiting += 1
        return self._preempt(victim, out)

    def _admit(self, request: Request, n: int, num_hit_tokens: int, num_host_hits: int,
               out: SchedulerOutput) -> None:
        """Into the running batch with blocks for its next n tokens (num_hit_tokens
        found cached, num_host_hits blocks of them loaded from the host tier)."""
        self.waiting.remove(request)
        request.num_computed_tokens = num_hit_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if request.num_preemptions == 0:
            self._count_admission(request, num_hit_tokens, num_host_hits)
        else:
            self.stats.num_host_blocks_loaded += num_host_hits
        out.requests.append(request)
        out.num_scheduled.append(n)

    def _count_admission(self, request: Request, num_hit_tokens: int,
                         num_host_hits: int) -> None:
        """A request's first admission (or reservation): its prefix hits."""
        stats, host_tokens = self.stats, num_host_hits * self.block_manager.block_size
        request.num_cached_tokens = num_hit_tokens
        request.num_host_cached_tokens = host_tokens
        stats.prompt_tokens += request.num_prompt_tokens
        stats.prefix_cache_queries += request.num_prompt_tokens
        stats.prefix_cache_hits += num_hit_tokens
        stats.host_prefix_cache_hits += host_tokens
        stats.num_host_blocks_loaded += num_host_hits

    def _preempt(self, request: Request, out: SchedulerOutput) -> int:
        """Preemption, by swap or recompute (preemption_mode); returns the budget it
        gave back this step."""
        self.running.remove(request)
        request.spec_token_ids = []
        out.spec_token_ids.pop(request.request_id, None)
        request.num_preemptions += 1
        stats = self.stats
        stats.num_preemptions += 1
        if self._swaps(request) and self.block_manager.swap_out(request):
            request.status = RequestStatus.SWAPPED
            self.swapped.append(request)
            stats.num_swapped_out += 1
            stats.num_blocks_swapped_out += len(request.host_block_ids)
        else:
            self.block_manager.free(request)
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
            self.waiting.insert(0, request)
        out.preempted_request_ids.append(request.request_id)
        for i, scheduled in enumerate(out.requests):
            if scheduled is request:
                out.requests.pop(i)
                return out.num_scheduled.pop(i)
        return 0

    def _swaps(self, request: Request) -> bool:
        """Whether a victim's KV goes to the swap area (else it is recomputed): a mode
        that swaps, KV computed and none arriving in this step's copies, and under
        auto the cheaper way."""
        bm = self.block_manager
        if not self._can_swap or request.num_computed_tokens == 0 or (
                bm.loading and not bm.loading.isdisjoint(request.block_ids)):
            return False
        if self.config.preemption_mode == "swap" or self.swap_is_cheaper is None:
            return True
        tokens = request.num_computed_tokens
        return self.swap_is_cheaper(tokens, bm.blocks_needed(tokens))

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        elif request.status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.requests.pop(request.request_id, None)
        self._order.pop(request.request_id, None)

    def _rank(self, request: Request) -> tuple[int, int]:
        """Sort key: lower runs first, the maximum is the preemption victim."""
        priority = request.priority if self.config.policy == "priority" else 0
        return priority, self._order[request.request_id]


def _seats(request: Request) -> int:
    """The sequences a request runs here once its first token forks its choices (n > 1;
    a prefill worker's only draws them: one)."""
    return request.num_choices if request.forks_here else 1
