"""The capacity simulator (`pdserve sim`): a whole cluster in virtual time, its
decisions made by the production scheduler, block manager, router, policy and latency
model, its time by a profile (docs/simulator.md).

    cli.py            `pdserve sim` and `pdserve sim plan`: serve's pool, routing and
                      engine flags, bench's workload, arrival and SLO flags
    run.py            one simulated run, or a sweep of rates, each on a fresh cluster
    plan.py           `pdserve sim plan`: every pool shape of a worker budget, each
                      searched for its highest rate meeting the attainment target
                      (--jobs shapes in processes of their own)
    cluster.py        SimCluster: serve's pools as SimWorkers, the production Router
                      over them
    worker.py         SimWorker: the WorkerClient seam in virtual time over the
                      production Scheduler and BlockManager; steady batches run many
                      steps at a time
    moves.py          live migration's calls on a simulated worker
    tokens.py         where sampled tokens come from: synthetic, or the real model's
    driver.py         a bench workload sent to the router at its arrival times (a
                      session's later turns as the ones before end)
    itl.py            ItlHistogram: inter-token gaps counted where the workers make them
    virtual_time.py   VirtualTimeLoop, whose clock jumps to the next timer; LoopClock,
                      the router's clock on it; sim_collector, the GC's thresholds
    profile.py        Profile: step and transfer costs, KV size, start-up; its JSON
    measure.py        `pdserve profile`: a profile measured on this machine
    analytic.py       a profile computed for a named accelerator and model config (a
                      roofline fitted with the router's own StepModel)
"""
