"""Sessions: admission applied, slots, and one session's life from QUEUED to ENDED or FAILED.

    scheduler   SessionScheduler, the named actor the API calls: sessions, queue, decisions
                (`placement.policy` decides; the scheduler applies)
    pool        SlotManager: the lifecycle of the scheduler's slots (build, warm-up, reset, destroy, adopt)
                and the warm pool's books
    slot        one slot's Ray side: reserve its placement group, create and warm its workers, reset, ping
    adoption    what a restarted scheduler finds on the cluster and adopts
    membership  the nodes as the scheduler sees them: live, draining or lost (the GCS's table, its own probes)
    actor       SessionActor: the slot's driver, starts its sessions one after another
    runner      SessionRunner and the plain classes of one session's chunk loop (audio, stats, outcome)
    recovery    resuming a session on a fresh bundle
    cluster     local Ray clusters on loopback: one node (CLI, tests, benchmarks), or a head and worker nodes
                (`LoopbackCluster`: multi-node tests, the soak)

Agent audio from HTTP/gRPC goes from the ingress to the session's own actor; the scheduler holds it only
until the session runs. `slots` and `ledger` are former names of `pool` and `adoption` (one release).

May import `deployments.pipeline`, `telemetry`, `settings`, `types`, `placement`, `characters`; never `api`.
"""
