"""Media in and out: the reference image, and MP4 files with H.264 video and AAC audio.

Reference image rules (`load_image`):

- Anything Pillow decodes (PNG, JPEG, WebP, GIF: first frame, BMP, TIFF...) from a path or bytes.
- Refused with `MediaError`: unreadable or non-image input, truncated files (the whole image is decoded
  up front), images over `max_pixels` (checked from the header before decoding, so a decompression bomb
  costs nothing), and images smaller than 16x16.
- The EXIF orientation is applied. Transparency (RGBA, LA, palette with a transparent colour) is
  composited over white; grayscale, CMYK and other modes become RGB; 16-bit and float grayscale are
  scaled to 8 bits (16-bit: /257; float: [0, 1] -> [0, 255]).
- Framing (`frame_reference`): the largest face OpenCV's bundled frontal-face Haar cascade finds decides it.
  The head (the face box widened for the ears, raised for the hair, lowered for the chin; as far as the picture
  has it) must be inside the frame: today's centre crop when it already is (a picture of the frame's aspect
  is never reframed); else a crop of the same size moved to hold it; else (a
  portrait in a landscape frame) a box of the target's aspect around the head that reaches past the picture,
  the part outside extended (edge pixels, blurred). Never a crop through the head. No face found: the centre
  crop, and `Framing.face_found` is False (callers say so).
- Resize rule: one Lanczos resample of the chosen source box (the centred *cover* box: scale to cover the
  target, aspect ratio kept, then centre-crop to exactly (height, width)).

`Mp4Writer` writes H.264 (yuv420p; libx264 when this PyAV build has it) and mono AAC at 48 kHz, with
exact timestamps: frame i is at i / fps, audio sample n at n / 16000, so chunks of frames and their
audio can be written interleaved.
"""

from __future__ import annotations

import io
import math
import threading
from dataclasses import dataclass
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
FACE_CASCADE = "haarcascade_frontalface_default.xml"  # in opencv-python-headless's wheel (cv2.data.haarcascades)
DETECT_SIDE = 640  # faces are looked for on a copy whose longer side is at most this
# the head around a Haar face box (x, y, w, h), in face widths/heights: ears, hair above, chin and neck below
HEAD_LEFT, HEAD_RIGHT, HEAD_TOP, HEAD_BOTTOM = 0.35, 0.35, 0.6, 0.35
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


Box = tuple[float, float, float, float]  # (left, top, right, bottom) in pixels


@dataclass(frozen=True)
class Framing:
    """How `frame_reference` framed a picture."""

    face_found: bool
    face_box: tuple[int, int, int, int] | None  # (x, y, w, h) of the face in the framed image's pixels
    extended: bool  # the frame reaches past the picture: that part is extended from its edges

    def describe(self) -> str:
        if not self.face_found:
            return "no face found in the reference image: centre-cropped (the head may be cut); use a frontal portrait"
        how = "extended past the picture's edges" if self.extended else "cropped"
        return f"face found at {self.face_box} (x, y, w, h): head kept whole, {how}"


_LOCAL = threading.local()


def _cascade() -> Any:
    """This thread's face cascade, loaded once (its XML parse costs more than a detection)."""
    import cv2

    if not hasattr(_LOCAL, "cascade"):
        path = Path(cv2.data.haarcascades) / FACE_CASCADE  # type: ignore[attr-defined]
        _LOCAL.cascade = cv2.CascadeClassifier(str(path))
    return _LOCAL.cascade


