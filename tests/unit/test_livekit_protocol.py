"""deployments.livekit without a server: token minting, output specs, avatar protocol message shapes,
agent audio decoding, the server's config."""

from __future__ import annotations

import json
import pickle
from dataclasses import fields

import numpy as np
import pytest
from livekit import api
from livekit.agents.voice.io import PlaybackFinishedEvent

from characters.audio import pcm16_to_float
from characters.pacing import speech_prefix
from deployments.livekit import LiveKitConfigError, LiveKitOutput, MediaFormat, mint_token
from deployments.livekit.config import ATTRIBUTE_PUBLISH_ON_BEHALF
from deployments.livekit.protocol import (
    AUDIO_STREAM_TOPIC,
    RPC_CLEAR_BUFFER,
    RPC_PLAYBACK_FINISHED,
    RPC_PLAYBACK_STARTED,
    AgentAudioDecoder,
    ProtocolError,
    is_end_call,
    playback_finished_payload,
    stream_format,
)
from deployments.livekit.server import ServerPorts, server_config
from deployments.types import OutputSpec

pytestmark = pytest.mark.filterwarnings("ignore::jwt.warnings.InsecureKeyLengthWarning")

KEY, SECRET = "APIkey123", "a-secret-that-is-long-enough-for-hs256-0123"


def claims(token: str) -> api.access_token.Claims:
    return api.TokenVerifier(KEY, SECRET).verify(token)


def test_minted_token_joins_one_room_and_publishes_on_behalf_of_the_agent() -> None:
    c = claims(mint_token(KEY, SECRET, room="r1", identity="avatar", name="Ava", agent_identity="agent-7"))
    assert c.identity == "avatar" and c.name == "Ava" and c.kind == "agent"
    assert c.attributes == {ATTRIBUTE_PUBLISH_ON_BEHALF: "agent-7"}
    assert c.video is not None
    assert (c.video.room_join, c.video.room, c.video.can_publish, c.video.can_subscribe, c.video.can_publish_data) == (
        True, "r1", True, True, True)


def test_minted_token_without_agent_is_a_standard_participant() -> None:
    c = claims(mint_token(KEY, SECRET, room="r1", identity="character"))
    assert c.kind == "" and not c.attributes and c.name == "character"


def test_output_with_token_or_key_and_secret() -> None:
    out = LiveKitOutput(url="wss://lk.example", room_name="r", api_key=KEY, api_secret=SECRET, identity="av",
                        agent_identity="ag")
    c = claims(out.join_token())
    assert c.identity == "av" and c.attributes == {ATTRIBUTE_PUBLISH_ON_BEHALF: "ag"}
    given = LiveKitOutput(url="ws://127.0.0.1:7880", room_name="r", token="a.b.c")
    assert given.join_token() == "a.b.c"
    assert {f.name for f in fields(OutputSpec)} <= {f.name for f in fields(LiveKitOutput)}  # OutputSpec-compatible
    assert given.kind == "livekit" and given.path is None
    assert pickle.loads(pickle.dumps(out)) == out  # travels to the room worker through Ray


def test_output_repr_never_shows_credentials() -> None:
    out = LiveKitOutput(url="wss://lk.example", room_name="r", api_key=KEY, api_secret=SECRET)
    tok = LiveKitOutput(url="wss://lk.example", room_name="r", token="header.payload.signature")
    assert SECRET not in repr(out) and KEY not in repr(out) and "signature" not in repr(tok)


@pytest.mark.parametrize(("kw", "match"), [
    ({"url": "lk.example", "token": "a.b.c"}, "not a LiveKit server URL"),
    ({"url": "ftp://lk.example", "token": "a.b.c"}, "not a LiveKit server URL"),
    ({"room_name": "", "token": "a.b.c"}, "roomName"),
    ({"token": "not-a-jwt"}, "not a JWT"),
    ({"token": "a.b.c", "api_key": KEY, "api_secret": SECRET}, "not both"),
    ({"api_key": KEY}, "needs token, or apiKey and apiSecret"),
    ({}, "needs token"),
    ({"token": "a.b.c", "agent_identity": "has space"}, "agentIdentity"),
])
def test_output_refusals_name_the_field(kw: dict[str, str], match: str) -> None:
    args = {"url": "wss://lk.example", "room_name": "r", **kw}
    with pytest.raises(LiveKitConfigError, match=match):
        LiveKitOutput(**args)  # type: ignore[arg-type]


def test_media_format_checks() -> None:
    assert MediaFormat(272, 176).fps == 24
    with pytest.raises(LiveKitConfigError, match="even"):
        MediaFormat(271, 176)
    with pytest.raises(LiveKitConfigError, match="16000"):
        MediaFormat(272, 176, sample_rate=44100)


def test_protocol_names_match_livekit_agents() -> None:
    from livekit.agents.voice.avatar import _datastream_io as agents

    assert (AUDIO_STREAM_TOPIC, RPC_CLEAR_BUFFER, RPC_PLAYBACK_FINISHED, RPC_PLAYBACK_STARTED) == (
        agents.AUDIO_STREAM_TOPIC, agents.RPC_CLEAR_BUFFER, agents.RPC_PLAYBACK_FINISHED, agents.RPC_PLAYBACK_STARTED)
    from livekit.agents.voice.room_io import ATTRIBUTE_PUBLISH_ON_BEHALF as agents_attr

    assert agents_attr == ATTRIBUTE_PUBLISH_ON_BEHALF


