"""The serving layer: Ray actors and the Serve application over `characters/` (the model) and `placement/`
(bundle math and the admission policy). Where things go:

    api/        a request: the Serve application and every HTTP / gRPC surface (native API, Runway-compatible
                API, watch page, auth, errors, proto); validates into a SessionSpec and calls the scheduler
    sessions/   a session: the scheduler (admission applied, slots and their lifecycle, recovery, adopting
                after a restart), the slot's SessionActor and the session's chunk loop, the local cluster
    pipeline/   a chunk: the compiled graph DiT ranks -> decoder -> room, the workers, the latent handoff
    livekit/    the room side: a character in a LiveKit room, the avatar protocol, a local dev server
    telemetry/  OpenTelemetry spans and metrics of all of the above (names in one module)
    cli/        the `characters` command (`characters serve` runs all of it locally)
    settings    every environment variable, declared once; the service config
    types       the types the others share (SessionSpec, SessionInfo, Capacity, refusals)

Imports go one way: cli -> api -> sessions -> pipeline -> livekit, and every part may use telemetry, settings
and types; api reaches sessions only through the scheduler actor's handle (`deployments.api.app`).
`tests/unit/test_architecture.py` holds these rules. docs/architecture.md follows a request, a session
and a chunk through these folders.
"""
