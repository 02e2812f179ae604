"""The SLO planner: how many workers each pool needs (core, pure; demand, its sizing
rule), from the traffic it reads (traffic), carried out against the Pool by the runner.

    core.py      plan(observation, state, config) -> Plan, pure: per pool short, spare
                 and demand; grown at the SLO, shrunk at margin x SLO; flips before
                 adds; bounds held at every tick; each action with its cause
    demand.py    the workers a pool needs for an arrival rate, from its slowest warm
                 worker's step cost and the traffic's ISL and OSL (and decodes' KV)
    traffic.py   TrafficWindow: arrivals (refused ones included), their trend and
                 period, ISL, OSL, and each pool's recent SLO attainment
    runner.py    PlannerRunner: the planner every interval, its actions carried out
                 through the Pool while this router leads (fencing token checked);
                 decisions logged and kept for `pdserve admin planner`
"""
