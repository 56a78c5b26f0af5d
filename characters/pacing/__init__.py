"""Playout pacing of generated chunks: a jitter buffer and one playout clock, pure logic, no I/O.

    config    PacingConfig: one room's playout parameters
    playout   Playout: queues chunks and hands out frames and audio, in sync by construction (its docstring is
              the contract: timeline, jitter buffer, late chunks, speech onsets, segments, interruption)
    trim      TrimPolicy: what latency recovery may trim, shed or cut, decided apart (pure, no clock)
    speech    SpeechLedger: the speech sent, by segment, and whose samples each chunk holds
    events    what a playout hands out and reports, and the PCM helpers its callers share
"""

from characters.pacing.config import PacingConfig
from characters.pacing.events import (
    AudioOut,
    ClearResult,
    PlayoutStats,
    SegmentEvent,
    SpeechSplit,
    VideoOut,
    speech_prefix,
    to_int16,
)
from characters.pacing.playout import CLEARED, Playout
from characters.pacing.trim import TrimPolicy

__all__ = ["CLEARED", "AudioOut", "ClearResult", "PacingConfig", "Playout", "PlayoutStats", "SegmentEvent",
           "SpeechSplit", "TrimPolicy", "VideoOut", "speech_prefix", "to_int16"]
