"""The gRPC service `characters.v1.Characters` (deployments/api/proto/characters.proto), served by Serve's gRPC proxy.

Ray Serve 2.60's gRPC proxy carries all four call types, client and bidirectional streaming included
(the replica receives a `ray.serve.grpc_util.gRPCInputStream`; each request message is pulled from
the proxy by one actor call). So every RPC here, the bidirectional `StreamAudio` too, is a method of
the one ingress deployment (`deployments.api.app.CharactersIngress`), next to the HTTP routes, sharing
their `SessionFrontend`. The proxy is set up cluster-wide, at `serve.start` or in the RayService's
`serveConfigV2.grpcOptions`, with `grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS`; it listens on
`[::]:<port>` (Serve has no host option for gRPC), so bind-to-loopback needs a firewall or
network policy there.

Tenancy as over HTTP (`deployments.api.frontend`): a key reads, lists, feeds and ends only its own sessions
(NOT_FOUND for another's), an operator key every one.

Errors become status codes with `<code>: <field>: <message>` details (`deployments.api.errors`); a
RESOURCE_EXHAUSTED reply carries `retry-after` trailing metadata. Field names in details are the proto's.

StreamAudio: the first AudioChunk names the session (`session_id`) and may set `after_seq`; every
chunk may carry `clear` (drop queued audio first) and PCM (s16le, `sample_rate`, `channels`). Events
(SessionEvent) stream back until the session's terminal status event, or until the client cancels;
half-closing the request stream stops audio, not events. A bad chunk ends the call with INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn

from opentelemetry import trace
from pydantic import ValidationError

from deployments import telemetry
from deployments.api.auth import ApiKeys, Caller
from deployments.api.errors import ApiError, ErrorCode, retry_after_header, validation_error
from deployments.api.frontend import SessionFrontend
from deployments.api.proto import characters_pb2 as pb
from deployments.api.schemas import SessionOptions
from deployments.telemetry import names
from deployments.types import Capacity, SessionEvent, SessionInfo, SessionStatus

if TYPE_CHECKING:
    from ray.serve.grpc_util import RayServegRPCContext

GRPC_SERVICER_FUNCTIONS = ("deployments.api.proto.characters_pb2_grpc.add_CharactersServicer_to_server",)

#: HTTP field names (as ApiError.field holds them) -> the proto's field names, for status details.
PROTO_FIELDS = {"maxDuration": "max_duration_s", "avatar.image": "image", "id": "session_id"}

TERMINAL = frozenset(s for s in SessionStatus if s.terminal)
_STATUS = {s: getattr(pb, f"SESSION_STATUS_{s.value}") for s in SessionStatus}
_KIND = {"status": pb.SessionEvent.KIND_STATUS, "chunk": pb.SessionEvent.KIND_CHUNK,
         "playback_started": pb.SessionEvent.KIND_PLAYBACK_STARTED,
         "playback_finished": pb.SessionEvent.KIND_PLAYBACK_FINISHED, "error": pb.SessionEvent.KIND_ERROR}


# ------------------------------------------------------------------------------------------ conversion


def _fields(message: Any, obj: object) -> dict[str, Any]:
    """The attributes of `obj` that `message` has fields for (new fields on either side are skipped)."""
    return {name: getattr(obj, name) for name in message.DESCRIPTOR.fields_by_name if hasattr(obj, name)}


def session_pb(info: SessionInfo) -> pb.Session:
    stats = pb.SessionStats(**_fields(pb.SessionStats, info.stats))
    msg = pb.Session(id=info.id, status=_STATUS[SessionStatus(info.status)], preset=info.preset,
                     reason=info.reason or "", created_at=info.created_at, stats=stats)
    for name in ("started_at", "ended_at", "queue_position", "warm_start"):
        if (value := getattr(info, name)) is not None:
            setattr(msg, name, value)
    return msg


def capacity_pb(cap: Capacity) -> pb.Capacity:
    return pb.Capacity(**_fields(pb.Capacity, cap))


def event_pb(ev: SessionEvent) -> pb.SessionEvent:
    kind = _KIND.get(ev.kind, pb.SessionEvent.KIND_UNSPECIFIED)
    msg = pb.SessionEvent(seq=ev.seq, session_id=ev.session_id, kind=kind, detail=ev.detail or "", at=ev.at)
    if ev.status is not None:
        msg.status = _STATUS[SessionStatus(ev.status)]
    if ev.chunk is not None:
        msg.chunk = ev.chunk
    return msg


def session_options(req: pb.CreateSessionRequest) -> SessionOptions:
    """The proto's create fields -> the same `SessionOptions` the HTTP body validates into."""
    data: dict[str, Any] = {"seed": req.seed if req.HasField("seed") else 0}
    if req.preset:
        data["preset"] = req.preset
    if req.HasField("max_duration_s"):
        data["maxDuration"] = req.max_duration_s
    if req.HasField("output"):
        data["output"] = {"kind": req.output.kind or "null", **({"path": req.output.path} if req.output.path else {})}
    try:
        return SessionOptions.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from e


