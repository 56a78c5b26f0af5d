# ruff: noqa
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SessionStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_STATUS_UNSPECIFIED: _ClassVar[SessionStatus]
    SESSION_STATUS_QUEUED: _ClassVar[SessionStatus]
    SESSION_STATUS_STARTING: _ClassVar[SessionStatus]
    SESSION_STATUS_READY: _ClassVar[SessionStatus]
    SESSION_STATUS_RUNNING: _ClassVar[SessionStatus]
    SESSION_STATUS_ENDED: _ClassVar[SessionStatus]
    SESSION_STATUS_FAILED: _ClassVar[SessionStatus]
SESSION_STATUS_UNSPECIFIED: SessionStatus
SESSION_STATUS_QUEUED: SessionStatus
SESSION_STATUS_STARTING: SessionStatus
SESSION_STATUS_READY: SessionStatus
SESSION_STATUS_RUNNING: SessionStatus
SESSION_STATUS_ENDED: SessionStatus
SESSION_STATUS_FAILED: SessionStatus

class Output(_message.Message):
    __slots__ = ("kind", "path")
    KIND_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    kind: str
    path: str
    def __init__(self, kind: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("image", "preset", "max_duration_s", "output", "seed")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    PRESET_FIELD_NUMBER: _ClassVar[int]
    MAX_DURATION_S_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    image: bytes
    preset: str
    max_duration_s: float
    output: Output
    seed: int
    def __init__(self, image: _Optional[bytes] = ..., preset: _Optional[str] = ..., max_duration_s: _Optional[float] = ..., output: _Optional[_Union[Output, _Mapping]] = ..., seed: _Optional[int] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class EndSessionRequest(_message.Message):
    __slots__ = ("session_id", "reason")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    reason: str
    def __init__(self, session_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[Session]
    def __init__(self, sessions: _Optional[_Iterable[_Union[Session, _Mapping]]] = ...) -> None: ...

class GetCapacityRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionStats(_message.Message):
    __slots__ = ("chunks", "frames", "fps", "late_chunks", "step_ms_p50", "step_ms_p95", "audio_queued_s")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    LATE_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_P50_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_P95_FIELD_NUMBER: _ClassVar[int]
    AUDIO_QUEUED_S_FIELD_NUMBER: _ClassVar[int]
    chunks: int
    frames: int
    fps: float
    late_chunks: int
    step_ms_p50: float
    step_ms_p95: float
    audio_queued_s: float
    def __init__(self, chunks: _Optional[int] = ..., frames: _Optional[int] = ..., fps: _Optional[float] = ..., late_chunks: _Optional[int] = ..., step_ms_p50: _Optional[float] = ..., step_ms_p95: _Optional[float] = ..., audio_queued_s: _Optional[float] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("id", "status", "preset", "reason", "created_at", "started_at", "ended_at", "queue_position", "warm_start", "stats")
    ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PRESET_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    WARM_START_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    id: str
    status: SessionStatus
    preset: str
    reason: str
    created_at: float
    started_at: float
    ended_at: float
    queue_position: int
    warm_start: bool
    stats: SessionStats
    def __init__(self, id: _Optional[str] = ..., status: _Optional[_Union[SessionStatus, str]] = ..., preset: _Optional[str] = ..., reason: _Optional[str] = ..., created_at: _Optional[float] = ..., started_at: _Optional[float] = ..., ended_at: _Optional[float] = ..., queue_position: _Optional[int] = ..., warm_start: _Optional[bool] = ..., stats: _Optional[_Union[SessionStats, _Mapping]] = ...) -> None: ...

class Capacity(_message.Message):
    __slots__ = ("bundles_total", "bundles_free", "sessions_running", "queued", "warm_slots_free")
    BUNDLES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BUNDLES_FREE_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    WARM_SLOTS_FREE_FIELD_NUMBER: _ClassVar[int]
    bundles_total: int
    bundles_free: int
    sessions_running: int
    queued: int
    warm_slots_free: int
    def __init__(self, bundles_total: _Optional[int] = ..., bundles_free: _Optional[int] = ..., sessions_running: _Optional[int] = ..., queued: _Optional[int] = ..., warm_slots_free: _Optional[int] = ...) -> None: ...

class AudioChunk(_message.Message):
    __slots__ = ("session_id", "pcm", "sample_rate", "channels", "clear", "after_seq")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PCM_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    CLEAR_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    pcm: bytes
    sample_rate: int
    channels: int
    clear: bool
    after_seq: int
    def __init__(self, session_id: _Optional[str] = ..., pcm: _Optional[bytes] = ..., sample_rate: _Optional[int] = ..., channels: _Optional[int] = ..., clear: _Optional[bool] = ..., after_seq: _Optional[int] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("seq", "session_id", "kind", "status", "chunk", "detail", "at")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[SessionEvent.Kind]
        KIND_STATUS: _ClassVar[SessionEvent.Kind]
        KIND_CHUNK: _ClassVar[SessionEvent.Kind]
        KIND_PLAYBACK_STARTED: _ClassVar[SessionEvent.Kind]
        KIND_PLAYBACK_FINISHED: _ClassVar[SessionEvent.Kind]
        KIND_ERROR: _ClassVar[SessionEvent.Kind]
    KIND_UNSPECIFIED: SessionEvent.Kind
    KIND_STATUS: SessionEvent.Kind
    KIND_CHUNK: SessionEvent.Kind
    KIND_PLAYBACK_STARTED: SessionEvent.Kind
    KIND_PLAYBACK_FINISHED: SessionEvent.Kind
    KIND_ERROR: SessionEvent.Kind
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    session_id: str
    kind: SessionEvent.Kind
    status: SessionStatus
    chunk: int
    detail: str
    at: float
    def __init__(self, seq: _Optional[int] = ..., session_id: _Optional[str] = ..., kind: _Optional[_Union[SessionEvent.Kind, str]] = ..., status: _Optional[_Union[SessionStatus, str]] = ..., chunk: _Optional[int] = ..., detail: _Optional[str] = ..., at: _Optional[float] = ...) -> None: ...
