"""The workers a router serves with: live membership (Pool), each worker's handle
(workers), leaving and rejoining service (supervision), KV pairs (pairing), starting
workers (spawner; placement checks that Ray's nodes can hold them), and the one seam
to a worker, WorkerClient, with its Ray implementation.

    pool.py               Pool: membership. add (pending until Ray places it, starting
                          until it answers; `joining` keeps those and the last that
                          failed), join (draining, paired, subscribed, then chosen),
                          drain (running requests moved off live first), resume,
                          set_role (drain, flip, re-pair; weights stay), remove
    workers.py            WorkerHandle: a worker's client, its WorkerState (replaced,
                          never mutated), this router's flights on it, its stream's pump
    supervision.py        a worker's death (out of service, revived once its restart
                          answers), its stall, its eviction and replacement
    pairing.py            who holds a KV pair with whom: paired ahead of traffic, closed
                          on every sender when a decode rendezvous leaves
    spawner.py            Spawner (launch.WorkerSpawner on Ray, SimCluster in the
                          simulator) and Joining, a worker being added
    placement.py          whether the cluster's nodes can hold the workers asked
                          for, and the wait for nodes still joining (until_placeable)
    worker_client.py      WorkerClient, the one seam to a worker: every call the router
                          makes; WorkerDied for a process that could not answer
    ray_worker_client.py  its implementation over a worker actor on Ray, Ray's failures
                          translated at the seam
"""
