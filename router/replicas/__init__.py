"""Several router replicas over one pool, sharing state in Redis (`--redis-url`): the
pool registry and its follower, the request directory, the in-flight load per worker,
the planner's leader lease, and the bounded Redis client under them. Without Redis the
in-process implementations serve one router (docs/replicas.md).

    pool_registry.py      the pool as every replica sees it: its record and each
                          worker's entry; LocalRegistry for one router
    redis_registry.py     RedisRegistry: membership changes published, keys under a TTL
                          the live replicas renew, rebuilt from their views
    follower.py           ReplicaFollower: another replica's changes applied here
                          without redoing them; a dead replica's requests ended
    request_directory.py  which replica holds each request in flight; LocalDirectory
    redis_directory.py    RedisDirectory: a duplicate id refused across replicas, an
                          abort forwarded to the holder
    shared_load.py        in-flight load per worker shared between replicas, summed
                          into WorkerState.others_*: LocalLoad, RedisLoad
    leader_lease.py       which replica's planner acts: SoleLeader, or RedisLease with
                          fencing tokens
    redis_client.py       the Redis client: every call bounded by --redis-timeout-s,
                          retried once only when its connection was closed
"""
