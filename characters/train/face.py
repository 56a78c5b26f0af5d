"""A procedural 2-D cartoon face: identities drawn with PIL, whose mouth, jaw and head move per frame.

An `Identity` fixes everything that makes one character look like itself (head shape and position, skin,
hair style and colour, eyes, brows, nose, mouth size, lips, shirt, background); a `Pose` is what changes
from frame to frame (mouth opening, head offset). `render` draws a frame at 2x and box-filters it down, so
edges are anti-aliased the way a camera's would be. The layout is known exactly, so `mouth_box` says where
the mouth is in any frame of an identity: the lip-sync score reads the mouth there.

Frames are (H, W, 3) uint8 at the `tiny` preset's 176x272 unless asked otherwise.
"""

from __future__ import annotations

import colorsys
from dataclasses import asdict, dataclass

import numpy as np
from PIL import Image, ImageDraw

HEIGHT, WIDTH = 176, 272
_SS = 2  # supersampling factor

RGB = tuple[int, int, int]

_SKIN = [(255, 224, 196), (246, 204, 170), (234, 186, 150), (214, 160, 120), (190, 136, 96), (160, 108, 72),
         (128, 84, 56), (100, 64, 44), (255, 214, 170), (232, 196, 160)]
_HAIR = [(20, 16, 14), (66, 40, 26), (92, 58, 38), (130, 84, 44), (196, 150, 80), (230, 200, 120), (160, 60, 30),
         (150, 150, 150), (220, 220, 220), (40, 60, 140), (120, 40, 120)]
_IRIS = [(70, 44, 24), (60, 110, 70), (60, 100, 170), (110, 110, 120), (140, 100, 40)]


@dataclass(frozen=True)
class Identity:
    """Everything fixed for one character (pixel units at 176x272)."""

    cx: float  # head centre
    cy: float
    face_w: float  # half width / half height of the face ellipse
    face_h: float
    skin: RGB
    hair: RGB
    hair_style: int  # 0 cap, 1 long, 2 short crop, 3 bun
    background: RGB
    background2: RGB  # bottom of a vertical gradient
    shirt: RGB
    eye_dx: float  # eye offset from the centre line
    eye_y: float  # relative to cy
    eye_r: float
    iris: RGB
    brow_w: float
    mouth_y: float  # relative to cy
    mouth_w: float  # half width
    max_open: float  # mouth height when fully open
    lips: RGB
    nose: int  # 0 line, 1 dot nostrils, 2 triangle
    cheeks: bool
    ears: bool

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Identity:
        fixed = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
        return cls(**fixed)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Pose:
    """What moves in one frame: mouth opening in [0, 1] and the head's offset in pixels."""

    mouth: float = 0.0
    dx: float = 0.0
    dy: float = 0.0


def _jitter(rng: np.random.Generator, c: RGB, amount: int) -> RGB:
    return tuple(int(np.clip(v + rng.integers(-amount, amount + 1), 0, 255)) for v in c)  # type: ignore[return-value]


def _hsv(rng: np.random.Generator, s: tuple[float, float], v: tuple[float, float]) -> RGB:
    r, g, b = colorsys.hsv_to_rgb(rng.uniform(0, 1), rng.uniform(*s), rng.uniform(*v))
    return int(r * 255), int(g * 255), int(b * 255)


def sample_identity(rng: np.random.Generator) -> Identity:
    """A random character; every field varies, so each reference image differs."""
    face_h = rng.uniform(48, 60)
    face_w = face_h * rng.uniform(0.72, 0.9)
    skin = _jitter(rng, _SKIN[rng.integers(len(_SKIN))], 12)
    bg = _hsv(rng, (0.1, 0.5), (0.55, 0.95))
    return Identity(
        cx=WIDTH / 2 + rng.uniform(-34, 34), cy=HEIGHT / 2 + rng.uniform(-8, 4), face_w=face_w, face_h=face_h,
        skin=skin, hair=_jitter(rng, _HAIR[rng.integers(len(_HAIR))], 14), hair_style=int(rng.integers(4)),
        background=bg, background2=_jitter(rng, bg, 40), shirt=_hsv(rng, (0.3, 0.9), (0.3, 0.9)),
        eye_dx=face_w * rng.uniform(0.32, 0.46), eye_y=-face_h * rng.uniform(0.05, 0.2), eye_r=rng.uniform(4.5, 7.5),
        iris=_jitter(rng, _IRIS[rng.integers(len(_IRIS))], 16), brow_w=rng.uniform(1.2, 3.2),
        mouth_y=face_h * rng.uniform(0.42, 0.56), mouth_w=face_w * rng.uniform(0.28, 0.46),
        max_open=rng.uniform(11, 17), lips=_jitter(rng, (190, 80, 90), 30), nose=int(rng.integers(3)),
        cheeks=bool(rng.integers(2)), ears=bool(rng.integers(4) > 0),
    )