def detect_face(rgb: np.ndarray) -> tuple[int, int, int, int] | None:
    """The largest frontal face in `(H, W, 3)` uint8 RGB as (x, y, w, h) pixels, or None (OpenCV's Haar cascade)."""
    import cv2  # opencv-python-headless: the cascade ships in its wheel

    h, w = rgb.shape[:2]
    scale = min(1.0, DETECT_SIDE / max(h, w))
    gray = cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2GRAY)
    if scale < 1.0:
        gray = cv2.resize(gray, (max(1, round(w * scale)), max(1, round(h * scale))), interpolation=cv2.INTER_AREA)
    cascade = _cascade()
    side = max(24, min(gray.shape) // 8)
    faces = cascade.detectMultiScale(gray, scaleFactor=1.1, minNeighbors=5, minSize=(side, side))
    if len(faces) == 0:
        return None
    x, y, fw, fh = max((tuple(int(v) for v in f) for f in faces), key=lambda f: f[2] * f[3])
    return round(x / scale), round(y / scale), round(fw / scale), round(fh / scale)


def _head_box(face: tuple[int, int, int, int]) -> Box:
    x, y, w, h = face
    return x - HEAD_LEFT * w, y - HEAD_TOP * h, x + (1 + HEAD_RIGHT) * w, y + (1 + HEAD_BOTTOM) * h


def _place(lo: float, size: float, head_lo: float, head_hi: float, src: float) -> float:
    """Start of a `size` span along one axis holding [head_lo, head_hi]: inside [0, src] where it fits there."""
    if size >= src:  # reaches past the picture on this axis: centre the head, then stay as inside as it can
        start = (head_lo + head_hi - size) / 2
        return min(max(start, src - size), 0.0)
    return min(max(lo, head_hi - size, 0.0), head_lo, src - size) if head_hi - head_lo <= size else \
        (head_lo + head_hi - size) / 2


def _frame_box(src_w: int, src_h: int, width: int, height: int, face: tuple[int, int, int, int] | None) -> Box:
    """The source box (target aspect) that becomes the frame: the cover box, moved or grown to hold the head."""
    cover = _cover_box(src_w, src_h, width, height)
    if face is None:
        return cover
    hl, ht, hr, hb = _head_box(face)
    hl, ht, hr, hb = max(hl, 0.0), max(ht, 0.0), min(hr, float(src_w)), min(hb, float(src_h))  # what the picture has
    cl, ct, cr, cb = cover
    if cl <= hl and ct <= ht and hr <= cr and hb <= cb:
        return cover
    aspect = width / height
    bh = max(cb - ct, hb - ht, (hr - hl) / aspect)  # never smaller than today's crop
    bw = bh * aspect
    left = _place(cl, bw, hl, hr, src_w)
    top = _place(ct, bh, ht, hb, src_h)
    return left, top, left + bw, top + bh


def _extend(im: Image.Image, box: Box, height: int, width: int) -> tuple[np.ndarray, bool]:
    """Resample `box` of `im` to (height, width); where the box lies outside the picture, its edge pixels
    extended and blurred (a soft continuation, not streaks)."""
    left, t, r, b = box
    pl, pt = max(0, math.ceil(-left)), max(0, math.ceil(-t))
    pr, pb = max(0, math.ceil(r - im.width)), max(0, math.ceil(b - im.height))
    if not (pl or pt or pr or pb):
        whole = im.resize((width, height), Image.Resampling.LANCZOS, box=box, reducing_gap=3.0)
        return np.asarray(whole, dtype=np.uint8), False
    import cv2

    src = np.pad(np.asarray(im, dtype=np.uint8), ((pt, pb), (pl, pr), (0, 0)), mode="edge")  # (H+p, W+p, 3)
    shifted = (left + pl, t + pt, r + pl, b + pt)
    out: np.ndarray = np.asarray(Image.fromarray(src).resize((width, height), Image.Resampling.LANCZOS, box=shifted,
                                                 reducing_gap=3.0), dtype=np.uint8)  # (H, W, 3)
    sx, sy = width / (r - left), height / (b - t)  # frame pixels per source pixel
    inside: np.ndarray = np.zeros((height, width), np.float32)  # 1 where the frame shows the picture itself
    x0, y0 = round(-left * sx), round(-t * sy)
    x1, y1 = round((im.width - left) * sx), round((im.height - t) * sy)
    inside[max(0, y0):max(0, y1), max(0, x0):max(0, x1)] = 1.0
    soft = max(2.0, 0.02 * max(height, width))
    inside = cv2.GaussianBlur(inside, (0, 0), soft)[..., None] * (inside[..., None] > 0)  # fades only outward
    blurred = cv2.GaussianBlur(out.astype(np.float32), (0, 0), 3 * soft)
    mixed = out * inside + blurred * (1 - inside)
    return np.clip(mixed + 0.5, 0, 255).astype(np.uint8), True


def load_image(source: str | Path | bytes, height: int, width: int, max_pixels: int = 40_000_000) -> np.ndarray:
    """Decode a reference image to `(height, width, 3)` uint8 RGB by the rules in the module docstring."""
    return frame_reference(source, height, width, max_pixels)[0]


def frame_reference(source: str | Path | bytes, height: int, width: int,
                    max_pixels: int = 40_000_000) -> tuple[np.ndarray, Framing]:
    """`load_image`, and how the picture was framed (`Framing`: whether a face was found, where it is)."""
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
    face = detect_face(np.asarray(im, dtype=np.uint8))
    box = _frame_box(im.width, im.height, width, height, face)
    arr, extended = _extend(im, box, height, width)  # (H, W, 3)
    framed: tuple[int, int, int, int] | None = None
    if face is not None:
        sx, sy = width / (box[2] - box[0]), height / (box[3] - box[1])
        x, y, w, h = face
        framed = (round((x - box[0]) * sx), round((y - box[1]) * sy), round(w * sx), round(h * sy))
    return np.ascontiguousarray(arr), Framing(face is not None, framed, extended)


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
