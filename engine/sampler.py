"""Turn logits into tokens: structured outputs, logit bias, min_tokens, penalties,
greedy, temperature, min-p, top-k, top-p, per-request seeds. The order is vLLM's: a
structured request's grammar mask first (its logprobs see it), then the logit bias,
min_tokens' mask of the stop tokens and the penalties (greedy sees them too), then
temperature, then the truncations. Logprobs are of the logits before the bias and
penalties, as vLLM reports by default.

A seeded request's k-th output token is drawn with noise hashed from (seed, k)
(`race_noise`), in one batched pass for all rows on the logits' device, so it does not
depend on where it is sampled or what rides with it: the prefill worker samples token 0 and a
decode worker the rest, a preempted request recomputes, batches differ, and the tokens
are the same as one engine sampling them all."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.spec_decode import rejection_sampler
from pdserve.engine.structured_outputs import Grammars

_MASK64 = (1 << 64) - 1


def token_seed(seed: int, index: int) -> int:
    """SplitMix64 of (seed, index): distinct streams for nearby seeds and indices."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


class Sampler:
    def __init__(self, seed: int, grammars: Grammars | None = None):
        """grammars: this worker's structured-output state (None: a rank that does not
        sample, or an engine without a tokenizer)."""
        self._default = torch.Generator().manual_seed(seed)
        self._seeded = torch.Generator()
        self.grammars = grammars
        # The distinct prompt tokens of requests with a repetition penalty, built once
        # per request rather than every step (a 2k-token prompt costs ~0.3 ms to set up).
        self._prompt_ids: dict[str, torch.Tensor] = {}
        self._biases: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # logit_bias

    def forget(self, request_id: str) -> None:
        self._prompt_ids.pop(request_id, None)
        self._biases.pop(request_id, None)
        if self.grammars is not None:
            self.grammars.forget(request_id)

    def sample(self, logits: torch.Tensor, requests: list[Request],
               params: list[SamplingParams] | None = None
               ) -> tuple[list[int], list[float | None], list[dict[int, float] | None]]:
        """logits: [N, vocab] float32, row i for requests[i] -> per row one token, its
        logprob and the top logprobs {token: logprob} (None where not asked). params:
        row i's parameters where they are not requests[i]'s own (a request's other
        choices: its seed + i)."""
        if params is None:
            params = [r.sampling_params for r in requests]
        structured = [i for i, p in enumerate(params) if p.structured_outputs is not None]
        if structured:  # host work first: on a GPU the step's kernels still run
            self._grammars().mask(logits, structured, [requests[i] for i in structured])
        raw = logits
        adjusted = [i for i, (r, p) in enumerate(zip(requests, params))
                    if _adjusts(p, len(r.output_token_ids))]
        if adjusted:
            logits = logits.clone()
            for i in adjusted:
                self._adjust(logits[i], requests[i], requests[i].output_token_ids)
        chosen = logits.argmax(dim=-1)
        drawn = [i for i, p in enumerate(params) if not p.greedy]
        if drawn:  # on the device: one host sync for greedy and drawn rows together
            rows = torch.tensor(drawn, device=logits.device)
            chosen[rows] = self._draw(logits[rows], [params[i] for i in drawn],
                                      [len(requests[i].output_token_ids) for i in drawn])
        tokens = chosen.tolist()
        logprobs: list[float | None] = [None] * len(params)
        tops: list[dict[int, float] | None] = [None] * len(params)
        wanted = [i for i, p in enumerate(params) if p.logprobs]
        if wanted:
            rows = _logprobs(raw[wanted])
            chosen = torch.tensor([tokens[i] for i in wanted], device=raw.device)
            values = rows.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
            for j, (i, value) in enumerate(zip(wanted, values)):
                logprobs[i] = value
                if params[i].top_logprobs:
                    top = rows[j].topk(params[i].top_logprobs)
                    tops[i] = dict(zip(top.indices.tolist(), top.values.tolist()))
        return tokens, logprobs, tops

    def verify(self, logits: torch.Tensor, request: Request, drafts: list[int],
               argmax: list[int] | None = None
               ) -> tuple[list[int], list[float] | None, list[dict[int, float]] | None]:
        """logits: [len(drafts) + 1, vocab] float32, row j after the request's tokens
        and drafts[:j] -> the tokens the step emits (accepted drafts, then the target's
        own), their logprobs and top logprobs (None where not asked). Each row is
        sampled as plain decoding samples that position (rejection_sampler.verify);
        `argmax`: the rows' argmax, when the caller has it for a whole batch."""
        p = request.sampling_params
        output = request.output_token_ids
        if p.structured_outputs is not None:  # each row under the state after its drafts
            self._grammars().verify_masks(logits, request, drafts)
            argmax = None  # the batch's were of the unmasked rows
        adjusts = _adjusts(p, len(output))
        if adjusts:
            def row(j: int) -> torch.Tensor:  # as plain decoding sees it: drafts as output
                adjusted = logits[j].clone()
                self._adjust(adjusted, request, output + drafts[:j])
                return adjusted
        else:
            row = logits.__getitem__
        if p.greedy and not adjusts:
            best = argmax if argmax is not None else logits.argmax(dim=-1).tolist()
            sample_at = best.__getitem__
        elif p.greedy:
            def sample_at(j: int) -> int:
                return int(row(j).argmax())
        else:
            def sample_at(j: int) -> int:
                return int(self._draw(row(j).unsqueeze(0), [p], [len(output) + j])[0])
        run = rejection_sampler.verify(drafts, sample_at)
        if not p.logprobs:
            return run, None, None
        rows = _logprobs(logits[:len(run)])
        chosen = torch.tensor(run, device=logits.device).unsqueeze(1)
        logprobs = rows.gather(1, chosen).squeeze(1).tolist()
        if not p.top_logprobs:
            return run, logprobs, None
        top = rows.topk(p.top_logprobs, dim=-1)
        return run, logprobs, [dict(zip(i, v)) for i, v in
                               zip(top.indices.tolist(), top.values.tolist())]

    def _draw(self, logits: torch.Tensor, params: list[SamplingParams],
              output_indices: list[int]) -> torch.Tensor:
        """logits: [R, vocab], the rows of requests that sample (not greedy) -> one
        token each ([R] long, on the logits' device: no host sync).
        Temperature, min-p, top-k and top-p apply to all rows at once; each row then
        draws by an exponential race (the token maximizing p / E, E ~ Exp(1) per token:
        token j wins with probability p_j), its E's hashed from the row's seed and the
        token ids (`race_noise`), so a row's draw depends on that row alone (a seeded
        request draws the same token in any batch, on any worker) and a seeded row's
        seed is its (seed, index); an unseeded row's comes from the engine's
        generator."""
        device = logits.device

        def column(values) -> torch.Tensor:
            return torch.tensor(values, device=device).unsqueeze(1)
        x = logits / column([p.temperature for p in params])
        if any(p.min_p > 0 for p in params):
            probs = x.softmax(-1)
            x = x.masked_fill(probs < column([p.min_p for p in params])
                              * probs.max(-1, keepdim=True).values, float("-inf"))
        vocab = x.shape[-1]
        ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        if any(ks):
            values = torch.topk(x, max(ks)).values  # [R, max k], descending
            kth = values.gather(1, column([max(k, 1) - 1 for k in ks]))
            kth = kth.masked_fill(column([k == 0 for k in ks]), float("-inf"))
            x = x.masked_fill(x < kth, float("-inf"))
        if any(p.top_p < 1.0 for p in params):
            sorted_logits, order = torch.sort(x, descending=True, stable=True)
            mass = sorted_logits.softmax(-1)
            # Keep the smallest prefix whose mass reaches top_p, the first token always
            # (a top_p below float32's range compares as 0 and would drop it too).
            top_p = column([p.top_p for p in params])
            drop = (mass.cumsum(-1) - mass >= top_p) & (top_p < 1.0)
            drop[:, 0] = False
            x = x.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
        probs = x.softmax(-1)
        unseeded = iter(torch.randint(0, 1 << 62, (sum(p.seed is None for p in params),),
                                      generator=self._default).tolist())
        seeds = [next(unseeded) if p.seed is None else token_seed(p.seed, index)
                 for p, index in zip(params, output_indices)]
        noise = race_noise(torch.tensor(seeds, device=device), vocab)
        drawn = torch.where(probs > 0, probs / noise, -1.0).argmax(-1)
        # Extreme penalties overflow a logit to inf (inf - inf is NaN in softmax): the
        # distribution has collapsed onto those tokens; the first of them.
        collapsed = x.nan_to_num(nan=float("-inf")).argmax(-1)
        return torch.where(torch.isfinite(probs).all(-1), drawn, collapsed)

    def _grammars(self) -> Grammars:
        if self.grammars is None:
            raise ValueError("structured outputs need the engine's tokenizer")
        return self.grammars

    def _adjust(self, row: torch.Tensor, request: Request, output: Sequence[int]) -> None:
        """In place on one row of logits, before `output` (the request's outputs, and
        a verification's drafts before this row): the logit bias, the stop tokens
        masked while fewer than min_tokens are out, the penalties."""
        p = request.sampling_params
        if p.logit_bias:
            ids, values = self._bias(request, row.device)
            row[ids] += values
        if len(output) < p.min_tokens and request.stop_token_set:
            stops = list(request.stop_token_set)
            kept = row[stops].clone() if p.structured_outputs is not None else None
            row[stops] = float("-inf")
            if kept is not None and not torch.isfinite(row).any():
                row[stops] = kept  # its grammar is complete: only an end is left
        if p.penalized:
            _penalize(row, p, self._distinct_prompt(request, row), output)

    def _bias(self, request: Request, device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor]:
        bias = self._biases.get(request.request_id)
        if bias is None:
            items = request.sampling_params.logit_bias
            bias = self._biases[request.request_id] = (
                torch.tensor(list(items), dtype=torch.long, device=device),
                torch.tensor(list(items.values()), dtype=torch.float32, device=device))
        return bias

    def _distinct_prompt(self, request: Request, logits: torch.Tensor) -> torch.Tensor:
        ids = self._prompt_ids.get(request.request_id)
        if ids is None:
            ids = torch.tensor(request.prompt_token_ids, device=logits.device).unique()
            self._prompt_ids[request.request_id] = ids
        return ids