def mouth_box(ident: Identity, margin: float = 3.0) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) pixel rows/columns that hold the mouth in every pose (head motion incl.)."""
    x0, x1 = ident.cx - ident.mouth_w - margin, ident.cx + ident.mouth_w + margin
    y0 = ident.cy + ident.mouth_y - 2 - margin
    y1 = ident.cy + ident.mouth_y + ident.max_open + 2 + margin
    return int(np.floor(y0)), int(np.ceil(y1)), int(np.floor(x0)), int(np.ceil(x1))


def face_box(ident: Identity) -> tuple[int, int, int, int]:
    """(top, bottom, left, right): the face ellipse's bounding box, clipped to the frame."""
    y0, y1 = ident.cy - ident.face_h, ident.cy + ident.face_h
    x0, x1 = ident.cx - ident.face_w, ident.cx + ident.face_w
    return max(0, int(y0)), min(HEIGHT, int(y1)), max(0, int(x0)), min(WIDTH, int(x1))


def _darker(c: RGB, f: float = 0.8) -> RGB:
    return int(c[0] * f), int(c[1] * f), int(c[2] * f)


def render(ident: Identity, pose: Pose = Pose(), height: int = HEIGHT, width: int = WIDTH) -> np.ndarray:
    """One frame (height, width, 3) uint8. The layout is designed at 176x272 and scaled to the size asked."""
    s = _SS * width / WIDTH
    big = (round(width * _SS), round(height * _SS))
    im = Image.new("RGB", big, ident.background)
    d = ImageDraw.Draw(im)
    top, bot = np.array(ident.background, float), np.array(ident.background2, float)
    for y in range(0, big[1], 4):  # vertical gradient in 4-pixel bands (cheap, and smooth after filtering)
        c = top + (bot - top) * y / big[1]
        d.rectangle((0, y, big[0], y + 3), fill=tuple(int(v) for v in c))

    def box(x0: float, y0: float, x1: float, y1: float) -> tuple[float, float, float, float]:
        return x0 * s, y0 * s, x1 * s, y1 * s

    cx0, cy0 = ident.cx, ident.cy
    fw, fh, o = ident.face_w, ident.face_h, float(np.clip(pose.mouth, 0.0, 1.0))
    # shoulders and neck do not move with the head
    d.ellipse(box(cx0 - 2.4 * fw, cy0 + 1.25 * fh, cx0 + 2.4 * fw, cy0 + 3.2 * fh), fill=ident.shirt,
              outline=_darker(ident.shirt), width=int(2 * s))
    d.rectangle(box(cx0 - 0.3 * fw, cy0 + 0.6 * fh, cx0 + 0.3 * fw, cy0 + 1.4 * fh), fill=_darker(ident.skin, 0.88))
    cx, cy = cx0 + pose.dx, cy0 + pose.dy
    jaw = 0.45 * o * ident.max_open
    hair, hair_dark = ident.hair, _darker(ident.hair, 0.75)
    if ident.hair_style == 1:  # long hair behind the head
        d.rounded_rectangle(box(cx - 1.18 * fw, cy - 1.05 * fh, cx + 1.18 * fw, cy + 1.05 * fh), radius=fw * s,
                            fill=hair)
    elif ident.hair_style == 3:  # bun
        d.ellipse(box(cx - 0.45 * fw, cy - 1.45 * fh, cx + 0.45 * fw, cy - 0.8 * fh), fill=hair)
    if ident.ears:
        for side in (-1, 1):
            ex = cx + side * fw * 0.98
            d.ellipse(box(ex - 0.14 * fw, cy - 0.1 * fh, ex + 0.14 * fw, cy + 0.2 * fh), fill=ident.skin,
                      outline=_darker(ident.skin), width=int(s))
    # face: the upper head, plus a jaw ellipse that drops with the mouth
    d.ellipse(box(cx - fw, cy - fh, cx + fw, cy + fh), fill=ident.skin)
    d.ellipse(box(cx - 0.78 * fw, cy + 0.1 * fh, cx + 0.78 * fw, cy + fh + jaw), fill=ident.skin)
    if ident.hair_style in (0, 1, 3):  # fringe
        d.chord(box(cx - 1.04 * fw, cy - 1.08 * fh, cx + 1.04 * fw, cy - 0.05 * fh), start=180, end=360, fill=hair)
    else:  # short crop
        d.chord(box(cx - 0.98 * fw, cy - 1.04 * fh, cx + 0.98 * fw, cy - 0.3 * fh), start=190, end=350, fill=hair)
    d.arc(box(cx - 0.9 * fw, cy - 1.0 * fh, cx + 0.9 * fw, cy - 0.2 * fh), start=200, end=340, fill=hair_dark,
          width=int(s))
    # eyes and brows
    ey, r = cy + ident.eye_y, ident.eye_r
    for side in (-1, 1):
        ex = cx + side * ident.eye_dx
        d.ellipse(box(ex - 1.3 * r, ey - r, ex + 1.3 * r, ey + r), fill=(250, 250, 250), outline=(40, 30, 30),
                  width=int(s))
        d.ellipse(box(ex - 0.7 * r, ey - 0.7 * r, ex + 0.7 * r, ey + 0.7 * r), fill=ident.iris)
        d.ellipse(box(ex - 0.35 * r, ey - 0.35 * r, ex + 0.35 * r, ey + 0.35 * r), fill=(16, 12, 12))
        d.line(box(ex - 1.5 * r, ey - 1.8 * r, ex + 1.5 * r, ey - 2.0 * r + side), fill=hair_dark,
               width=max(1, int(ident.brow_w * s)))
        if ident.cheeks:
            d.ellipse(box(ex - 1.2 * r, ey + 2.2 * r, ex + 1.2 * r, ey + 3.2 * r),
                      fill=_blend(ident.skin, (240, 120, 120)))
    # nose
    ny = cy + 0.5 * (ident.eye_y + ident.mouth_y)
    if ident.nose == 0:
        d.line(box(cx, ny - 6, cx - 2, ny + 2), fill=_darker(ident.skin, 0.7), width=int(s))
    elif ident.nose == 1:
        for side in (-1, 1):
            d.ellipse(box(cx + side * 2.5 - 1, ny, cx + side * 2.5 + 1, ny + 2), fill=_darker(ident.skin, 0.6))
    else:
        d.polygon([(cx * s, (ny - 5) * s), ((cx - 3) * s, (ny + 2) * s), ((cx + 3) * s, (ny + 2) * s)],
                  fill=_darker(ident.skin, 0.85))
    # mouth: a lip line when closed; an open mouth is a dark hole with a tongue, ringed by the lips
    my, mw = cy + ident.mouth_y, ident.mouth_w * (1 - 0.15 * o)
    h = o * ident.max_open
    if h < 1.5:
        d.line(box(cx - mw, my, cx + mw, my), fill=ident.lips, width=int(2.2 * s))
    else:
        d.ellipse(box(cx - mw - 1.5, my - 1.5, cx + mw + 1.5, my + h + 1.5), fill=ident.lips)
        d.ellipse(box(cx - mw, my, cx + mw, my + h), fill=(46, 14, 22))
        d.chord(box(cx - 0.6 * mw, my + 0.5 * h, cx + 0.6 * mw, my + 1.3 * h), start=180, end=360,
                fill=(150, 56, 66))
    out = im.resize((width, height), Image.Resampling.BOX)
    return np.array(out, dtype=np.uint8)


def _blend(a: RGB, b: RGB, f: float = 0.35) -> RGB:
    return tuple(int(x * (1 - f) + y * f) for x, y in zip(a, b, strict=True))  # type: ignore[return-value]