# ----------------------------------------------------------------------------------------- servicer


@contextmanager
def server_span(method: str, carrier: dict[str, str]) -> Iterator[tuple[Any, dict[str, str]]]:
    """A SERVER span for RPC `method`, child of the caller's metadata context; yields it and the context to
    carry on (the span's own when tracing is on, else the caller's unchanged). Never records the request."""
    tel = telemetry.current()
    if not tel.traces:
        yield trace.INVALID_SPAN, carrier
        return
    span = tel.start_span(names.grpc_span_name(method), telemetry.extract(carrier), kind=trace.SpanKind.SERVER,
                          attributes={names.RPC_SYSTEM: "grpc", names.RPC_SERVICE: "characters.v1.Characters",
                                      names.RPC_METHOD: method})
    try:
        yield span, telemetry.inject(telemetry.context_of(span))
    except BaseException as err:
        telemetry.fail(span, type(err).__name__)
        raise
    finally:
        span.end()


def _refuse(context: RayServegRPCContext, err: ApiError) -> None:
    context.set_code(err.grpc_code)
    context.set_details(err.grpc_details(PROTO_FIELDS))
    if err.retry_after_s is not None:
        context.set_trailing_metadata([("retry-after", str(retry_after_header(err.retry_after_s)))])


class GrpcAbort(Exception):
    """Raised (after the status is set on the context) to end a streaming call with that status."""


def _abort(context: RayServegRPCContext, err: ApiError) -> NoReturn:
    _refuse(context, err)
    raise GrpcAbort(err.grpc_details(PROTO_FIELDS)) from err


