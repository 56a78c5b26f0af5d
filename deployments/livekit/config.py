"""Where and as whom the character joins LiveKit: `LiveKitOutput` (the session's output spec), token
minting, and `MediaFormat` (what it publishes). No I/O.

`LiveKitOutput` is `OutputSpec`-compatible (`kind`, `path`), frozen and picklable (it travels to the
room worker through Ray). It carries credentials: its repr hides the token and the secret, and nothing
in this package logs them.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from livekit import api

ATTRIBUTE_PUBLISH_ON_BEHALF = "lk.publish_on_behalf"  # livekit.agents.voice.room_io.ATTRIBUTE_PUBLISH_ON_BEHALF
DEFAULT_IDENTITY = "character"
TOKEN_TTL = datetime.timedelta(hours=6)
_IDENTITY = re.compile(r"^[A-Za-z0-9_.:@=+-]{1,128}$")


class LiveKitConfigError(ValueError):
    """A LiveKit output is incomplete or malformed; the message names the field."""


def check_url(url: str, field_name: str = "url") -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss", "http", "https") or not parts.netloc:
        raise LiveKitConfigError(f"{field_name} {url[:120]!r} is not a LiveKit server URL; use ws(s)://host[:port] "
                                 "(or http(s)://, the same server)")
    return url


@dataclass(frozen=True)
class LiveKitOutput:
    """Output kind "livekit": join `room_name` on the server at `url` and publish the character there.

    Credentials: `token` (a LiveKit access token for the character's participant; its identity, name and
    attributes are the token's), or `api_key` + `api_secret` (we mint one for `identity`/`name`, with
    `lk.publish_on_behalf=<agent_identity>` when an agent identity is given). `agent_identity` is the
    LiveKit Agents participant whose speech the character voices (its audio streams are accepted, its
    departure ends the session); None: the first agent participant that sends audio.
    """

    url: str
    room_name: str
    token: str | None = field(default=None, repr=False)
    api_key: str | None = field(default=None, repr=False)
    api_secret: str | None = field(default=None, repr=False)
    identity: str = DEFAULT_IDENTITY
    name: str | None = None
    agent_identity: str | None = None
    kind: Literal["livekit"] = "livekit"
    path: str | None = None  # OutputSpec compatibility: always None

    def __post_init__(self) -> None:
        check_url(self.url)
        if not self.room_name or len(self.room_name) > 256:
            raise LiveKitConfigError("roomName must be 1-256 characters: the LiveKit room to join")
        if self.token is not None:
            if self.api_key is not None or self.api_secret is not None:
                raise LiveKitConfigError("give either token or apiKey + apiSecret, not both")
            if self.token.count(".") != 2:
                raise LiveKitConfigError("token is not a JWT (three dot-separated parts); pass a LiveKit access token")
        elif not (self.api_key and self.api_secret):
            raise LiveKitConfigError("a LiveKit output needs token, or apiKey and apiSecret to mint one")
        for name, value in (("identity", self.identity), ("agentIdentity", self.agent_identity)):
            if value is not None and not _IDENTITY.match(value):
                raise LiveKitConfigError(f"{name} {value[:64]!r} must be 1-128 characters of letters, digits and "
                                         "_ . : @ = + -")

    def join_token(self) -> str:
        """The token to join with: the given one, or one minted from the API key."""
        if self.token is not None:
            return self.token
        assert self.api_key is not None and self.api_secret is not None
        return mint_token(self.api_key, self.api_secret, room=self.room_name, identity=self.identity,
                          name=self.name, agent_identity=self.agent_identity)


def mint_token(api_key: str, api_secret: str, *, room: str, identity: str, name: str | None = None,
               agent_identity: str | None = None, ttl: datetime.timedelta = TOKEN_TTL,
               kind: api.AccessToken.ParticipantKind | None = None) -> str:
    """A join token for `room`: publish camera + microphone, publish data (RPC, streams), subscribe.

    With `agent_identity`, the participant is an agent-kind participant publishing on behalf of that
    agent (attribute `lk.publish_on_behalf`), as LiveKit Agents expects of an avatar worker."""
    token = (api.AccessToken(api_key, api_secret).with_identity(identity).with_name(name or identity).with_ttl(ttl)
             .with_grants(api.VideoGrants(room_join=True, room=room, can_publish=True, can_subscribe=True,
                                          can_publish_data=True)))
    if agent_identity is not None:
        token = token.with_attributes({ATTRIBUTE_PUBLISH_ON_BEHALF: agent_identity})
    kind = kind or ("agent" if agent_identity is not None else None)
    if kind is not None:
        token = token.with_kind(kind)
    return token.to_jwt()


@dataclass(frozen=True)
class MediaFormat:
    """What the room publishes: video at the preset's resolution and fps, mono audio at 16 kHz."""

    width: int
    height: int
    fps: int = 24
    frames_per_chunk: int = 4
    sample_rate: int = 16000
    max_bitrate: int = 1_500_000  # bits/s of the one (non-simulcast) video layer

    def __post_init__(self) -> None:
        if self.width < 16 or self.height < 16 or self.width % 2 or self.height % 2:
            raise LiveKitConfigError(f"video {self.width}x{self.height} must be even and at least 16x16")
        if self.sample_rate != 16000:
            raise LiveKitConfigError(f"sample_rate {self.sample_rate} must be 16000 Hz, the chunks' audio rate "
                                     "(WebRTC's Opus encoder resamples it)")
