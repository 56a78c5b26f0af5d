"""Speech for the procedural data set: a sentence generator, espeak-ng voices, and the motion tracks.

`synthesize` calls `espeak-ng` (Debian: `apt-get install espeak-ng`) with a voice, speed and pitch and
returns float32 mono 16 kHz PCM. `motion_tracks` turns PCM into what the renderer draws per video frame:
the mouth opening follows the speech envelope (log RMS over each frame's samples, normalised to the
clip's loudest frame, smoothed with a quick attack and a slower release, as lips move), and the head
nods a little with a slow envelope. `frame_envelope` is the same per-frame log RMS, which the lip-sync
score correlates generated mouths against.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from characters.audio import SAMPLE_RATE, load_audio

FPS = 24

VOICES = [f"en+m{i}" for i in range(1, 8)] + [f"en+f{i}" for i in range(1, 5)] + [
    "en-us+m3", "en-us+f2", "en-gb-scotland+m2", "en-029+f3", "en+Andy", "en+klatt", "en-us+Annie", "en+Mike"]


def _words(text: str) -> list[str]:
    return text.split()


LANGUAGES = {  # language voices with a small vocabulary of their own
    "de": _words("der die das und ich du wir heute morgen haus katze hund schnell langsam gut sehr gerne "
                 "wasser brot sonne regen zeit welt kind garten stadt spielen lesen sehen kommen"),
    "fr": _words("le la les et je tu nous demain matin maison chat chien vite lent bien tres aimer "
                 "eau pain soleil pluie temps monde enfant jardin ville jouer lire voir venir"),
    "es": _words("el la los y yo tu nosotros hoy manana casa gato perro rapido lento bien muy gustar "
                 "agua pan sol lluvia tiempo mundo nino jardin ciudad jugar leer ver venir"),
    "it": _words("il la gli e io tu noi oggi domani casa gatto cane veloce lento bene molto amare "
                 "acqua pane sole pioggia tempo mondo bambino giardino citta giocare leggere vedere"),
}
_SUBJECTS = ["the old captain", "my sister", "a small robot", "the teacher", "our neighbour", "the doctor",
             "a tired pilot", "the young painter", "everybody", "nobody here", "the baker", "my friend Paul",
             "the quiet student", "a famous singer", "the farmer", "your brother", "the cat", "Maria"]
_VERBS = ["bought", "painted", "forgot", "carried", "remembered", "found", "opened", "cooked", "followed",
          "described", "borrowed", "repaired", "watched", "sold", "counted", "explained", "dropped", "built"]
_OBJECTS = ["a yellow umbrella", "seven apples", "the broken window", "an enormous map", "the last bus",
            "a box of matches", "three purple balloons", "the kitchen table", "a cup of tea", "the old piano",
            "twelve paper boats", "a wooden bridge", "the morning paper", "two orange cats", "a silver key"]
_PLACES = ["in the garden", "at the station", "before breakfast", "near the river", "after the storm",
                 "on Monday morning", "behind the museum", "at midnight", "during the concert", "by the sea"]
_OPENERS = ["Well,", "Honestly,", "Yesterday", "Oh,", "Listen,", "Believe it or not,", "So", "Luckily", ""]
_QUESTIONS = ["Do you think", "Did you know that", "Can you believe", "Why do you think"]


def sentence(rng: np.random.Generator) -> str:
    """One English sentence (or two) from a small grammar: statements, questions, lists, numbers."""
    def pick(xs: list[str]) -> str:
        return xs[int(rng.integers(len(xs)))]

    kind = rng.integers(5)
    core = f"{pick(_SUBJECTS)} {pick(_VERBS)} {pick(_OBJECTS)} {pick(_PLACES)}"
    if kind == 0:
        text = f"{pick(_OPENERS)} {core}."
    elif kind == 1:
        text = f"{pick(_QUESTIONS)} {core}?"
    elif kind == 2:
        text = f"{core}, and then {pick(_SUBJECTS)} {pick(_VERBS)} {pick(_OBJECTS)}."
    elif kind == 3:
        n = int(rng.integers(2, 999))
        text = f"{pick(_OPENERS)} {pick(_SUBJECTS)} {pick(_VERBS)} {n} things. {pick(_PLACES).capitalize()}!"
    else:
        text = f"{pick(_SUBJECTS).capitalize()} said: no, no, {pick(_OBJECTS)}, please."
    return " ".join(text.split()).strip()


def foreign_sentence(rng: np.random.Generator, lang: str) -> str:
    words = LANGUAGES[lang]
    n = int(rng.integers(5, 12))
    return " ".join(words[int(i)] for i in rng.integers(len(words), size=n)) + "."


@dataclass(frozen=True)
class Utterance:
    text: str
    voice: str
    speed: int  # words per minute
    pitch: int  # 0..99


def sample_utterance(rng: np.random.Generator) -> Utterance:
    """A random sentence with a random voice, speed and pitch (about one in six in another language)."""
    if rng.uniform() < 1 / 6:
        lang = list(LANGUAGES)[int(rng.integers(len(LANGUAGES)))]
        variant = f"+m{rng.integers(1, 8)}" if rng.uniform() < 0.5 else f"+f{rng.integers(1, 5)}"
        return Utterance(foreign_sentence(rng, lang), lang + variant, int(rng.integers(120, 200)),
                         int(rng.integers(20, 80)))
    return Utterance(sentence(rng), VOICES[int(rng.integers(len(VOICES)))], int(rng.integers(120, 210)),
                     int(rng.integers(15, 85)))


def synthesize(utt: Utterance) -> np.ndarray:
    """espeak-ng -> float32 mono 16 kHz PCM."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise RuntimeError("espeak-ng is not installed; on Debian run `apt-get install -y espeak-ng`")
    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "speech.wav"
        subprocess.run([exe, "-v", utt.voice, "-s", str(utt.speed), "-p", str(utt.pitch), "-w", str(wav), utt.text],
                       check=True, capture_output=True, timeout=60)
        pcm = load_audio(wav)
    peak = float(np.abs(pcm).max())
    return (pcm * (0.7 / peak) if peak > 0 else pcm).astype(np.float32)


def frame_envelope(pcm: np.ndarray, frames: int | None = None, fps: int = FPS, floor_db: float = -60.0) -> np.ndarray:
    """Log RMS (dB, floored) of each video frame's samples [f*sr/fps, (f+1)*sr/fps). (frames,) float64."""
    n = frames if frames is not None else len(pcm) * fps // SAMPLE_RATE
    out = np.full(n, floor_db)
    for f in range(n):
        seg = pcm[f * SAMPLE_RATE // fps:(f + 1) * SAMPLE_RATE // fps].astype(np.float64)
        if seg.size:
            out[f] = max(floor_db, 10 * np.log10(np.mean(seg * seg) + 1e-12))
    return out


def motion_tracks(pcm: np.ndarray, frames: int, range_db: float = 30.0) -> tuple[np.ndarray, np.ndarray]:
    """Per-frame mouth opening in [0, 1] and head dy in pixels, from the speech envelope."""
    env = frame_envelope(pcm, frames)
    level = np.clip((env - (env.max() - range_db)) / range_db, 0.0, 1.0)  # 0 at -30 dB from the peak, 1 at it
    mouth = np.zeros(frames)
    state = 0.0
    for f in range(frames):  # quick attack, slower release
        state += (0.75 if level[f] > state else 0.45) * (level[f] - state)
        mouth[f] = state
    slow = np.zeros(frames)
    state = 0.0
    for f in range(frames):
        state += 0.12 * (level[f] - state)
        slow[f] = state
    return mouth, -2.0 * slow
