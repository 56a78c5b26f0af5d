"""LiveKit output: the character as a participant of a LiveKit room, speaking the LiveKit Agents
avatar protocol, plus the Runway-compatible API's request shapes and a local server for tests.

    LiveKitOutput     the session's output spec (kind "livekit"): url, room, token or API key/secret
    MediaFormat       what is published: resolution, fps, 16 kHz mono audio
    LiveKitRoom       async component: join, publish camera + microphone, pace chunks, avatar protocol
    LiveKitSink       the MediaSink protocol (write/close) over a LiveKitRoom, for synchronous callers
    AgentAudioHandler where agent speech, interruptions and the end of the call go (the session)
    mint_token        a join token (with lk.publish_on_behalf for an agent's avatar)
    LiveKitServer     a local livekit-server (tests, benchmarks, development)
"""

from deployments.livekit.config import LiveKitConfigError, LiveKitOutput, MediaFormat, mint_token
from deployments.livekit.room import AgentAudioHandler, LiveKitRoom, RoomError, RoomStats
from deployments.livekit.server import LiveKitServer, install_server
from deployments.livekit.sink import LiveKitSink

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
