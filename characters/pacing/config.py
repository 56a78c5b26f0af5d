"""`PacingConfig`: the parameters of one room's playout (`characters.pacing.Playout`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class PacingConfig(BaseModel):
    """Playout parameters (one per room)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fps: int = Field(default=24, ge=1, description="Video frames per second.")
    sample_rate: int = Field(default=16000, ge=8000, description="Audio sample rate of chunks and output (Hz).")
    frames_per_chunk: int = Field(default=4, ge=1, description="Video frames per chunk (F).")
    audio_frame_ms: int = Field(default=10, ge=1, description="Output audio frame length (ms).")
    target_depth: float = Field(default=1.0, ge=0, description="Jitter buffer: chunk durations the first chunk "
                                "waits before playout starts (the slack against late chunks).")
    max_depth: int = Field(default=3, ge=1, description="Queued chunks above which idle chunks are dropped.")
    shrink_after_s: float = Field(default=2.0, gt=0, description="A buffer deeper than the target for this long "
                                  "sheds one idle chunk.")
    audio_lead_s: float = Field(default=0.04, ge=0, le=0.5, description="Audio is handed out this early; "
                                "the sink's queue delays it by as much.")
    max_catchup_s: float = Field(default=0.04, ge=0, description="Backlog handed out after a late poll; the rest "
                                 "slips. Keep it <= audio_lead_s: a longer burst over-fills the sink's audio queue "
                                 "and leaves the audio that much behind the video.")
    min_slack_s: float | None = Field(default=None, ge=0, description="Trim idle chunks frame by frame while "
                                      "every chunk of the last `slack_window_s` was queued this much plus a "
                                      "frame ahead of its play time (None: off; see the module docstring).")
    slack_window_s: float = Field(default=6.0, gt=0, description="The window of chunk slacks `min_slack_s` "
                                  "is checked against (it must be full before anything is trimmed).")
    onset_slack_s: float = Field(default=0.02, ge=0, description="An onset chunk (`push(onset=True)`) has its audio "
                                 "handed out this long after it arrived (its frames `audio_lead_s` later), idle "
                                 "content ahead of it cut to make it so (see the module docstring).")
    stale_speech_s: float = Field(default=5.0, gt=0, description="Speech not generated this long after it was "
                                  "sent is counted lost once a chunk without speech arrives.")
    stats_window_s: float = Field(default=2.0, gt=0, description="Window of the fps and A/V offset stats.")
    hold_on_clear: Literal["rest", "last"] = Field(
        default="rest", description="What blanked (interrupted) slots show until fresh frames arrive: 'rest', "
        "the last frame shown without speech (the character at rest, mouth closed), or 'last', the last frame "
        "shown (possibly mid-word).")

    @property
    def chunk_s(self) -> float:
        return self.frames_per_chunk / self.fps

    @property
    def audio_frame_samples(self) -> int:
        return self.sample_rate * self.audio_frame_ms // 1000
