"""Removed from the room through the server API is the agent ending the call: LiveKit Agents'
`AvatarSession.aclose()` removes the avatar right after sending END_CALL, and the removal may arrive first.
Either way the character's room ends the session with reason `end_call` (a real LiveKit server)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from livekit import api, rtc
from lk_helpers import FakeSession, H, W, token

from deployments.livekit import LiveKitOutput, LiveKitRoom, LiveKitServer, MediaFormat

pytestmark = [pytest.mark.livekit, pytest.mark.filterwarnings("ignore::jwt.warnings.InsecureKeyLengthWarning")]


@pytest.mark.parametrize("order", ["removed_only", "end_call_then_removed"])
def test_removal_by_the_server_api_ends_the_call(livekit_server: LiveKitServer, order: str) -> None:
    room_name = f"removed-{order}"

    async def main() -> tuple[str | None, list[str], float]:
        session = FakeSession()
        out = LiveKitOutput(url=livekit_server.url, room_name=room_name, api_key=livekit_server.api_key,
                            api_secret=livekit_server.api_secret, identity="character", agent_identity="agent")
        room = LiveKitRoom(out, MediaFormat(W, H), session)
        agent = rtc.Room()
        await agent.connect(livekit_server.url, token(livekit_server, room_name, "agent", kind="agent"))
        await room.start()
        try:
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            if order == "end_call_then_removed":
                await agent.local_participant.publish_data(json.dumps({"type": "END_CALL"}).encode(), reliable=True,
                                                           destination_identities=["character"])
            async with api.LiveKitAPI(livekit_server.url.replace("ws://", "http://"), livekit_server.api_key,
                                      livekit_server.api_secret) as lk:
                await lk.room.remove_participant(api.RoomParticipantIdentity(room=room_name, identity="character"))
            await asyncio.wait_for(room.ended.wait(), 5)
            return room.end_reason, session.ended, time.monotonic() - t0
        finally:
            await room.aclose()
            await agent.disconnect()

    reason, ended, took = asyncio.run(main())
    assert reason == "end_call" and ended == ["end_call"], (reason, ended)
    assert took < 3.0
