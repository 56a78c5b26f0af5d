"""Generate the bundled sample assets in characters/assets/.

    python scripts/make_assets.py            # both files
    python scripts/make_assets.py --synthetic-speech   # force the formant synthesiser

- `sample_face.png`: a 512x512 cartoon face drawn with PIL (flat colours, so the PNG stays small). The
  head sits in the central band that survives a cover-crop to the landscape presets (e.g. 176x272).
- `sample_speech.wav`: ~9 s of 16 kHz mono 16-bit speech from `espeak-ng` (Debian: `apt-get install
  espeak-ng`); without it, or with `--synthetic-speech`, speech-like audio is synthesised instead
  (voiced formant vowels, a syllabic envelope and pauses). Both paths are deterministic for a given
  espeak-ng version, and rerunning overwrites the files.
"""

from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from characters.audio import SAMPLE_AUDIO, SAMPLE_RATE, convert_pcm, pcm16_to_float  # noqa: E402
from characters.media import SAMPLE_IMAGE  # noqa: E402

TEXT = (
    "Hello! I am a real time video character. I listen to your voice and answer with my face, "
    "twenty four frames every second. Shall we talk?"
)

SKIN, SKIN_DARK = (246, 204, 170), (222, 170, 136)
HAIR, HAIR_DARK = (92, 58, 38), (66, 40, 26)
SHIRT, SHIRT_DARK = (52, 110, 180), (38, 84, 142)
BACKGROUND = (196, 226, 236)


def draw_face(size: int = 512) -> Image.Image:
    """A front-facing cartoon head and shoulders, drawn on a 512 grid and scaled to `size`."""
    im = Image.new("RGB", (512, 512), BACKGROUND)
    d = ImageDraw.Draw(im)
    d.ellipse((-40, 430, 552, 760), fill=SHIRT, outline=SHIRT_DARK, width=4)  # shoulders
    d.rectangle((222, 360, 290, 450), fill=SKIN_DARK)  # neck
    d.polygon([(220, 440), (256, 486), (292, 440)], fill=SKIN_DARK)  # collar opening
    d.ellipse((140, 78, 372, 250), fill=HAIR)  # hair behind the head
    d.ellipse((146, 212, 176, 282), fill=SKIN, outline=SKIN_DARK, width=3)  # ears
    d.ellipse((336, 212, 366, 282), fill=SKIN, outline=SKIN_DARK, width=3)
    d.ellipse((164, 108, 348, 390), fill=SKIN, outline=SKIN_DARK, width=3)  # face
    d.chord((152, 84, 360, 250), start=180, end=360, fill=HAIR)  # fringe
    d.polygon(
        [(170, 170), (200, 132), (236, 170), (270, 128), (300, 168), (344, 170), (344, 150), (168, 150)], fill=HAIR
    )
    d.arc((160, 84, 352, 260), start=200, end=340, fill=HAIR_DARK, width=4)
    for cx in (214, 298):  # eyes: white, iris, pupil, highlight, lid line
        d.ellipse((cx - 26, 218, cx + 26, 256), fill=(255, 255, 255), outline=(60, 40, 30), width=3)
        d.ellipse((cx - 14, 222, cx + 14, 252), fill=(70, 120, 70))
        d.ellipse((cx - 7, 229, cx + 7, 245), fill=(20, 20, 20))
        d.ellipse((cx + 1, 229, cx + 7, 235), fill=(255, 255, 255))
        d.line((cx - 30, 198, cx + 26, 192) if cx < 256 else (cx - 26, 192, cx + 30, 198), fill=HAIR_DARK, width=7)
    d.line((256, 246, 248, 294, 262, 296), fill=SKIN_DARK, width=4, joint="curve")  # nose
    d.ellipse((184, 284, 220, 306), fill=(244, 170, 160))  # cheeks
    d.ellipse((292, 284, 328, 306), fill=(244, 170, 160))
    d.chord((214, 300, 298, 356), start=0, end=180, fill=(150, 40, 50), outline=(110, 30, 40), width=3)  # mouth
    d.rectangle((230, 328, 282, 334), fill=(255, 255, 255))  # teeth
    d.chord((238, 336, 274, 356), start=0, end=180, fill=(226, 100, 110))  # tongue
    return im if size == 512 else im.resize((size, size), Image.Resampling.LANCZOS)


