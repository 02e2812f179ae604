"""The SLO planner: how many workers each pool needs (core, pure; demand, its sizing
rule), from the traffic it reads (traffic), carried out against the Pool by the runner."""
