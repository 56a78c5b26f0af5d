"""Agent audio: one check with one set of limits at every ingress, and the HTTP/gRPC path to the session's own
actor (the scheduler holds audio only until the session runs)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from characters.audio import AGENT_MAX_CHANNELS, AGENT_RATE_RANGE, PcmFormatError, check_agent_pcm
from deployments.api.app import ActorScheduler
from deployments.livekit import protocol
from deployments.settings import ServiceConfig


@pytest.mark.parametrize(("nbytes", "rate", "channels", "field"), [
    (4, 7999, 1, "sample_rate"), (4, 48001, 1, "sample_rate"), (4, 16000, 0, "channels"), (4, 16000, 3, "channels"),
    (3, 16000, 1, "pcm"), (6, 16000, 2, "pcm"),
])
def test_agent_pcm_outside_the_limits_names_the_field(nbytes: int, rate: int, channels: int, field: str) -> None:
    with pytest.raises(PcmFormatError) as err:
        check_agent_pcm(nbytes, rate, channels)
    assert err.value.field == field and str(err.value).startswith(f"{field} is ")


def test_every_ingress_takes_the_same_formats() -> None:
    for rate in (8000, 16000, 24000, 48000):
        for channels in (1, 2):
            check_agent_pcm(4 * channels, rate, channels)
    assert (protocol.RATE_RANGE, protocol.MAX_CHANNELS) == (AGENT_RATE_RANGE, AGENT_MAX_CHANNELS) == ((8000, 48000), 2)
    with pytest.raises(protocol.ProtocolError, match="sample_rate=96000"):
        protocol.stream_format({"sample_rate": "96000", "num_channels": "1"})


class _Method:
    def __init__(self, calls: list[tuple[Any, ...]], name: str) -> None:
        self.calls, self.name = calls, name

    def remote(self, *args: Any) -> Any:
        self.calls.append((self.name, *args))

        async def done() -> float:
            return 0.1

        return done()


class _SessionActor:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.push_audio = _Method(self.calls, "push_audio")


class _Adapter(ActorScheduler):
    """The ingress's scheduler adapter with the scheduler actor's answers scripted (no Ray)."""

    def __init__(self, route: Any) -> None:
        super().__init__(ServiceConfig())
        self.route, self.calls = route, []  # type: ignore[var-annotated]

    async def _call(self, method: str, *args: Any) -> Any:
        self.calls.append((method, *args))
        return self.route if method == "push_audio" else None


def test_audio_goes_to_the_sessions_actor_once_the_scheduler_named_it() -> None:
    actor = _SessionActor()
    adapter = _Adapter(actor)
    pcm = b"\1\0" * 160

    async def go() -> None:
        for _ in range(3):
            await adapter.push_audio("s", pcm, 16000, 1)

    asyncio.run(go())
    assert adapter.calls == [("push_audio", "s", pcm, 16000, 1)]  # the first: it forwards it and names the actor
    assert actor.calls == [("push_audio", "s", pcm, 16000, 1)] * 2  # the rest never touch the scheduler


def test_audio_before_the_session_runs_is_held_by_the_scheduler() -> None:
    adapter = _Adapter(None)

    async def go() -> None:
        for _ in range(2):
            await adapter.push_audio("s", b"\1\0", 16000, 1)

    asyncio.run(go())
    assert adapter.calls == [("push_audio", "s", b"\1\0", 16000, 1)] * 2  # no actor named yet: held there
