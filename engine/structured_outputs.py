"""Structured outputs: a request's output held to a JSON schema, any JSON object, a
regular expression, a choice of strings or an EBNF grammar (StructuredOutputsParams),
by masking every token the constraint forbids before sampling. xgrammar (what vLLM
and SGLang use) compiles the constraint against the tokenizer's vocabulary and tracks
each request's state (a GrammarMatcher).

The state belongs to the tokens, not to a worker: `Grammars.sync` brings a request's
matcher up to its output tokens however it got them (a prefill worker's first token
on the decode worker, a replayed or live-migrated request's outputs, a stop string
taking tokens back), so a request that moves mid-stream goes on constrained from
where it is. Speculative drafts are checked against the state and rolled back
(`verify_masks`).

`check` validates a constraint without a tokenizer (the router's 400 naming the
field); `Grammars.compile` compiles it for this worker's vocabulary, cached."""
from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:  # torch and xgrammar are imported by the worker that masks, not the router
    import torch

    from pdserve.engine.tokenizer import Tokenizer

# Compiled grammars kept per worker (xgrammar's own cache, by the constraint's text).
CACHE_LIMIT_BYTES = 256 << 20


class GrammarViolation(ValueError):
    """A request's tokens left its grammar: its own failure, never the step's."""


def choice_grammar(choice: Sequence[str]) -> str:
    """The EBNF for exactly one of the strings (vLLM's, quotes and backslashes
    escaped)."""
    return "root ::= " + " | ".join(
        '"' + re.sub(r'(["\\])', r"\\\1", c).replace("\n", "\\n") + '"' for c in choice)


def check(params: StructuredOutputsParams, field: str = "structured_outputs") -> None:
    """Raises InvalidRequestError naming `field` when the constraint cannot be
    compiled (a schema xgrammar does not take, a bad regex or grammar). Needs no
    tokenizer: the router calls it before placing the request."""
    import xgrammar as xgr

    try:
        kind = params.kind
        if kind == "json":
            schema = json.loads(params.json)
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema is an object (or a boolean)")
            xgr.Grammar.from_json_schema(params.json,
                                         any_whitespace=not params.disable_any_whitespace)
        elif kind == "regex":
            xgr.Grammar.from_regex(params.regex)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_grammar(params.choice))
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(params.grammar)
    except (ValueError, RuntimeError, RecursionError) as err:
        raise InvalidRequestError(field, f"cannot be compiled: {_reason(err)}") from None


