"""The capacity simulator (`pdserve sim`): a whole cluster in virtual time, its
decisions made by the production scheduler, block manager, router, policy and latency
model, its time by a profile (docs/simulator.md)."""
