"""Requests: the Serve application (`deployments.api.app:build_app`) and every surface a client calls.

    app          the Serve deployment (HTTP ingress + gRPC), the scheduler actor behind an interface
    http         the native routes (/v1/sessions, /v1/capacity, /healthz), body limit, auth middleware
    runway       the Runway-compatible routes (/v1/realtime_sessions, /v1/avatars) beside them
    watch        the watch page (/watch/) and the routes it calls
    grpc_service the gRPC service characters.v1.Characters (proto/)
    frontend     SessionFrontend: validation and scheduler calls every front door shares
    requests     what every route shares: limits (ApiConfig), image decoding, caller identity
    schemas      the native request and response bodies; avatars: registered reference images
    auth, errors bearer keys; one error shape for every refusal

May import `deployments.livekit.config`, `telemetry`, `settings`, `types`, `characters`; the session machinery
only lazily, in `app.connect_scheduler` (the scheduler is an actor: calls go through its handle).
"""
