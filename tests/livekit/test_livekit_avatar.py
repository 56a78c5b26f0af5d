"""The LiveKit Agents avatar protocol against the real agent-side code (`DataStreamAudioOutput`), on a real
server: speech reaches the session, playback is reported, clear_buffer interrupts, the room leaves."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import numpy as np
import pytest
from livekit import rtc
from livekit.agents.voice.avatar import DataStreamAudioOutput
from lk_helpers import CHUNK_S, SR, FakeSession, Generator, H, Viewer, W, speech_heard, token

from characters.audio import SAMPLE_AUDIO, load_audio
from characters.pacing import SegmentEvent, to_int16
from deployments.livekit import LiveKitOutput, LiveKitRoom, LiveKitServer, MediaFormat

pytestmark = [pytest.mark.livekit, pytest.mark.filterwarnings("ignore::jwt.warnings.InsecureKeyLengthWarning")]

AVATAR, AGENT = "character", "agent"
DEPTH = 2  # chunks the stand-in generator keeps in flight
SPEECH = to_int16(load_audio(SAMPLE_AUDIO))  # 9.6 s, a quarter of it exact zeros (pauses)


class Call:
    """An avatar room, the stand-in chunk loop and an agent participant with the real DataStreamAudioOutput."""

    def __init__(self, server: LiveKitServer, name: str, **room_kw: Any) -> None:
        self.server, self.name = server, name
        self.session = FakeSession()
        out = LiveKitOutput(url=server.url, room_name=name, api_key=server.api_key, api_secret=server.api_secret,
                            identity=AVATAR, agent_identity=AGENT)
        self.room = LiveKitRoom(out, MediaFormat(W, H), self.session, **room_kw)
        self.gen = Generator(self.room, self.session, depth=DEPTH)
        self.agent = rtc.Room()
        self.output: DataStreamAudioOutput | None = None
        self.started: list[float] = []

    async def __aenter__(self) -> Call:
        await self.agent.connect(self.server.url, token(self.server, self.name, AGENT, kind="agent"))
        await self.room.start()
        await self.gen.start()
        self.output = DataStreamAudioOutput(self.agent, destination_identity=AVATAR, sample_rate=SR,
                                            wait_remote_track=rtc.TrackKind.KIND_VIDEO, wait_playback_start=True)
        self.output.on("playback_started", lambda ev: self.started.append(time.monotonic()))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.gen.aclose()
        await self.room.aclose()
        await self.agent.disconnect()

    async def say(self, pcm: np.ndarray, flush: bool = True) -> None:
        assert self.output is not None
        for i in range(0, pcm.size, 320):  # 20 ms frames, as fast as the output takes them (TTS does too)
            piece = pcm[i:i + 320]
            await self.output.capture_frame(rtc.AudioFrame(piece.tobytes(), SR, 1, piece.size))
        if flush:
            self.output.flush()


def nudged(pcm: np.ndarray) -> np.ndarray:
    out = pcm.copy()
    out[out == 0] = 1
    return out


def test_agent_speech_reaches_the_session_and_playback_finishes(livekit_server: LiveKitServer) -> None:
    async def main() -> None:
        async with Call(livekit_server, "speech") as call:
            speech = SPEECH[: 3 * SR]
            t_send = time.monotonic()
            await call.say(speech)
            assert call.output is not None
            ev = await asyncio.wait_for(call.output.wait_for_playout(), 15)
            t_done = time.monotonic()
            stats = call.room.stats()
        got = np.frombuffer(b"".join(call.session.received), np.int16)
        assert np.array_equal(got, nudged(speech)), "the session gets the agent's PCM (exact zeros nudged to 1)"
        assert not ev.interrupted
        assert ev.playback_position == pytest.approx(speech.size / SR, abs=1e-3)
        assert len(call.started) == 1 and t_send < call.started[0] < t_done
        # the first frame made from the speech plays after the generator's latency (DEPTH chunks after the
        # chunk that took it) plus the jitter buffer (one chunk); the segment finishes 3 s later
        first = call.started[0] - t_send
        print(f"speech sent -> playback_started {first:.3f} s; -> playback_finished {t_done - t_send:.3f} s")
        assert first < (DEPTH + 3) * CHUNK_S + 0.3
        assert 3.0 <= t_done - t_send < 3.0 + (DEPTH + 3) * CHUNK_S + 0.5
        assert stats.segments == 1 and stats.speech_s == pytest.approx(3.0)
        assert stats.playout.lost_speech_samples == 0 and stats.playout.late_chunks == 0

    asyncio.run(main())


def test_back_to_back_segments_arrive_whole_and_finish_in_order(livekit_server: LiveKitServer) -> None:
    async def main() -> None:
        async with Call(livekit_server, "segments") as call:
            assert call.output is not None
            finished: list[Any] = []
            call.output.on("playback_finished", finished.append)
            a, b = SPEECH[SR: 2 * SR], SPEECH[3 * SR: 4 * SR]
            await call.say(a)
            await call.say(b)  # the next stream starts while the first is still being read
            await asyncio.wait_for(call.output.wait_for_playout(), 15)
            stats = call.room.stats()
        got = np.frombuffer(b"".join(call.session.received), np.int16)
        assert np.array_equal(got, nudged(np.concatenate([a, b])))
        assert [round(e.playback_position, 3) for e in finished] == [1.0, 1.0]
        assert not any(e.interrupted for e in finished) and stats.segments == 2

    asyncio.run(main())


def test_clear_buffer_interrupts_and_the_next_segment_plays_in_full(livekit_server: LiveKitServer) -> None:
    events: list[tuple[float, SegmentEvent]] = []  # (wall clock heard, event)

    async def main() -> None:
        async with Call(livekit_server, "clear", on_playback=lambda e: events.append((time.time(), e))) as call:
            viewer = Viewer(livekit_server, "clear")
            await viewer.start()
            assert call.output is not None
            await call.say(SPEECH[: 8 * SR])  # the whole 8 s segment is sent (faster than real time) and closed
            while not call.started:
                await asyncio.sleep(0.01)
            await asyncio.sleep(2.0)
            t_clear, wall_clear = time.monotonic(), time.time()
            call.output.clear_buffer()
            ev = await asyncio.wait_for(call.output.wait_for_playout(), 5)
            t_finished = time.monotonic()
            queued_after = call.session.queued
            await asyncio.sleep(1.5)
            stats = call.room.stats()
            # the agent speaks again after the interruption
            await call.say(SPEECH[SR: 2 * SR])
            ev2 = await asyncio.wait_for(call.output.wait_for_playout(), 10)
            await viewer.aclose()
        # playback_position is what the viewer heard, wherever this machine's speed put the clear: the speech
        # the viewer's own audio carries up to the cut, within a couple of frames (Opus frames are 20 ms)
        assert ev.interrupted and 0.5 < ev.playback_position < 8.0
        heard = np.concatenate([a for _, a in viewer.audio])
        heard_s, missing_s = speech_heard(heard, SPEECH[: 8 * SR])
        assert heard_s - 0.1 <= ev.playback_position <= missing_s + 0.1, (heard_s, ev.playback_position, missing_s)
        assert t_finished - t_clear < 2.0, "playback_finished answers the clear before the agent gives up (2 s)"
        assert len(call.session.clears) == 1 and call.session.clears[0][1] > 3 * SR and queued_after == 0
        idle, still = stats.playout.idle_after_clear_s, stats.playout.still_after_clear_s
        assert idle is not None and idle < (DEPTH + 2) * CHUNK_S + 0.1  # in-flight chunks + the jitter buffer
        assert still is not None and still < 0.1  # the next frame shows the character at rest (one frame: 42 ms)
        # what the viewer hears: the speech stops, silence follows (the audio source's queue was flushed)
        after = viewer.rms(t_clear + 0.5, t_clear + 1.5)
        before = viewer.rms(t_clear - 1.5, t_clear)
        assert max(after) < 0.01 < max(before)
        assert not ev2.interrupted and ev2.playback_position == pytest.approx(1.0, abs=1e-3)
        # the interrupted segment's finish is dated when the clear reached the room (the session's event says so)
        (at, done), = [(t, e) for t, e in events if e.kind == "finished" and e.interrupted]
        assert done.at is not None and wall_clear <= done.at <= at
        assert all(e.at is None for _, e in events if not e.interrupted)
        print(f"clear -> playback_finished {t_finished - t_clear:.3f} s, -> at rest {still:.3f} s, "
              f"-> first new idle frame {idle:.3f} s; position {ev.playback_position:.3f} s, the viewer heard "
              f"{heard_s:.2f} s (next voiced {missing_s:.2f} s)")

    asyncio.run(main())


@pytest.mark.parametrize("how", ["end_call", "agent_left", "max_duration"])
def test_room_leaves_and_ends_the_session(livekit_server: LiveKitServer, how: str) -> None:
    async def main() -> None:
        async with Call(livekit_server, f"leave-{how}", max_duration_s=2.0 if how == "max_duration" else None) \
                as call:
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            if how == "end_call":
                await call.agent.local_participant.publish_data(json.dumps({"type": "END_CALL"}).encode(),
                                                                reliable=True, destination_identities=[AVATAR])
            elif how == "agent_left":
                await call.agent.disconnect()
            await asyncio.wait_for(call.room.ended.wait(), 5)
            waited = time.monotonic() - t0
            await asyncio.sleep(0.5)
            gone = AVATAR not in call.agent.remote_participants if how != "agent_left" else True
        assert call.room.end_reason == how and call.session.ended == [how]
        assert gone, "the character left the room"
        # the server announces a departure about 2 s after the client left
        assert waited < {"end_call": 1.0, "agent_left": 4.0, "max_duration": 3.0}[how]

    asyncio.run(main())


def test_leaving_waits_for_the_agents_answer_to_a_queued_notification(livekit_server: LiveKitServer) -> None:
    """A playback notification on its way when the character leaves is answered before it disconnects (one
    cancelled while it waited left its answer to arrive for a request nobody held: the SDK's
    'Ack received for unexpected RPC request' at every session end)."""
    async def main() -> None:
        answered: list[float] = []

        async def slow_answer(data: rtc.RpcInvocationData) -> str:
            await asyncio.sleep(0.4)
            answered.append(time.monotonic())
            return ""

        agent = rtc.Room()
        await agent.connect(livekit_server.url, token(livekit_server, "drain", AGENT, kind="agent"))
        agent.local_participant.register_rpc_method("lk.playback_finished", slow_answer)
        out = LiveKitOutput(url=livekit_server.url, room_name="drain", api_key=livekit_server.api_key,
                            api_secret=livekit_server.api_secret, identity=AVATAR, agent_identity=AGENT)
        room = LiveKitRoom(out, MediaFormat(W, H), FakeSession())
        await room.start()
        room._on_segment_event(SegmentEvent("finished", "seg", position_s=1.0))  # as the playout reports one
        await asyncio.sleep(0.05)  # it is on its way
        t0 = time.monotonic()
        await room.aclose()
        closed = time.monotonic()
        await agent.disconnect()
        assert len(answered) == 1 and closed >= answered[0], "left before the agent answered the notification"
        assert closed - t0 < 1.5  # bounded: RPC_DRAIN_S

    asyncio.run(main())
