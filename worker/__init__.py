"""One worker: a Ray actor hosting one engine in role prefill, decode or both.

    worker.py     Worker: one engine loop, a KV sender and a receiver, and both roles
                  over them (prefill_worker, decode_worker); its role gates which calls
                  it takes and changes once idle, weights loaded; a StepBatch each step
    actor.py      WorkerActor, its Ray async actor: a steps(subscriber) stream per
                  router (its own requests' deltas, everyone's telemetry, reports while
                  idle); a step error it cannot pin on requests ends the process
    core.py       what every worker keeps alike, the Ray one and the simulator's: role
                  gating, each request's owner (subscriber), abort tombstones, the
                  start handshake's rule; pure, on a clock passed in
    ranks.py      a tensor-parallel worker's other ranks: Ray actors in one placement
                  group (a bundle per rank, STRICT_PACK), joined to rank 0's group;
                  RankLink, rank 0's bounded calls on a rank's KV transfers
    rank_kv.py    RankKV: a rank's own KV sender and receiver (its heads); what rank 0
                  tells it to send in a step, expect, abort, copy
    local.py      threaded_worker: a served worker's ranks on threads of one process
                  (tests, debugging)
    streams.py    the subscribers' step streams (each router's own deltas, everyone's
                  telemetry, merged when a subscriber falls behind), for both workers
    messages.py   typed router <-> worker messages, plain data: Reservation, PrefillJob,
                  PrefillResult, TokenDelta, WorkerTelemetry, StepBatch, live
                  migration's BlockCopy and IncomingCopy; ROLES
"""
