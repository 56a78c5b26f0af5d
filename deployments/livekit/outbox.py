"""`SpeechOutbox`: agent speech on its way from the room to the session's audio queue, in batches.

An agent's byte stream brings a chunk per 10-20 ms audio frame, and a TTS sends faster than real time: a
push to the session per chunk would cost a call per frame on the cores the character's next chunk needs,
while the generator takes whole chunk windows anyway. So speech is held until a chunk's window of it is
here, the stream pauses for `PUSH_IDLE_S`, or its segment ends, and one push is in flight at a time (what
arrives meanwhile goes in the next). Speech at real time still goes a frame at a time (each pauses).

Order is kept: `deliver` hears every batch as it is pushed, samples and segment ends in arrival order (the
room records them in its playout's ledger). Runs on the room's event loop; never blocks it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)

PUSH_IDLE_S = 0.01  # held speech goes to the session after the stream paused this long
Item = tuple[str, bytes | None]  # (segment, 16-bit PCM), or (segment, None): the segment ended


class SpeechOutbox:
    def __init__(self, push: Callable[[bytes], object] | None, deliver: Callable[[list[Item]], None], *,
                 batch_samples: int, spawn: Callable[[Coroutine[Any, Any, None], str], None]) -> None:
        """`push(pcm16)`: hand speech to the session (may return an awaitable: one is in flight until it is done;
        None: no session, only `deliver`); `batch_samples`: a chunk's window; `spawn(coro, name)`: run a task the
        owner awaits on close."""
        self.push, self.deliver, self.batch_samples, self.spawn = push, deliver, batch_samples, spawn
        self._items: list[Item] = []
        self._pushing = False
        self._timer: asyncio.TimerHandle | None = None

    def add(self, segment: str, pcm16: bytes) -> None:
        if pcm16:
            self._items.append((segment, pcm16))
            self.flush()

    def end(self, segment: str) -> None:
        """`segment` has no more samples: it ends after the last of them is delivered."""
        self._items.append((segment, None))
        self.flush()

    def drop_speech(self) -> None:
        """An interruption: speech not yet handed over never will be (segment ends still are)."""
        self._items = [(segment, None) for segment, pcm in self._items if pcm is None]
        self._cancel_timer()

    def close(self) -> None:
        self._cancel_timer()

    def flush(self, idle: bool = False) -> None:
        """Push what is held once it is a batch (a window of speech, a segment's end, or `idle`: the stream
        paused), unless a push is in flight (its return flushes)."""
        if idle:
            self._timer = None
        if not self._items:
            return
        if not idle and self._items[-1][1] is not None \
                and sum(len(p) for _, p in self._items if p) // 2 < self.batch_samples:
            self._cancel_timer()
            self._timer = asyncio.get_running_loop().call_later(PUSH_IDLE_S, self.flush, True)
            return
        if self._pushing:
            return
        self._cancel_timer()
        items, self._items = self._items, []
        pcm16 = b"".join(p for _, p in items if p)
        if pcm16 and self.push is not None:
            try:
                result = self.push(pcm16)
            except Exception as e:  # noqa: BLE001 (a failing handler must not stop the room)
                log.warning("handler push_audio failed: %s: %s", type(e).__name__, e)
                result = None
            if inspect.isawaitable(result):
                self._pushing = True
                self.spawn(self._pushed(result), "livekit-push-audio")
        self.deliver(items)

    async def _pushed(self, result: Awaitable[object]) -> None:
        try:
            await result
        except Exception as e:  # noqa: BLE001
            log.warning("handler push_audio failed: %s: %s", type(e).__name__, e)
        finally:
            self._pushing = False
            self.flush(idle=self._timer is None)  # (the stream paused while it was in flight: all of it now)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
