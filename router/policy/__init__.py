"""Where a request should run, decided purely: `decide(request, ClusterState, policy)`
over a snapshot of the workers (no I/O, no Ray, no clock). The goodput policy
forecasts TTFT and TPOT with the latency model (latency_forecast, calibrated per
worker by latency_calibration and cluster_models); least-loaded and round-robin are
the baselines. The snapshot's parts: cluster_state, snapshot, worker_columns,
budget_rows, prefix_index."""
