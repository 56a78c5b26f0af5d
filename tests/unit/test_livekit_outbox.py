"""deployments.livekit.outbox: agent speech batched a chunk's window at a time, one push in flight, order kept."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from deployments.livekit.outbox import PUSH_IDLE_S, SpeechOutbox

WINDOW = 2666  # samples of a chunk's window (16 kHz, 4 frames at 24 fps)
FRAME = b"\x01\x00" * 320  # 20 ms of 16-bit speech


class Session:
    """A push_audio whose calls stay in flight until released; records what each push carried."""

    def __init__(self) -> None:
        self.pushes: list[int] = []  # samples per push
        self.gates: list[asyncio.Future[None]] = []

    def push(self, pcm16: bytes) -> asyncio.Future[None]:
        self.pushes.append(len(pcm16) // 2)
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.gates.append(gate)
        return gate

    def release(self) -> None:
        for gate in self.gates:
            if not gate.done():
                gate.set_result(None)


def outbox(session: Session) -> tuple[SpeechOutbox, list[tuple[str, int | None]], list[asyncio.Task[None]]]:
    delivered: list[tuple[str, int | None]] = []
    tasks: list[asyncio.Task[None]] = []

    def spawn(coro: Coroutine[Any, Any, None], name: str) -> None:
        tasks.append(asyncio.get_running_loop().create_task(coro, name=name))

    box = SpeechOutbox(session.push, lambda items: delivered.extend(
        (s, None if p is None else len(p) // 2) for s, p in items), batch_samples=WINDOW, spawn=spawn)
    return box, delivered, tasks


def test_a_burst_goes_a_window_at_a_time_one_push_in_flight_and_in_order() -> None:
    async def main() -> None:
        session = Session()
        box, delivered, tasks = outbox(session)
        for _ in range(9):  # 180 ms at once: a window's worth after 9 frames
            box.add("a", FRAME)
        assert session.pushes == [9 * 320]  # the window filled: pushed at once, not frame by frame
        for _ in range(20):  # more while that push is in flight: held
            box.add("a", FRAME)
        box.end("a")
        box.add("b", FRAME)
        assert session.pushes == [9 * 320]
        session.release()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert session.pushes == [9 * 320, 21 * 320]  # everything held, in one push, once the first returned
        session.release()
        await asyncio.sleep(PUSH_IDLE_S * 3)
        await asyncio.gather(*tasks)
        # the ledger hears samples and the segment's end in arrival order, the end after a's last samples
        assert [s for s, n in delivered if n is None] == ["a"]
        assert sum(n for s, n in delivered if s == "a" and n) == 29 * 320
        assert delivered.index(("a", None)) < max(i for i, (s, _) in enumerate(delivered) if s == "b")

    asyncio.run(main())


def test_speech_at_real_time_goes_a_frame_at_a_time_and_a_clear_drops_what_is_held() -> None:
    async def main() -> None:
        session = Session()
        box, delivered, tasks = outbox(session)
        box.add("a", FRAME)
        assert session.pushes == []  # less than a window: held for the stream's pause
        await asyncio.sleep(PUSH_IDLE_S * 3)
        assert session.pushes == [320]  # the pause: pushed
        session.release()
        await asyncio.sleep(0)
        box.add("a", FRAME)
        box.drop_speech()  # an interruption: never handed over
        box.end("a")
        await asyncio.sleep(PUSH_IDLE_S * 3)
        await asyncio.gather(*tasks)
        assert session.pushes == [320] and delivered == [("a", 320), ("a", None)]
        box.close()

    asyncio.run(main())
