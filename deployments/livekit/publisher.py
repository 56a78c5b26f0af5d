"""`MediaPublisher`: the character's camera and microphone tracks, fed by a `characters.pacing.Playout`.

An async component (`start()` / `aclose()`): `start` publishes both tracks at once (the agent sends no
audio before the avatar's video track exists) and starts the playout task, which sleeps until the
playout's next due time (or a new chunk), hands video frames to the `VideoSource` (RGB24, no
simulcast, one layer at `fps`) and 10 ms audio frames to the `AudioSource` (16 kHz mono), and passes
segment events to `on_event`. The A/V offset it reports is measured: the audio source's queue at
each push is passed to the playout.

The poster. Until a video source has a frame, the rtc library sends black keepalive frames (10 fps), so a
viewer would see black from the track's publication to the first chunk. Given a `poster` (the character's
reference image, which its first generated frames resemble), `start` captures it before publishing (which
ends the keepalive) and then every `POSTER_INTERVAL_S` until the playout's first frame (a viewer who subscribes
meanwhile needs a frame to come after its subscription): the viewer sees the character from the track's first
frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import numpy as np
from livekit import rtc

from characters.pacing import AudioOut, PacingConfig, Playout, PlayoutStats, SegmentEvent, VideoOut
from deployments.livekit.config import MediaFormat

log = logging.getLogger(__name__)

AUDIO_QUEUE_MS = 400  # the audio source's queue: the playout keeps ~audio_lead_s in it
# Audio goes to the audio source in 20 ms frames: each is a wakeup of the playout task and a call into the rtc
# library, and at 10 ms a 24 fps character's room took 0.25-0.27 cores against 0.18-0.20 (measured on a 2-core EPYC,
# no subscriber); the source's queue still holds ~audio_lead_s.
AUDIO_FRAME_MS = 20
POSTER_INTERVAL_S = 0.1  # the poster's rate until the first chunk (the rtc library's black keepalive's: 10 fps)


def check_poster(poster: np.ndarray | None, media: MediaFormat) -> None:
    if poster is not None and (poster.shape != (media.height, media.width, 3) or poster.dtype != np.uint8):
        raise ValueError(f"the poster is {poster.shape} {poster.dtype}, the video track takes "
                         f"({media.height}, {media.width}, 3) uint8 (the preset's resolution)")


class MediaPublisher:
    """Publishes paced chunks into a connected room. Use from the room's event loop only."""

    def __init__(self, room: rtc.Room, media: MediaFormat, pacing: PacingConfig | None = None, *,
                 on_event: Callable[[SegmentEvent], None] = lambda e: None,
                 clock: Callable[[], float] = time.monotonic, poster: np.ndarray | None = None) -> None:
        self.room, self.media, self.on_event, self.clock = room, media, on_event, clock
        check_poster(poster, media)
        self.poster = None if poster is None else np.ascontiguousarray(poster).tobytes()
        self.pacing = pacing or PacingConfig(fps=media.fps, frames_per_chunk=media.frames_per_chunk,
                                             audio_frame_ms=AUDIO_FRAME_MS,
                                             sample_rate=media.sample_rate)
        if (self.pacing.fps, self.pacing.sample_rate) != (media.fps, media.sample_rate):
            raise ValueError(f"pacing fps/sample_rate {self.pacing.fps}/{self.pacing.sample_rate} differ from the "
                             f"published format's {media.fps}/{media.sample_rate}; make them equal")
        self.playout = Playout(self.pacing, clock=clock)
        self.video_source: rtc.VideoSource | None = None
        self.audio_source: rtc.AudioSource | None = None
        self.muted = False  # see mute()
        self.video_publication: rtc.LocalTrackPublication | None = None
        self.audio_publication: rtc.LocalTrackPublication | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._poster_task: asyncio.Task[None] | None = None
        self._playing = False  # the playout has captured a frame: the poster is done

    async def start(self) -> None:
        m = self.media
        self.video_source = rtc.VideoSource(m.width, m.height)
        self._show_poster()  # before the track exists: no black keepalive frame reaches the encoder
        self.audio_source = rtc.AudioSource(m.sample_rate, 1, queue_size_ms=AUDIO_QUEUE_MS)
        lp = self.room.local_participant
        video = rtc.LocalVideoTrack.create_video_track("character-video", self.video_source)
        self.video_publication = await lp.publish_track(video, rtc.TrackPublishOptions(
            source=rtc.TrackSource.SOURCE_CAMERA, simulcast=False,
            video_encoding=rtc.VideoEncoding(max_framerate=m.fps, max_bitrate=m.max_bitrate)))
        if self.poster is not None:
            self._poster_task = asyncio.create_task(self._show_poster_until_playing(), name="livekit-poster")
        audio = rtc.LocalAudioTrack.create_audio_track("character-audio", self.audio_source)
        self.audio_publication = await lp.publish_track(audio, rtc.TrackPublishOptions(
            source=rtc.TrackSource.SOURCE_MICROPHONE))
        self._task = asyncio.create_task(self._run(), name="livekit-playout")
        self._task.add_done_callback(self._done)

    def _show_poster(self) -> None:
        if self.poster is not None and self.video_source is not None and not self._playing:
            self.video_source.capture_frame(rtc.VideoFrame(self.media.width, self.media.height,
                                                           rtc.VideoBufferType.RGB24, self.poster))

    async def _show_poster_until_playing(self) -> None:
        while not self._playing and self.video_source is not None:
            self._show_poster()
            await asyncio.sleep(POSTER_INTERVAL_S)

    def push(self, frames: np.ndarray, pcm: np.ndarray, speech_samples: int | None = None,
             submitted_at: float | None = None, onset: bool = False, early_s: float = 0.0,
             continues: bool = False) -> float:
        """Queue a chunk for playout (see `Playout.push`: returns the seconds cut ahead of an onset); wakes the
        playout task. The arrays are kept until played: the caller must not modify them afterwards."""
        h, w = self.media.height, self.media.width
        if frames.ndim != 4 or frames.shape[1:] != (h, w, 3):
            raise ValueError(f"frames are {frames.shape}, the video track takes (F, {h}, {w}, 3); publish at the "
                             "preset's resolution")
        cut = self.playout.push(frames, pcm, speech_samples, submitted_at, onset, early_s, continues)
        self._wake.set()
        return cut

    def wake(self) -> None:
        self._wake.set()

    def flush_audio(self) -> None:
        """Drop audio queued in the audio source (an interruption cut it)."""
        if self.audio_source is not None:
            self.audio_source.clear_queue()
        self._wake.set()

    def mute(self, muted: bool) -> None:
        """While muted, the audio due plays as silence (its timing kept): an interruption mutes at once, before
        the session has said what it dropped, and unmutes once the playout has applied the clear."""
        self.muted = muted

    def stats(self) -> PlayoutStats:
        return self.playout.stats()

    @staticmethod
    def _done(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("the playout task failed: %r; the character's media stopped", task.exception())

    async def aclose(self) -> None:
        tasks = [t for t in (self._poster_task, self._task) if t is not None]
        self._poster_task = self._task = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for source in (self.audio_source, self.video_source):
            if source is not None:
                await source.aclose()
        self.audio_source = self.video_source = None

    async def _run(self) -> None:
        assert self.video_source is not None and self.audio_source is not None
        video, audio = self.video_source, self.audio_source
        w, h = self.media.width, self.media.height
        while True:
            due = self.playout.next_due()
            delay = None if due is None else due - self.clock()
            if delay is None or delay > 0:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
                continue
            for item in self.playout.poll(audio_queue_s=audio.queued_duration):
                if isinstance(item, VideoOut):
                    self._playing = True
                    video.capture_frame(rtc.VideoFrame(w, h, rtc.VideoBufferType.RGB24,
                                                       np.ascontiguousarray(item.frame).tobytes()))
                elif isinstance(item, AudioOut):
                    samples = np.zeros_like(item.samples) if self.muted else item.samples
                    await audio.capture_frame(rtc.AudioFrame(samples.tobytes(), self.media.sample_rate, 1,
                                                             samples.size))
                else:
                    self.on_event(item)
