"""Reference-image rules and the MP4 writer."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from characters.audio import chunk_sample_range
from characters.media import SAMPLE_IMAGE, MediaError, Mp4Writer, load_image, read_mp4


def encode(im: Image.Image, fmt: str = "PNG", **kw: object) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kw)
    return buf.getvalue()


def is_red(px: np.ndarray) -> np.ndarray:
    return (px[..., 0] > 200) & (px[..., 1] < 60) & (px[..., 2] < 60)


# ------------------------------------------------------------------------------------------ resize rule


def test_wide_image_is_scaled_to_cover_and_centre_cropped() -> None:
    arr = np.full((100, 400, 3), 255, np.uint8)
    arr[:, 190:210] = (255, 0, 0)  # centre stripe, 20 of 400 columns
    arr[:, :20] = (0, 0, 255)  # left edge band: cropped away
    out = load_image(encode(Image.fromarray(arr)), height=64, width=64)
    assert out.shape == (64, 64, 3) and out.dtype == np.uint8
    # Cover: scale 0.64 (height 100 -> 64), width 256, crop columns 96..160, stripe -> 25.6..38.4.
    red_cols = np.where(is_red(out).all(axis=0))[0]
    assert red_cols.tolist() == list(range(26, 38))  # the columns the stripe fully covers, centred on 31.5
    assert (out[:, :20] > 240).all() and (out[:, 45:] > 240).all()  # white either side, no edge band


def test_tall_image_crops_top_and_bottom() -> None:
    arr = np.full((400, 100, 3), 255, np.uint8)
    arr[195:205] = (255, 0, 0)  # centre row stripe
    out = load_image(encode(Image.fromarray(arr)), height=32, width=64)
    assert out.shape == (32, 64, 3)
    # Cover: scale 0.64 (width 100 -> 64), height 256, crop rows 112..144, stripe rows 124.8..131.2 -> 12.8..19.2
    red_rows = np.where(is_red(out).all(axis=1))[0]
    assert red_rows.tolist() == [13, 14, 15, 16, 17, 18]
    assert (out[:10] > 240).all() and (out[22:] > 240).all()


@pytest.mark.parametrize(("h", "w"), [(176, 272), (480, 832), (17, 33), (704, 1088)])
def test_output_size_is_exact(h: int, w: int) -> None:
    out = load_image(SAMPLE_IMAGE, h, w)
    assert out.shape == (h, w, 3) and out.flags.c_contiguous


# ----------------------------------------------------------------------------------------- colour modes


def test_rgba_is_composited_on_white() -> None:
    rgba = np.zeros((32, 96, 4), np.uint8)
    rgba[:, :32] = (255, 0, 0, 0)  # transparent red -> white
    rgba[:, 32:64] = (0, 0, 255, 255)  # opaque blue
    rgba[:, 64:] = (0, 0, 0, 128)  # half-transparent black -> mid grey
    out = load_image(encode(Image.fromarray(rgba, "RGBA")), 32, 96)
    assert (out[:, 2:30] == 255).all()
    assert (out[:, 34:62] == (0, 0, 255)).all()
    assert np.abs(out[:, 66:94].astype(int) - 127).max() <= 1


def test_palette_transparency_grayscale_cmyk_and_16bit() -> None:
    pal = Image.new("P", (32, 32), 0)
    pal.putpalette([255, 0, 0, 0, 255, 0] + [0] * 762)
    pal.info["transparency"] = 0
    assert (load_image(encode(pal, transparency=0), 32, 32) == 255).all()
    gray = load_image(encode(Image.new("L", (32, 32), 77)), 16, 16)
    assert (gray == 77).all()
    cmyk = load_image(encode(Image.new("CMYK", (32, 32), (0, 255, 255, 0)), "JPEG", quality=95), 16, 16)
    assert is_red(cmyk).all()
    deep = Image.fromarray(np.full((32, 32), 65535, np.uint16))
    assert (load_image(encode(deep), 16, 16) == 255).all()


def test_exif_orientation_is_applied() -> None:
    arr = np.zeros((32, 64, 3), np.uint8)
    arr[:, :32] = (255, 0, 0)  # stored left half red, right half blue
    arr[:, 32:] = (0, 0, 255)
    im = Image.fromarray(arr)
    exif = im.getexif()
    exif[0x0112] = 6  # display rotated 90 degrees clockwise: the left half ends on top
    out = load_image(encode(im, exif=exif), 64, 32)
    assert is_red(out[:28]).all()
    assert (out[36:, :, 2] > 200).all() and (out[36:, :, 0] < 60).all()


# --------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_images_are_refused(fmt: str) -> None:
    noise = np.random.default_rng(0).integers(0, 256, (128, 128, 3), dtype=np.uint8)
    data = encode(Image.fromarray(noise), fmt)
    with pytest.raises(MediaError, match="cannot decode image"):
        load_image(data[: len(data) // 2], 64, 64)


def test_non_images_and_missing_files_are_refused(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello, I am not an image\n")
    with pytest.raises(MediaError, match=r"cannot decode image .*notes\.txt"):
        load_image(text, 64, 64)
    with pytest.raises(MediaError, match="does not exist"):
        load_image(tmp_path / "missing.png", 64, 64)
    with pytest.raises(MediaError, match="cannot decode image"):
        load_image(b"", 64, 64)


def test_tiny_images_are_refused() -> None:
    with pytest.raises(MediaError, match="8x20, smaller than the minimum 16x16"):
        load_image(encode(Image.new("RGB", (8, 20))), 64, 64)


def test_decompression_bomb_is_refused_before_decoding() -> None:
    data = bytearray(encode(Image.new("RGB", (64, 64), (10, 20, 30))))
    assert data[12:16] == b"IHDR"
    for side, match in [
        (7000, "7000x7000 = 49000000 pixels, over the limit of 40000000"),  # refused by our header check
        (100_000, "too large to decode safely"),  # refused by Pillow's own bomb check inside open()
    ]:
        data[16:24] = struct.pack(">II", side, side)  # the header claims side x side pixels
        data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
        with pytest.raises(MediaError, match=match):
            load_image(bytes(data), 64, 64)
    with pytest.raises(MediaError, match="over the limit of 1000"):
        load_image(encode(Image.new("RGB", (64, 64))), 64, 64, max_pixels=1000)


def test_sample_face_is_bundled() -> None:
    out = load_image(SAMPLE_IMAGE, 176, 272)
    assert out.std() > 20  # a drawing, not a flat colour


# -------------------------------------------------------------------------------------------------- mp4


def test_mp4_round_trip(tmp_path: Path) -> None:
    h, w, fc = 176, 272, 4
    path = tmp_path / "clip.mp4"
    levels = np.arange(72) * 3  # frame i is a flat grey of level 3i
    with Mp4Writer(path, width=w, height=h) as writer:
        for k in range(18):  # chunk by chunk: 4 frames, then the matching ~2667 samples
            frames = np.broadcast_to(levels[k * fc : (k + 1) * fc, None, None, None], (fc, h, w, 3))
            writer.write_frames(frames.astype(np.uint8))
            start, end = chunk_sample_range(k, fc)
            writer.write_audio((0.3 * np.sin(2 * np.pi * 440 * np.arange(start, end) / 16000)).astype(np.float32))
    assert writer.frames_written == 72 and writer.samples_written == 48000
    frames, fps, audio, rate = read_mp4(path)
    assert frames.shape == (72, h, w, 3) and frames.dtype == np.uint8
    assert fps == 24.0
    assert abs(audio.size / rate - 3.0) < 0.03
    assert np.abs(frames.reshape(72, -1).mean(axis=1) - levels).max() < 4
    rms = float(np.sqrt(np.mean(audio[rate // 10 : -rate // 10] ** 2)))
    assert rms == pytest.approx(0.3 / np.sqrt(2), rel=0.05)


def test_mp4_writer_checks_its_inputs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="even"):
        Mp4Writer(tmp_path / "odd.mp4", width=33, height=32)
    writer = Mp4Writer(tmp_path / "x.mp4", width=32, height=32)
    with pytest.raises(ValueError, match=r"\(F, 32, 32, 3\) uint8"):
        writer.write_frames(np.zeros((1, 32, 32, 3), np.float32))
    writer.write_frames(np.zeros((2, 32, 32, 3), np.uint8))
    writer.close()
    writer.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        writer.write_frames(np.zeros((1, 32, 32, 3), np.uint8))
    frames, _, audio, _ = read_mp4(tmp_path / "x.mp4")
    assert frames.shape == (2, 32, 32, 3) and audio.size == 0


def test_a_portrait_is_framed_with_the_whole_head() -> None:
    """The square sample face in a landscape frame: today's centre crop cuts through the hair; the face framing
    keeps the head (face box widened and raised by the head margins, as far as the picture has it) inside the
    frame, the sides extended; framing the framed picture again changes nothing."""
    from characters.media import HEAD_BOTTOM, HEAD_LEFT, HEAD_RIGHT, HEAD_TOP, detect_face, frame_reference

    out, framing = frame_reference(SAMPLE_IMAGE, 176, 272)
    assert out.shape == (176, 272, 3) and framing.face_found and framing.extended
    assert framing.face_box is not None
    src = np.asarray(Image.open(SAMPLE_IMAGE).convert("RGB"))
    found = detect_face(src)
    assert found is not None
    _, sy, sw, sh = found
    x, y, w, _ = framing.face_box
    scale = w / sw  # frame pixels per picture pixel
    head_top = max(0.0, sy - HEAD_TOP * sh)  # the head's extent in the picture, where the picture has it
    head_bottom = min(src.shape[0], sy + (1 + HEAD_BOTTOM) * sh)
    assert y - (sy - head_top) * scale >= -1 and y + (head_bottom - sy) * scale <= 177
    assert x - HEAD_LEFT * w >= -1 and x + (1 + HEAD_RIGHT) * w <= 273
    again, second = frame_reference(encode(Image.fromarray(out)), 176, 272)
    assert second.face_found and not second.extended and np.array_equal(again, out)
    # the extension continues the light-blue background: the frame's left and right columns are the picture's
    edge = np.concatenate([src[:, 0], src[:, -1]]).astype(np.float64).mean(axis=0)
    sides = np.concatenate([out[:, 0], out[:, -1]]).astype(np.float64).mean(axis=0)
    assert np.abs(sides - edge).max() < 6, (sides, edge)


def test_no_face_is_framed_as_before_and_says_so() -> None:
    from characters.media import _cover_box, frame_reference

    rng = np.random.default_rng(3)
    arr = rng.integers(0, 256, (90, 200, 3), dtype=np.uint8)
    out, framing = frame_reference(encode(Image.fromarray(arr)), 48, 64)
    assert not framing.face_found and framing.face_box is None and not framing.extended
    assert "no face found" in framing.describe()
    box = _cover_box(200, 90, 64, 48)
    want = np.asarray(Image.fromarray(arr).resize((64, 48), Image.Resampling.LANCZOS, box=box, reducing_gap=3.0))
    assert np.array_equal(out, want)