def _reason(err: Exception) -> str:
    """xgrammar's message without its source location ("[time] file.cc:line: ")."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text)[:300]


class Grammars:
    """One worker's compiled constraints and its requests' matchers. The tokenizer
    info is built at the first structured request (xgrammar imports torch and
    transformers: a worker serving none pays nothing)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._compiler = None
        self._lock = threading.Lock()  # requests are added from other threads
        # request id -> [matcher, output tokens seen, of those accepted]
        self._matchers: dict[str, list] = {}
        # The batch's bitmask and a verification's (kept between steps).
        self._batch_bitmask: torch.Tensor | None = None
        self._verify_bitmask: torch.Tensor | None = None

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar (cached by the compiler: the same constraint again costs
        a lookup), or InvalidRequestError naming structured_outputs. Thread-safe; the
        first call builds the vocabulary's tokenizer info (about a second for a 150k
        vocabulary), a new schema takes milliseconds: workers call it off the engine's
        thread and state lock first (LLMEngine.prepare)."""
        compiler = self._get_compiler()
        try:
            kind = params.kind
            if kind == "json":
                return compiler.compile_json_schema(
                    params.json, any_whitespace=not params.disable_any_whitespace)
            if kind == "json_object":  # vLLM's: any object
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=not params.disable_any_whitespace)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(params.choice))
            return compiler.compile_grammar(params.grammar)
        except (ValueError, RuntimeError) as err:
            raise InvalidRequestError("structured_outputs",
                                      f"cannot be compiled: {_reason(err)}") from None

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                # xgrammar's own reading of an HF fast tokenizer (vocabulary type,
                # prefix space), the same as its HF logits processor's.
                hf = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer.backend)
                info = xgr.TokenizerInfo.from_huggingface(
                    hf, vocab_size=self._vocab_size,
                    stop_token_ids=self._stop_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, cache_limit_bytes=CACHE_LIMIT_BYTES)
            return self._compiler

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def sync(self, request: Request):
        """The request's matcher, having accepted exactly its output tokens so far
        (those past the grammar's end, after an ignored eos, are not fed to it)."""
        import xgrammar as xgr

        state = self._matchers.get(request.request_id)
        if state is None:
            matcher = xgr.GrammarMatcher(self.compile(request.sampling_params.structured_outputs))
            # [matcher, output tokens seen, of those accepted (the rest past its end)]
            state = self._matchers[request.request_id] = [matcher, 0, 0]
        matcher, seen, accepted = state
        output = request.output_token_ids
        if seen > len(output):  # tokens taken back (a stop string inside a run)
            undo = max(accepted - len(output), 0)
            if undo:
                matcher.rollback(undo)
            seen, accepted = len(output), accepted - undo
        for token in output[seen:]:
            if matcher.is_terminated():
                break  # past the grammar's end (eos ignored): nothing more to follow
            if not matcher.accept_token(token):
                del self._matchers[request.request_id]
                raise GrammarViolation(f"output token {token} breaks the request's "
                                       "structured_outputs constraint")
            accepted += 1
        state[1], state[2] = len(output), accepted
        return matcher

    def fill(self, rows: list[int], requests: list[Request], num_rows: int) -> torch.Tensor:
        """The next-token bitmask of a batch of num_rows logits rows: row rows[j] for
        requests[j]'s constraint (the other rows unset). Host work on the tokens the
        requests have so far: on a GPU it runs while the step's kernels do (the
        sampler fills it before its first wait for the device)."""
        bitmask = self._batch_bitmask = _grown(self._batch_bitmask, num_rows, self._vocab_size)
        for row, request in zip(rows, requests):
            matcher = self.sync(request)
            if matcher.is_terminated():
                bitmask[row].fill_(-1)  # done: eos (or what follows an ignored eos) free
            else:
                matcher.fill_next_token_bitmask(bitmask, row)
        return bitmask[:num_rows]

    def mask(self, logits: torch.Tensor, rows: list[int], requests: list[Request]) -> None:
        """In place: each of `rows` of logits gets -inf for the tokens its request's
        constraint forbids next (one batched bitmask, its rows the logits')."""
        self._apply(logits, self.fill(rows, requests, logits.shape[0]), rows)

    def verify_masks(self, logits: torch.Tensor, request: Request, drafts: list[int]) -> None:
        """In place on a verification's rows (row j after drafts[:j]): each masked by
        the state after the drafts before it. The matcher walks the drafts and is rolled
        back to the request's outputs; rows after a draft the grammar refuses are left
        as they are (the draft is rejected there, so they are never sampled)."""
        bitmask = self._verify_bitmask = _grown(self._verify_bitmask, len(drafts) + 1,
                                                self._vocab_size)
        bitmask[:len(drafts) + 1].fill_(-1)
        matcher = self.sync(request)
        walked = 0
        for j in range(len(drafts) + 1):
            if matcher.is_terminated():
                break
            matcher.fill_next_token_bitmask(bitmask, j)
            if j == len(drafts) or not matcher.accept_token(drafts[j]):
                break
            walked += 1
        if walked:
            matcher.rollback(walked)
        self._apply(logits, bitmask[:len(drafts) + 1], list(range(len(drafts) + 1)))

    def _apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        import xgrammar as xgr

        if logits.device.type == "cpu":
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self._vocab_size,
                                            indices=rows)
        else:
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                            vocab_size=self._vocab_size, indices=rows)


def _grown(bitmask: torch.Tensor | None, rows: int, vocab_size: int) -> torch.Tensor:
    """A bitmask buffer of at least `rows` rows (kept between steps)."""
    import xgrammar as xgr

    if bitmask is None or bitmask.shape[0] < rows:
        bitmask = xgr.allocate_token_bitmask(max(rows, 8), vocab_size)
    return bitmask