class CharactersGrpc:
    """The gRPC methods; mixed into the ingress deployment, which sets `frontend` and `keys`."""

    frontend: SessionFrontend
    keys: ApiKeys

    def _caller(self, context: RayServegRPCContext) -> Caller:
        header = next((v for k, v in context.invocation_metadata() if k == "authorization"), None)
        return self.keys.caller(header if isinstance(header, str) else None)

    async def CreateSession(self, request: pb.CreateSessionRequest, grpc_context: RayServegRPCContext) -> pb.Session:
        caller = {k: v for k, v in grpc_context.invocation_metadata() if k in ("traceparent", "tracestate")}
        with server_span("CreateSession", caller) as (span, carried):
            try:
                who = self._caller(grpc_context)
                info = await self.frontend.create(session_options(request), request.image, who.key_id, carried)
                return session_pb(info)
            except ApiError as err:
                _refuse(grpc_context, err)
                span.set_attribute(names.RPC_GRPC_STATUS, err.grpc_code.value[0])
                return pb.Session()

    async def GetSession(self, request: pb.GetSessionRequest, grpc_context: RayServegRPCContext) -> pb.Session:
        try:
            return session_pb(await self.frontend.get(request.session_id, self._caller(grpc_context)))
        except ApiError as err:
            _refuse(grpc_context, err)
            return pb.Session()

    async def ListSessions(self, request: pb.ListSessionsRequest,
                           grpc_context: RayServegRPCContext) -> pb.ListSessionsResponse:
        try:
            sessions = await self.frontend.list_sessions(self._caller(grpc_context))
            return pb.ListSessionsResponse(sessions=[session_pb(s) for s in sessions])
        except ApiError as err:
            _refuse(grpc_context, err)
            return pb.ListSessionsResponse()

    async def EndSession(self, request: pb.EndSessionRequest, grpc_context: RayServegRPCContext) -> pb.Session:
        try:
            who = self._caller(grpc_context)
            return session_pb(await self.frontend.end(request.session_id, who, request.reason[:200] or "deleted"))
        except ApiError as err:
            _refuse(grpc_context, err)
            return pb.Session()

    async def GetCapacity(self, request: pb.GetCapacityRequest, grpc_context: RayServegRPCContext) -> pb.Capacity:
        try:
            self._caller(grpc_context)
            return capacity_pb(await self.frontend.capacity())
        except ApiError as err:
            _refuse(grpc_context, err)
            return pb.Capacity()

    async def StreamAudio(self, request_stream: AsyncIterator[pb.AudioChunk],
                          grpc_context: RayServegRPCContext) -> AsyncIterator[pb.SessionEvent]:
        try:
            who = self._caller(grpc_context)
            first = await anext(request_stream, None)
            if first is None or not first.session_id:
                raise ApiError(422, ErrorCode.INVALID_FIELD, "the first AudioChunk must name the session",
                               "session_id")
            session_id = first.session_id
            await self.frontend.get(session_id, who)  # NOT_FOUND (unknown, or another tenant's) before anything else
        except ApiError as err:
            _abort(grpc_context, err)
        pump = asyncio.create_task(self._pump_audio(session_id, who, first, request_stream))
        polling: asyncio.Task[list[SessionEvent]] | None = None
        after = first.after_seq
        try:
            while True:
                polling = asyncio.create_task(self.frontend.events(session_id, who, after))
                await asyncio.wait({polling, pump}, return_when=asyncio.FIRST_COMPLETED)
                if pump.done() and not pump.cancelled() and (failure := pump.exception()) is not None:
                    polling.cancel()
                    _abort(grpc_context, failure if isinstance(failure, ApiError) else
                           ApiError(500, ErrorCode.INTERNAL, f"audio stream failed: {type(failure).__name__}"))
                try:
                    events = await polling
                    if not events and (await self.frontend.get(session_id, who)).status in TERMINAL:
                        return  # ended, and its last events are behind after_seq (or no longer kept)
                except ApiError as err:
                    _abort(grpc_context, err)
                for ev in events:
                    after = max(after, ev.seq)
                    yield event_pb(ev)
                    if ev.kind == "status" and ev.status is not None and SessionStatus(ev.status).terminal:
                        return
        finally:  # the client may cancel at any await: reap both tasks (their errors were handled above)
            tasks = [t for t in (pump, polling) if t is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _pump_audio(self, session_id: str, who: Caller, first: pb.AudioChunk,
                          rest: AsyncIterator[pb.AudioChunk]) -> None:
        """Forward chunks to the scheduler until the client half-closes; a bad chunk raises ApiError."""
        chunk: pb.AudioChunk | None = first
        while chunk is not None:
            if chunk.session_id and chunk.session_id != session_id:
                raise ApiError(422, ErrorCode.INVALID_FIELD,
                               f"is {chunk.session_id[:64]!r} but this stream is for session {session_id!r}; "
                               "open one stream per session", "session_id")
            if chunk.clear:
                await self.frontend.clear_audio(session_id, who)
            if chunk.pcm:
                await self.frontend.push_audio(session_id, who, chunk.pcm, chunk.sample_rate, chunk.channels or 1)
            chunk = await anext(rest, None)
