"""A complete LiveKit Agents voice agent whose face is a character of this server.

The agent is yours (speech-to-text, LLM, text-to-speech); the character only renders it. The unmodified
`livekit-plugins-runway` asks our Runway-compatible API (`RUNWAYML_BASE_URL`) for an avatar: the character
joins the room, lip-syncs the agent's speech and publishes its video and that speech, in sync.

A first try, without any provider key (the stand-in TTS speaks a fixed script with espeak-ng):

    scripts/setup.sh --agent                             # once: LiveKit Agents, the Runway plugin, espeak-ng
    characters serve --livekit-dev                       # the API on :8000, LiveKit on ws://127.0.0.1:7880
    export LIVEKIT_URL=ws://127.0.0.1:7880 LIVEKIT_API_KEY=devkey LIVEKIT_API_SECRET=secret
    export RUNWAYML_BASE_URL=http://127.0.0.1:8000 RUNWAYML_API_SECRET=dev-key-0123456789  # keys off: any value
    python examples/voice_agent.py connect --room demo   # the agent (and its character) in room "demo" now

then join room "demo" with any LiveKit client (a token: `lk token create --join --room demo`, or
`POST /v1/watch/token {"roomName": "demo"}` with an operator key) to see and hear it.

In production run `python examples/voice_agent.py start`: a worker that registers with the LiveKit server and
takes jobs dispatched to the agent name `CHARACTER_AGENT_NAME` (default `character-agent`; explicit dispatch,
so the rooms this service makes for its own sessions get no agent).

Environment (besides LiveKit's and Runway's above):
    CHARACTER_AGENT       stand-in (default): speak SCRIPT with espeak-ng, no provider needed;
                          pipeline: your STT/LLM/TTS (`pipeline_session`, here OpenAI's: `pip install
                          livekit-plugins-openai livekit-plugins-silero`, OPENAI_API_KEY)
    CHARACTER_AVATAR_ID   an avatar made with POST /v1/avatars (the Runway SDKs' avatars.create); unset: a preset
    CHARACTER_PRESET      the preset avatar when no avatar id is given (default sample-face)
    CHARACTER_MAX_DURATION  seconds the character may stay (default 300)

Any participant may call the agent's RPC `interrupt`: the agent calls `session.interrupt()` (as it does by itself
when the user starts talking, in the pipeline mode), and the character stops speaking; the answer says when
(`{"interruptedAt": <Unix seconds>}`).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import shutil
import time
import wave
from typing import Any

from livekit import rtc

try:
    from livekit.agents import (
        DEFAULT_API_CONNECT_OPTIONS,
        Agent,
        AgentServer,
        AgentSession,
        APIConnectOptions,
        JobContext,
        cli,
        room_io,
        tts,
        utils,
    )
    from livekit.plugins import runway
except ImportError as err:  # the project's base install has the server, not the agent framework
    raise SystemExit(f"examples/voice_agent.py needs LiveKit Agents and its Runway plugin ({err.name} is missing): "
                     "run `scripts/setup.sh --agent` (or `pip install 'realtime-characters[agent]'`)") from err

logger = logging.getLogger("character-agent")

AGENT_NAME = os.environ.get("CHARACTER_AGENT_NAME", "character-agent")
SCRIPT = (
    "Hello! I am a character rendered live from one picture, by a video model that listens to my voice.",
    "Every hundred and sixty seven milliseconds it draws four new frames of my face, in time with what I say.",
    "My words come from the voice agent you are running; I only give them a face.",
    "If you interrupt me, I stop talking at once and listen.",
)
PAUSE_S = 2.0  # between the stand-in's lines (and after an interruption)


class EspeakTTS(tts.TTS):
    """A stand-in text-to-speech: espeak-ng (Debian's `espeak-ng`), offline, no account needed."""

    def __init__(self, voice: str = "en-us", words_per_minute: int = 150) -> None:
        super().__init__(capabilities=tts.TTSCapabilities(streaming=False), sample_rate=22050, num_channels=1)
        self.voice, self.words_per_minute = voice, words_per_minute
        self.binary = shutil.which("espeak-ng")
        if self.binary is None:
            raise RuntimeError("espeak-ng is not installed; `apt-get install espeak-ng` (Debian), or run with "
                               "CHARACTER_AGENT=pipeline and your own TTS")

    @property
    def model(self) -> str:
        return "espeak-ng"

    @property
    def provider(self) -> str:
        return "espeak-ng"

    def synthesize(self, text: str, *,
                   conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> tts.ChunkedStream:
        return _EspeakStream(tts=self, input_text=text, conn_options=conn_options)


class _EspeakStream(tts.ChunkedStream):
    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        engine = self._tts
        assert isinstance(engine, EspeakTTS) and engine.binary is not None
        proc = await asyncio.create_subprocess_exec(
            engine.binary, "--stdout", "-v", engine.voice, "-s", str(engine.words_per_minute), self.input_text,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"espeak-ng failed ({proc.returncode}): {err.decode(errors='replace')[:200]}")
        with wave.open(io.BytesIO(out)) as w:
            rate, pcm = w.getframerate(), w.readframes(w.getnframes())
        output_emitter.initialize(request_id=utils.shortuuid(), sample_rate=rate, num_channels=1,
                                  mime_type="audio/pcm")
        output_emitter.push(pcm)
        output_emitter.flush()


def stand_in_session() -> AgentSession[Any]:
    """No provider: the agent speaks SCRIPT (it does not listen)."""
    return AgentSession(tts=EspeakTTS())


def pipeline_session() -> AgentSession[Any]:
    """Your own voice agent: put your STT, LLM and TTS plugins here (these are OpenAI's and Silero's VAD)."""
    from livekit.plugins import openai, silero  # type: ignore[attr-defined]  # pip install livekit-plugins-...

    return AgentSession(vad=silero.VAD.load(), stt=openai.STT(), llm=openai.LLM(model="gpt-4o-mini"),
                        tts=openai.TTS(voice="alloy"))


def avatar_session() -> runway.AvatarSession:
    """The character: Runway's plugin, unmodified; RUNWAYML_BASE_URL and RUNWAYML_API_SECRET point it at us."""
    avatar_id = os.environ.get("CHARACTER_AVATAR_ID")
    max_duration = int(os.environ.get("CHARACTER_MAX_DURATION", "300"))
    if avatar_id:
        return runway.AvatarSession(avatar_id=avatar_id, max_duration=max_duration)
    return runway.AvatarSession(preset_id=os.environ.get("CHARACTER_PRESET", "sample-face"), max_duration=max_duration)


async def speak_script(session: AgentSession[Any]) -> None:
    """The stand-in's part of the conversation: its lines, one after another, for as long as the room lasts."""
    while True:
        for line in SCRIPT:
            handle = session.say(line, allow_interruptions=True)
            await handle.wait_for_playout()
            logger.info("said %r%s", line[:40], " (interrupted)" if handle.interrupted else "")
            await asyncio.sleep(PAUSE_S)


server = AgentServer()


@server.rtc_session(agent_name=AGENT_NAME)
async def entrypoint(ctx: JobContext) -> None:
    await ctx.connect()
    mode = os.environ.get("CHARACTER_AGENT", "stand-in")
    session = pipeline_session() if mode == "pipeline" else stand_in_session()
    avatar = avatar_session()
    await avatar.start(session, room=ctx.room)  # POST {RUNWAYML_BASE_URL}/v1/realtime_sessions: the character joins
    # the agent's speech goes to the character (the plugin's audio output), which publishes it with its video
    options = room_io.RoomOptions(audio_output=False, audio_input=mode == "pipeline")
    await session.start(agent=Agent(instructions="You are a friendly character. Keep your answers short."),
                        room=ctx.room, room_options=options)

    async def interrupt(data: rtc.RpcInvocationData) -> str:
        at = time.time()
        await session.interrupt()
        logger.info("interrupted by %s", data.caller_identity)
        return json.dumps({"interruptedAt": at})  # when session.interrupt() was called (Unix seconds)

    ctx.room.local_participant.register_rpc_method("interrupt", interrupt)
    if mode != "pipeline":
        await avatar.wait_for_join(timeout=60)  # the character is in the room, its video published
        script = asyncio.create_task(speak_script(session), name="stand-in-script")

        async def stop_script(reason: str) -> None:
            script.cancel()
            await asyncio.gather(script, return_exceptions=True)

        ctx.add_shutdown_callback(stop_script)


if __name__ == "__main__":
    cli.run_app(server)
