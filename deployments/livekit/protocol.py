"""The LiveKit Agents avatar protocol, as the avatar side speaks it (names, message shapes, agent audio).

- Agent speech arrives as byte streams on topic `lk.audio_stream`, one stream per speech segment, raw
  signed 16-bit little-endian PCM with attributes `sample_rate` and `num_channels`. Closing the stream
  ends the segment.
- The agent calls RPC `lk.clear_buffer` (empty payload) to interrupt; the avatar answers "ok", drops
  queued speech and reports the interrupted segment with `lk.playback_finished`.
- The avatar calls RPC `lk.playback_finished` on the agent with JSON carrying exactly
  `playback_position` (seconds played), `interrupted` and `synchronized_transcript` (the agent builds
  its dataclass from the payload: any other key breaks it), and optionally `lk.playback_started`
  (empty payload; the agent only registers it when it waits for playback starts).
- The agent ends the call with a reliable data message `{"type": "END_CALL"}` (Runway's plugin).

`AgentAudioDecoder` turns one stream's bytes into what the session queues: 16 kHz mono 16-bit PCM
(resampled with state kept across pieces), with exact zero samples nudged to 1 LSB (-90 dBFS) so that
speech is never exactly 0.0 and the playout can tell it from padding (`characters.pacing`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping

import numpy as np

from characters.audio import AGENT_MAX_CHANNELS, AGENT_RATE_RANGE, PcmConverter, pcm16_to_float
from characters.pacing import to_int16

AUDIO_STREAM_TOPIC = "lk.audio_stream"
RPC_CLEAR_BUFFER = "lk.clear_buffer"
RPC_PLAYBACK_FINISHED = "lk.playback_finished"
RPC_PLAYBACK_STARTED = "lk.playback_started"
END_CALL = "END_CALL"
SAMPLE_RATE = 16000
RATE_RANGE = AGENT_RATE_RANGE  # (the limits of every ingress: characters.audio.check_agent_pcm)
MAX_CHANNELS = AGENT_MAX_CHANNELS


_JWT = re.compile(r"eyJ[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*")


def redact(text: str) -> str:
    """`text` with every JWT (LiveKit access tokens) replaced: server errors echo rejected tokens."""
    return _JWT.sub("<token redacted>", text)


class _RedactTokens(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        return True


def redact_livekit_logs() -> None:
    """Redact tokens in the `livekit` logger, where the Rust SDK's logs land (it logs a rejected token in
    full). Idempotent."""
    logger = logging.getLogger("livekit")
    if not any(isinstance(f, _RedactTokens) for f in logger.filters):
        logger.addFilter(_RedactTokens())


class ProtocolError(ValueError):
    """A message from the agent does not follow the avatar protocol; the message says what and how."""


def playback_finished_payload(position_s: float, interrupted: bool) -> str:
    """The `lk.playback_finished` payload: exactly the three keys the agent accepts."""
    return json.dumps({"playback_position": round(max(0.0, position_s), 4), "interrupted": bool(interrupted),
                       "synchronized_transcript": None})


def is_end_call(data: bytes) -> bool:
    """Whether a data packet is Runway's `{"type": "END_CALL"}` (anything unparsable is not)."""
    try:
        message = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(message, dict) and message.get("type") == END_CALL


def stream_format(attributes: Mapping[str, str]) -> tuple[int, int]:
    """(sample_rate, num_channels) of an `lk.audio_stream`, validated."""
    try:
        rate, channels = int(attributes["sample_rate"]), int(attributes["num_channels"])
    except KeyError as e:
        raise ProtocolError(f"audio stream attribute {e.args[0]!r} is missing; the sender must set sample_rate "
                            "and num_channels (LiveKit Agents' DataStreamAudioOutput does)") from e
    except ValueError as e:
        raise ProtocolError(f"audio stream attributes sample_rate={attributes.get('sample_rate')!r} "
                            f"num_channels={attributes.get('num_channels')!r} must be integers") from e
    if not RATE_RANGE[0] <= rate <= RATE_RANGE[1]:
        raise ProtocolError(f"audio stream sample_rate={rate} is outside {RATE_RANGE[0]}..{RATE_RANGE[1]} Hz; "
                            "send 16000 Hz PCM")
    if not 1 <= channels <= MAX_CHANNELS:
        raise ProtocolError(f"audio stream num_channels={channels} must be 1 or {MAX_CHANNELS}; send mono")
    return rate, channels


class AgentAudioDecoder:
    """One speech segment's bytes (any split) -> 16 kHz mono int16 PCM, never exactly zero."""

    def __init__(self, sample_rate: int, channels: int) -> None:
        self.channels = channels
        self._converter = PcmConverter(sample_rate, channels)
        self._rest = b""  # bytes of an incomplete sample frame, carried to the next piece

    def decode(self, data: bytes) -> bytes:
        data = self._rest + data
        whole = len(data) - len(data) % (2 * self.channels)
        data, self._rest = data[:whole], data[whole:]
        return self._finish(self._converter.convert(pcm16_to_float(data))) if data else b""

    def flush(self) -> bytes:
        """The resampler's tail at the end of the segment (an incomplete last sample frame is dropped)."""
        self._rest = b""
        return self._finish(self._converter.flush())

    @staticmethod
    def _finish(pcm: np.ndarray) -> bytes:
        ints = to_int16(pcm)
        ints[ints == 0] = 1
        return ints.tobytes()
