"""Chunks: the path of one chunk through a slot, DiT ranks -> decoder -> room, as a Ray Compiled Graph.

    graph      the compiled graph over a slot's workers (or plain actor calls): `Pipeline`
    loop       the chunk loop: ask the policy (`characters.chunk_policy`), submit, collect, report
    workers    DiTWorker (one per tensor-parallel rank) and DecoderWorker
    messages   what a chunk travels in: ChunkInput, the DiT's acks and latents, Frames, ChunkReport
    output     RoomWorker: paced playout of frames + audio into the session's output (`room`: its former name)
    handoff    the latent handoff between DiT and decoder (the only module that sends or receives latents)

May import `deployments.livekit`, `telemetry`, `settings`, `types`, `characters`; never `sessions` or `api`.
"""
