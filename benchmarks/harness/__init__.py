"""The goodput load-test harness behind `pdserve bench`: workloads, arrival
processes, per-request metrics and SLO goodput."""
