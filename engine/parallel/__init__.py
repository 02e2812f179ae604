"""Tensor parallelism inside one worker: N ranks, one model split N ways.

    sharding.py   pure: which heads, KV heads, intermediate slice and vocabulary rows
                  each rank holds (Megatron-LM's split); the check naming the flag
    group.py      the ranks' process groups: the model's all-reduce and logits
                  gather, rank 0's one broadcast per step
    messages.py   what rank 0 broadcasts: InitKVCache, Forward(StepInputs), Shutdown
    follower.py   a rank other than 0: its runner, computing what rank 0 broadcasts

Rank 0 is the engine (scheduler, sampler, the worker the router talks to); where the
other ranks run is the caller's (worker/ranks.py: Ray actors in one placement group).
"""