def test_playback_finished_payload_has_exactly_the_agents_fields() -> None:
    payload = json.loads(playback_finished_payload(2.345678, True))
    assert payload == {"playback_position": 2.3457, "interrupted": True, "synchronized_transcript": None}
    ev = PlaybackFinishedEvent(**payload)  # what the agent does with it
    assert ev.playback_position == pytest.approx(2.3457) and ev.interrupted
    assert json.loads(playback_finished_payload(-1.0, False))["playback_position"] == 0.0


def test_end_call_detection() -> None:
    assert is_end_call(json.dumps({"type": "END_CALL"}).encode())
    for data in (b"", b"END_CALL", b"\xff\xfe", json.dumps({"type": "end_call"}).encode(), b"[1]", b'"END_CALL"'):
        assert not is_end_call(data)


def test_stream_format_validation() -> None:
    assert stream_format({"sample_rate": "16000", "num_channels": "1"}) == (16000, 1)
    assert stream_format({"sample_rate": "48000", "num_channels": "2", "x": "y"}) == (48000, 2)
    for attrs, match in (({"num_channels": "1"}, "'sample_rate' is missing"), ({"sample_rate": "16k",
                         "num_channels": "1"}, "must be integers"), ({"sample_rate": "96000", "num_channels": "1"},
                         "outside"), ({"sample_rate": "16000", "num_channels": "6"}, "must be 1 or 2")):
        with pytest.raises(ProtocolError, match=match):
            stream_format(attrs)


def test_decoder_passes_16k_mono_exactly_with_zeros_nudged_in_any_split() -> None:
    rng = np.random.default_rng(0)
    pcm = rng.integers(-3000, 3000, 4000).astype(np.int16)
    pcm[100:300] = 0  # a pause in the speech
    raw = pcm.tobytes()
    dec = AgentAudioDecoder(16000, 1)
    pieces = [raw[:1], raw[1:777], raw[777:778], raw[778:5001], raw[5001:]]  # odd byte splits
    out = np.frombuffer(b"".join(dec.decode(p) for p in pieces) + dec.flush(), np.int16)
    want = pcm.copy()
    want[want == 0] = 1
    assert np.array_equal(out, want)
    f = pcm16_to_float(out.tobytes())
    assert speech_prefix(np.concatenate([f, np.zeros(50, np.float32)])) == f.size  # speech never reads as padding


def test_decoder_resamples_and_downmixes_48k_stereo_to_16k_mono() -> None:
    t = np.arange(48000) / 48000
    tone = (8000 * np.sin(2 * np.pi * 440 * t)).astype(np.int16)
    stereo = np.stack([tone, tone], axis=1).reshape(-1).tobytes()
    dec = AgentAudioDecoder(48000, 2)
    out = np.frombuffer(b"".join(dec.decode(stereo[i:i + 1922]) for i in range(0, len(stereo), 1922))
                        + dec.flush(), np.int16)
    assert abs(out.size - 16000) <= 16
    assert not (out == 0).any()
    mid = out[2000:14000].astype(np.float64)
    assert np.sqrt(np.mean(mid ** 2)) == pytest.approx(8000 / np.sqrt(2), rel=0.02)


def test_server_config_stays_on_loopback() -> None:
    cfg = server_config(ServerPorts(7880, 7881, 7882))
    assert cfg["port"] == 7880
    rtc = cfg["rtc"]
    assert (rtc["tcp_port"], rtc["udp_port"], rtc["node_ip"], rtc["use_external_ip"]) == (7881, 7882, "127.0.0.1",
                                                                                          False)
    assert all(s.startswith("127.0.0.1") for s in rtc["stun_servers"])


def test_tokens_are_redacted_from_messages_and_the_sdk_log(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from deployments.livekit.protocol import redact, redact_livekit_logs

    tok = mint_token(KEY, SECRET, room="r", identity="a")
    assert redact(f"401 Unauthorized - invalid token: {tok}, error: x") == (
        "401 Unauthorized - invalid token: <token redacted>, error: x")
    assert redact(f"wss://h/rtc?access_token={tok}&x=1") == "wss://h/rtc?access_token=<token redacted>&x=1"
    redact_livekit_logs()
    redact_livekit_logs()  # idempotent
    with caplog.at_level(logging.INFO, logger="livekit"):
        logging.getLogger("livekit").error("%s:%s:%s - %s", "livekit", 1, "m", f"invalid token: {tok}")
    assert "invalid token: <token redacted>" in caplog.text and tok not in caplog.text


def test_the_development_server_uses_livekits_own_ports_unless_told_otherwise():
    from deployments.cli.serve import build_parser
    from deployments.livekit.server import ServerPorts

    assert build_parser().parse_args(["--livekit-dev"]).livekit_port == 7880
    assert ServerPorts.from_http() == ServerPorts(7880, 7881, 7882)
    assert ServerPorts.from_http(17880) == ServerPorts(17880, 17881, 17882)
    with pytest.raises(ValueError, match="65533"):
        ServerPorts.from_http(65535)


def test_busy_names_the_ports_that_are_taken():
    import socket

    from deployments.livekit.server import ServerPorts, free_port

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        ports = ServerPorts(port, free_port(), free_port(socket.SOCK_DGRAM))
        assert ports.busy() == [f"{port}/tcp"]
    assert ports.busy() == []
