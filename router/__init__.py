"""The router: the front door of a cluster. It validates and tokenizes each request,
decides where it runs (colocated on one worker, or a (prefill, decode) pair), drives
it through the workers and streams its tokens back. Router (router.py) composes the
parts below; the clock is passed in (the system's, or the simulator's virtual time).

The request path, at the top:
    router.py           Router: the composition, shared by the gRPC and HTTP front ends
    intake.py           validation and tokenization (400 naming the field)
    lifecycle.py        a request's phases and what each holds (Flight); `until`, a call
                        bounded by a timeout and by the request's abort
    request_runner.py   a request's flight through its phases, every worker call
                        bounded, released once; migration by replay (--migration-limit)
    placer.py           the policy's decision on a snapshot of now
    capacity_queue.py   the wait for capacity: deadline, then priority, then arrival
    live_move.py        live migration: a draining worker's running requests moved to
                        other decode-capable workers with their KV while they decode
    request_metrics.py  one request's metrics as it streams, its SLO attainment and
                        forecast error at its end
    slo.py              a request's SLOs (TTFT, TPOT); unset is best effort
    clock.py            the clocks: the system's, or the event loop's virtual time
    launch.py           Ray: WorkerSpawner, launch (the workers as actors and a Router
                        over them), join (another replica over a registered pool)
    config.py           RouterConfig (timeouts and limits), RoutingSpec, PoolSpec,
                        AutoscaleSpec, SharedStateSpec, TLSConfig
    model_info.py       what the router knows of the served model
    errors.py           router-level failures and the status each maps to
    metrics.py          Prometheus metrics under vLLM's names

The rooms:
    front/      the front ends: OpenAI HTTP, gRPC, the admin API, API keys, RouterServer
    policy/     where a request runs, decided purely: decide, the goodput policy and its
                forecasts, the baselines, the snapshot they read
    pool/       the workers: membership, supervision, KV pairing, spawning; the
                WorkerClient seam to them (Ray, or simulated)
    replicas/   what router replicas over one pool share (Redis, with --redis-url)
    planner/    the SLO planner, with --autoscale
"""
