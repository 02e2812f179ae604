"""Where a request should run, decided purely: `decide(request, ClusterState, policy)`
over a snapshot of the workers (no I/O, no Ray, no clock). The goodput policy
forecasts TTFT and TPOT with the latency model (latency_forecast, calibrated per
worker by latency_calibration and cluster_models); least-loaded and round-robin are
the baselines.

    decide.py               the one decision point: decide(request, state, policy)
    decision.py             its answers: Colocate, Disaggregate, Reject
    goodput.py              the goodput policy: every placement forecast, and the
                            cheapest that meets the request's SLOs without pushing
                            running requests past theirs chosen (docs/goodput.md)
    least_loaded.py         the least-loaded baseline: no latency model, no SLOs
    round_robin.py          the round-robin baseline: knows nothing of load
    latency_forecast.py     forecasts from a worker's StepCost (engine/latency_model):
                            TTFT behind its queue, TPOT in the batch a request joins
    latency_calibration.py  Calibrator: per worker, metric and placement kind, a bounded
                            moving geometric mean of measured / forecast
    cluster_models.py       what the router learns of its workers: a StepModel,
                            PromptShare and Calibrator per worker, a TransferModel per
                            pair, the prefix index
    prefix_index.py         block hash -> workers, kept from the prefix-cache events
                            in the workers' telemetry
    cluster_state.py        the immutable snapshot: ClusterState of WorkerStates,
                            and the RequestView being placed
    snapshot.py             the pure snapshot builder: worker states, transfer
                            costs, the TPOT budgets of running requests
    worker_columns.py       the snapshot's workers as arrays, and shortlists: a thousand
                            workers scanned in numpy
    budget_rows.py          BudgetRows: the TPOT budgets of a worker's requests in
                            arrays, kept as requests join, leave or are sent tokens
"""
