"""Several router replicas over one pool, sharing state in Redis (`--redis-url`): the
pool registry and its follower, the request directory, the in-flight load per worker,
the planner's leader lease, and the bounded Redis client under them. Without Redis the
in-process implementations serve one router."""
