"""Requests: the Serve application (`deployments.api.app:build_app`) and every surface a client calls.

    app          the Serve deployment (HTTP ingress + gRPC), the scheduler actor behind an interface, the one
                 shared actor of avatars and session keys
    http         the native routes (/v1/sessions, /v1/capacity, /healthz), body limit, auth middleware
    runway       the Runway Characters routes (/v1/realtime_sessions, consume) beside them;
    runway_avatars  and /v1/avatars, with the one-time processing of reference images
    avatars      avatar records, their store and response shapes; realtime: the Runway sessions' keys
    watch        the watch page (/watch/) and the routes it calls
    grpc_service the gRPC service characters.v1.Characters (proto/)
    frontend     SessionFrontend: validation, scheduler calls and tenancy every front door shares
    requests     what every route shares: limits (ApiConfig), image decoding, caller identity
    schemas      the native request and response bodies
    auth, errors bearer keys and the tenants they make; one error shape for every refusal

May import `deployments.livekit.config`, `telemetry`, `settings`, `types`, `characters`; the session machinery
only lazily, in `app.connect_scheduler` (the scheduler is an actor: calls go through its handle).
"""
