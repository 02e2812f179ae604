"""Offline batch inference: `LLM(model=...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import itertools
from dataclasses import replace

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.request import choice_id
from pdserve.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str = "tiny", **engine_args):
        """tensor_parallel_size > 1: the other ranks start as Ray actors in a placement
        group on this node (Ray is started here if it is not); shutdown() ends them."""
        self.engine, self._ranks = start_engine(EngineConfig.from_kwargs(model, **engine_args))
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Ends the other tensor-parallel ranks and their placement group (idempotent)."""
        engine, ranks, self._ranks = self.engine, self._ranks, None
        if ranks is not None:
            stop_engine(engine, ranks)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs in prompt order. A prompt is a
        string or a list of token ids. Invalid input raises before anything runs. A
        prompt sampled with n > 1 gives its n choices in turn (one prefill: they share
        its KV; choice i of a seeded one draws with seed + i)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = (sampling_params if isinstance(sampling_params, list)
                  else [sampling_params or SamplingParams()] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError("sampling_params must be one, or one per prompt")
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        added = []
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(rid, prompt, p)
                added.append(rid)
        except Exception:
            self.engine.abort(added)
            while self.engine.has_unfinished():
                self.engine.step()
            raise
        done: dict[str, RequestOutput] = {}
        asked = set(ids)
        progress = _progress(len(ids)) if use_tqdm else None
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    if progress and out.request_id in asked:
                        progress.update(1)
        if progress:
            progress.close()
        # (a request that failed before its first token forked no choices: each is it)
        return [done.get(choice_id(rid, i), done[rid])
                for rid, p in zip(ids, params) for i in range(p.n)]


def start_engine(config: EngineConfig):
    """An engine and, at tensor_parallel_size > 1, its other ranks (worker/ranks.py:
    Ray actors in a placement group; Ray is started here if it is not), or None."""
    if config.tensor_parallel_size == 1:
        return LLMEngine(config), None
    import ray

    from pdserve.worker.ranks import start_ranks
    if not ray.is_initialized():
        ray.init()
    ranks = start_ranks(config)
    try:
        return LLMEngine(replace(config, device=ranks.device), ranks.group), ranks
    except BaseException:
        ranks.shutdown()
        raise


def stop_engine(engine: LLMEngine | None, ranks) -> None:
    """Ends an engine's other ranks and their placement group, even if its close
    fails."""
    try:
        if engine is not None:
            engine.close()
    finally:
        if ranks is not None:
            ranks.shutdown()


def _progress(total: int):
    from pdserve.progress import bar
    return bar(total, "generate", "req")
