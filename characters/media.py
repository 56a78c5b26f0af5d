"""Media in and out: the reference image, and MP4 files with H.264 video and AAC audio.

Reference image rules (`load_image`):

- Anything Pillow decodes (PNG, JPEG, WebP, GIF: first frame, BMP, TIFF...) from a path or bytes.
- Refused with `MediaError`: unreadable or non-image input, truncated files (the whole image is decoded
  up front), images over `max_pixels` (checked from the header before decoding, so a decompression bomb
  costs nothing), and images smaller than 16x16.
- The EXIF orientation is applied. Transparency (RGBA, LA, palette with a transparent colour) is
  composited over white; grayscale, CMYK and other modes become RGB; 16-bit and float grayscale are
  scaled to 8 bits (16-bit: /257; float: [0, 1] -> [0, 255]).
- Resize rule: scale to *cover* the target (aspect ratio kept, Lanczos), then centre-crop to exactly
  (height, width). Done as one resample of the centred source box with the target's aspect ratio.

`Mp4Writer` writes H.264 (yuv420p; libx264 when this PyAV build has it) and mono AAC at 48 kHz, with
exact timestamps: frame i is at i / fps, audio sample n at n / 16000, so chunks of frames and their
audio can be written interleaved.
"""

from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image, ImageOps

if TYPE_CHECKING:
    import av  # PyAV is imported where media is encoded or decoded: the chunk path itself needs none

SAMPLE_IMAGE = Path(__file__).parent / "assets" / "sample_face.png"

MIN_IMAGE_SIDE = 16
AAC_SAMPLE_RATE = 48000
H264_ENCODERS = ("libx264", "h264", "libopenh264")


class MediaError(ValueError):
    """Input media that cannot be used: the message says what was wrong and what to do."""


def _describe(source: str | Path | bytes) -> str:
    return f"<{len(source)} bytes>" if isinstance(source, bytes) else str(source)


# ----------------------------------------------------------------------------------------------- images


def _to_rgb(im: Image.Image) -> Image.Image:
    """Any Pillow mode -> RGB, transparency composited over white."""
    if im.mode == "P":
        im = im.convert("RGBA" if "transparency" in im.info else "RGB")
    if im.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N"):
        arr = np.asarray(im, dtype=np.float64) / 257.0
        im = Image.fromarray(np.clip(arr + 0.5, 0, 255).astype(np.uint8), mode="L")
    elif im.mode == "F":
        arr = np.asarray(im, dtype=np.float64) * 255.0
        im = Image.fromarray(np.clip(arr + 0.5, 0, 255).astype(np.uint8), mode="L")
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return im if im.mode == "RGB" else im.convert("RGB")


def _cover_box(src_w: int, src_h: int, width: int, height: int) -> tuple[float, float, float, float]:
    """The centred source box with the target's aspect ratio: scale-to-cover then centre-crop."""
    if src_w * height > width * src_h:  # source wider than target: crop the sides
        crop_w = src_h * width / height
        left = (src_w - crop_w) / 2
        return left, 0.0, left + crop_w, float(src_h)
    crop_h = src_w * height / width  # source taller (or same aspect): crop top and bottom
    top = (src_h - crop_h) / 2
    return 0.0, top, float(src_w), top + crop_h


def load_image(source: str | Path | bytes, height: int, width: int, max_pixels: int = 40_000_000) -> np.ndarray:
    """Decode a reference image to `(height, width, 3)` uint8 RGB by the rules in the module docstring."""
    if height < 1 or width < 1:
        raise ValueError(f"target size height={height}, width={width} must be positive")
    what = _describe(source)
    fp: Any = io.BytesIO(source) if isinstance(source, bytes) else source
    try:
        with Image.open(fp) as opened:
            src_w, src_h = opened.size
            if src_w * src_h > max_pixels:
                raise MediaError(
                    f"image {what} is {src_w}x{src_h} = {src_w * src_h} pixels, over the limit of {max_pixels}; "
                    "downscale it before uploading"
                )
            opened.load()  # decode everything now: a truncated file fails here, not later
            im = _to_rgb(ImageOps.exif_transpose(opened))
    except MediaError:
        raise
    except FileNotFoundError as e:
        raise MediaError(f"image file {what} does not exist; check the path") from e
    except Image.DecompressionBombError as e:
        raise MediaError(
            f"image {what} is too large to decode safely ({e}); the limit is {max_pixels} pixels, "
            "downscale it before uploading"
        ) from e
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        # UnidentifiedImageError (an OSError) for non-images; OSError "image file is truncated"; broken chunks.
        raise MediaError(f"cannot decode image {what}: {e}; provide a complete PNG, JPEG or WebP file") from e
    if min(im.size) < MIN_IMAGE_SIDE:
        raise MediaError(
            f"image {what} is {im.width}x{im.height}, smaller than the minimum {MIN_IMAGE_SIDE}x{MIN_IMAGE_SIDE}; "
            "use a larger reference image"
        )
    box = _cover_box(im.width, im.height, width, height)
    out = im.resize((width, height), Image.Resampling.LANCZOS, box=box, reducing_gap=3.0)
    arr = np.asarray(out, dtype=np.uint8)  # (H, W, 3)
    return np.ascontiguousarray(arr)


# ------------------------------------------------------------------------------------------------- MP4


def h264_encoder() -> str:
    """The first H.264 encoder this PyAV build has, in order of preference."""
    import av

    for name in H264_ENCODERS:
        try:
            av.codec.Codec(name, "w")
        except (av.FFmpegError, ValueError):  # ValueError/UnknownCodecError: not in this build
            continue
        return name
    raise RuntimeError(f"this PyAV build has none of the H.264 encoders {H264_ENCODERS}; install av with libx264")


