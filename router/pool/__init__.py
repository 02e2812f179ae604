"""The workers a router serves with: live membership (Pool), each worker's handle
(workers), leaving and rejoining service (supervision), KV pairs (pairing), starting
workers (spawner; placement checks that Ray's nodes can hold them), and the one seam
to a worker, WorkerClient, with its Ray implementation."""
