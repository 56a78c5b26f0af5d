"""The room side: the character as a participant of a LiveKit room, speaking the LiveKit Agents avatar
protocol, and a local server for tests and development. Imports nothing else of `deployments`
but `settings`, `types` and `telemetry`; the Runway-compatible HTTP API is in `deployments.api.runway`.

    LiveKitOutput     the session's output spec (kind "livekit"): url, room, token or API key/secret
    MediaFormat       what is published: resolution, fps, 16 kHz mono audio
    LiveKitRoom       async component: join, publish camera + microphone, pace chunks, avatar protocol
    LiveKitSink       the MediaSink protocol (write/close) over a LiveKitRoom, for synchronous callers
    AgentAudioHandler where agent speech, interruptions and the end of the call go (the session)
    mint_token        a join token (with lk.publish_on_behalf for an agent's avatar)
    LiveKitServer     a local livekit-server (tests, benchmarks, development)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deployments.livekit.config import LiveKitConfigError, LiveKitOutput, MediaFormat, mint_token
    from deployments.livekit.room import AgentAudioHandler, LiveKitRoom, RoomError, RoomStats
    from deployments.livekit.server import LiveKitServer, install_server
    from deployments.livekit.sink import LiveKitSink

# Loaded on first use (PEP 562): the chunk path reads only `config`, and must not pull in LiveKit's
# native client (`livekit.rtc`) with it, e.g. on a GPU host that runs sessions with other outputs.
_WHERE = {"LiveKitConfigError": "config", "LiveKitOutput": "config", "MediaFormat": "config", "mint_token": "config",
          "AgentAudioHandler": "room", "LiveKitRoom": "room", "RoomError": "room", "RoomStats": "room",
          "LiveKitServer": "server", "install_server": "server", "LiveKitSink": "sink"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)


__all__ = [
    "AgentAudioHandler",
    "LiveKitConfigError",
    "LiveKitOutput",
    "LiveKitRoom",
    "LiveKitServer",
    "LiveKitSink",
    "MediaFormat",
    "RoomError",
    "RoomStats",
    "install_server",
    "mint_token",
]