class Mp4Writer:
    """H.264 + AAC MP4 writer. Frames and audio may be interleaved chunk by chunk.

    `write_frames` takes `(F, H, W, 3)` uint8 RGB; `write_audio` takes float32 mono 16 kHz PCM.
    """

    def __init__(self, path: str | Path, width: int, height: int, fps: int = 24, sample_rate: int = 16000) -> None:
        import av

        if width % 2 or height % 2:
            raise ValueError(f"video size {width}x{height} must be even in both sides for yuv420p; crop one pixel")
        self.path = Path(path)
        self.width, self.height, self.fps, self.sample_rate = width, height, fps, sample_rate
        self.encoder = h264_encoder()
        self._container = av.open(str(self.path), mode="w")
        video = self._container.add_stream(self.encoder, rate=fps)
        if not isinstance(video, av.VideoStream):
            raise RuntimeError(f"codec {self.encoder} did not give a video stream")
        self._video = video
        self._video.width, self._video.height, self._video.pix_fmt = width, height, "yuv420p"
        self._video.codec_context.time_base = Fraction(1, fps)
        if self.encoder == "libx264":
            self._video.options = {"preset": "veryfast", "crf": "20"}
        self._audio = self._container.add_stream("aac", rate=AAC_SAMPLE_RATE)
        self._audio.layout = "mono"
        self._audio.bit_rate = 128_000
        self._audio.codec_context.time_base = Fraction(1, AAC_SAMPLE_RATE)
        self._resampler: av.AudioResampler | None = None
        self._frames_written = 0
        self._samples_in = 0  # 16 kHz samples received
        self._samples_out = 0  # 48 kHz samples sent to the encoder
        self._closed = False

    @property
    def frames_written(self) -> int:
        return self._frames_written

    @property
    def samples_written(self) -> int:
        """Input (sample_rate) samples received by `write_audio`."""
        return self._samples_in

    def write_frames(self, frames: np.ndarray) -> None:
        """Append `(F, H, W, 3)` uint8 RGB frames."""
        import av

        self._check_open()
        want = (self.height, self.width, 3)
        if frames.ndim != 4 or frames.shape[1:] != want or frames.dtype != np.uint8:
            raise ValueError(f"frames must be (F, {want[0]}, {want[1]}, 3) uint8, got {frames.shape} {frames.dtype}")
        for rgb in frames:  # (H, W, 3)
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
            frame.pts = self._frames_written
            frame.time_base = Fraction(1, self.fps)
            self._mux(self._video.encode(frame))
            self._frames_written += 1

    def write_audio(self, pcm: np.ndarray) -> None:
        """Append float32 mono PCM at `sample_rate` (values are clipped to [-1, 1])."""
        import av

        self._check_open()
        if pcm.ndim != 1:
            raise ValueError(f"audio must be mono 1-D float32 PCM, got shape {pcm.shape}")
        if pcm.size == 0:
            return
        if self._resampler is None:
            self._resampler = av.AudioResampler(
                format="fltp", layout="mono", rate=AAC_SAMPLE_RATE, frame_size=self._audio.codec_context.frame_size
            )
        samples = np.clip(pcm.astype(np.float32, copy=False), -1.0, 1.0)[None, :]  # (1, n)
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples), format="flt", layout="mono")
        frame.sample_rate = self.sample_rate
        frame.pts = self._samples_in
        frame.time_base = Fraction(1, self.sample_rate)
        self._samples_in += pcm.size
        self._encode_audio(self._resampler.resample(frame))

    def _encode_audio(self, frames: list[av.AudioFrame]) -> None:
        for out in frames:
            out.pts = self._samples_out
            out.time_base = Fraction(1, AAC_SAMPLE_RATE)
            self._samples_out += out.samples
            self._mux(self._audio.encode(out))

    def _mux(self, packets: list[av.Packet]) -> None:
        for packet in packets:
            self._container.mux(packet)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"Mp4Writer for {self.path} is closed")

    def close(self) -> None:
        """Flush both encoders and finish the file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._resampler is not None:
                self._encode_audio(self._resampler.resample(None))
            self._mux(self._video.encode(None))
            self._mux(self._audio.encode(None))
        finally:
            self._container.close()

    def __enter__(self) -> Mp4Writer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def read_mp4(path: str | Path) -> tuple[np.ndarray, float, np.ndarray, int]:
    """Decode an MP4: `(frames (F, H, W, 3) uint8, fps, audio float32 mono, sample_rate)`.

    A file without audio gives an empty audio array and sample rate 0.
    """
    import av

    with av.open(str(path)) as container:
        video = container.streams.video[0]
        fps = float(video.average_rate or video.guessed_rate or 0)
        size = (video.codec_context.height, video.codec_context.width)
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video)]  # each (H, W, 3)
    audio = np.zeros(0, np.float32)
    rate = 0
    with av.open(str(path)) as container:
        if container.streams.audio:
            stream = container.streams.audio[0]
            rate = stream.codec_context.sample_rate
            resampler = av.AudioResampler(format="flt", layout="mono", rate=rate, options={"rematrix_maxval": "1.0"})
            parts = [o.to_ndarray()[0] for f in container.decode(stream) for o in resampler.resample(f)]
            parts += [o.to_ndarray()[0] for o in resampler.resample(None)]
            audio = np.concatenate(parts).astype(np.float32) if parts else audio
            if stream.duration is not None and stream.time_base is not None:  # drop the last frame's padding
                audio = audio[: round(stream.duration * stream.time_base * rate)]
    stacked = np.stack(frames) if frames else np.zeros((0, *size, 3), np.uint8)
    return stacked, fps, audio, rate