# vLLM's floor for a logprob: a token masked out (a grammar's, -inf) is reported as
# this, a number JSON can carry.
MIN_LOGPROB = -9999.0


def _logprobs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1).clamp_(min=MIN_LOGPROB)


def _adjusts(p: SamplingParams, num_output: int) -> bool:
    """Whether a request's logits are changed before sampling (Sampler._adjust)."""
    return p.penalized or p.logit_bias is not None or p.min_tokens > num_output


def race_noise(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] Exp(1) draws, float32, on the seeds' device: entry (r, j) a
    function of seeds[r] and j alone (SplitMix64 of the pair, its top 23 bits a
    uniform in (0, 1): `unit`), in a few batched integer ops rather than a generator
    per row."""
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    z = seeds.to(torch.int64).unsqueeze(1) ^ (ids * _GOLDEN).unsqueeze(0)
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return -torch.log(unit(z ^ _shr(z, 31)))


def unit(z: torch.Tensor) -> torch.Tensor:
    """int64 bits -> float32 strictly inside (0, 1): the top 23 bits and a half, exact
    in float32 (24 bits would round 2^24 - 0.5 up to 1.0, an Exp draw of 0)."""
    return (_shr(z, 41).to(torch.float32) + 0.5) * 2.0 ** -23


def _signed(value: int) -> int:
    """A 64-bit constant as int64 holds it."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9,
                                               0x94D049BB133111EB))


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _penalize(row: torch.Tensor, p: SamplingParams, prompt_ids: torch.Tensor,
              output: Sequence[int]) -> None:
    """In place on one row of logits; prompt_ids are the prompt's distinct tokens."""
    output_ids = torch.tensor(output, dtype=torch.long, device=row.device)
    if p.repetition_penalty != 1:
        seen = torch.cat([prompt_ids, output_ids]).unique()
        values = row[seen]
        # A token a grammar masked stays -inf (a penalty that rounds to 0 in float32
        # would make it NaN, and argmax take it).
        row[seen] = torch.where(values > 0, values / p.repetition_penalty, torch.where(
            values.isneginf(), values, values * p.repetition_penalty))
    if output and (p.frequency_penalty or p.presence_penalty):
        ids, counts = output_ids.unique(return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