def espeak_speech(text: str) -> np.ndarray | None:
    """Speech from espeak-ng as float32 mono 16 kHz, or None when espeak-ng is not installed."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        return None
    wav = subprocess.run(
        [exe, "-v", "en-us", "-s", "160", "-p", "55", "--stdout", text], check=True, capture_output=True
    ).stdout
    with wave.open(io.BytesIO(wav)) as w:
        rate, channels, width = w.getframerate(), w.getnchannels(), w.getsampwidth()
        frames = w.readframes(w.getnframes())
    if width != 2:
        raise RuntimeError(f"espeak-ng wrote {8 * width}-bit audio; expected 16-bit")
    return convert_pcm(pcm16_to_float(frames), rate, channels)


VOWELS = {  # first three formants (Hz) of a few vowels
    "a": (730, 1090, 2440),
    "e": (530, 1840, 2480),
    "i": (270, 2290, 3010),
    "o": (570, 840, 2410),
    "u": (300, 870, 2240),
}


def synthetic_speech(seconds: float = 9.0, seed: int = 7) -> np.ndarray:
    """Speech-like audio: glottal pulses through vowel formant resonators, syllable envelopes and pauses."""
    rng = np.random.default_rng(seed)
    sr = SAMPLE_RATE
    out = np.zeros(int(seconds * sr), np.float32)
    pos = int(0.3 * sr)
    while pos < out.size - sr // 2:
        for _ in range(int(rng.integers(3, 8))):  # a phrase of syllables
            n = int(rng.uniform(0.14, 0.26) * sr)
            if pos + n >= out.size:
                break
            t = np.arange(n) / sr
            f0 = rng.uniform(110, 150) * (1 + 0.08 * np.sin(2 * np.pi * rng.uniform(2, 4) * t))  # pitch contour
            phase = np.cumsum(f0) / sr
            source = (phase % 1.0) - 0.5  # sawtooth glottal source, rich in harmonics
            formants = VOWELS[str(rng.choice(list(VOWELS)))]
            spec = np.fft.rfft(source)
            freqs = np.fft.rfftfreq(n, 1 / sr)
            gain = sum(np.exp(-0.5 * ((freqs - f) / (60 + 0.05 * f)) ** 2) / (k + 1) for k, f in enumerate(formants))
            voiced = np.fft.irfft(spec * gain, n)
            env = np.sin(np.pi * np.arange(n) / n) ** 1.5  # syllabic envelope
            out[pos : pos + n] += (voiced * env).astype(np.float32)
            pos += n + int(rng.uniform(0.02, 0.06) * sr)
        pos += int(rng.uniform(0.3, 0.6) * sr)  # pause between phrases
    return (0.5 * out / max(float(np.abs(out).max()), 1e-9)).astype(np.float32)


def write_wav(path: Path, pcm: np.ndarray) -> None:
    ints = np.round(np.clip(pcm, -1.0, 1.0) * 32767.0).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(ints.tobytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--synthetic-speech", action="store_true", help="skip espeak-ng, synthesise instead")
    args = parser.parse_args()
    SAMPLE_IMAGE.parent.mkdir(parents=True, exist_ok=True)
    draw_face().save(SAMPLE_IMAGE, optimize=True)
    speech = None if args.synthetic_speech else espeak_speech(TEXT)
    source = "espeak-ng"
    if speech is None:
        speech, source = synthetic_speech(), "synthetic formants"
    else:
        peak = float(np.abs(speech).max())
        speech = speech * (0.7 / peak) if peak > 0 else speech  # normalise to -3 dBFS
    write_wav(SAMPLE_AUDIO, speech)
    for path in (SAMPLE_IMAGE, SAMPLE_AUDIO):
        print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size / 1024:.0f} KiB)")
    print(f"speech: {speech.size / SAMPLE_RATE:.2f} s from {source}")


if __name__ == "__main__":
    main()
