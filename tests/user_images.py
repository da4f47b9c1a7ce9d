"""Images as a user draws them to try parity: one flat shape on a plain ground, in sizes and aspect
ratios the built-in fixtures do not have. The bf16 sweep test and scripts/measure_noise.py use the same
ones, so the noise the margins were measured on is the noise the test meets."""

from __future__ import annotations

from PIL import Image, ImageDraw

# (width, height, shape)
DRAWN = ((64, 64, "ellipse"), (200, 120, "rectangle"), (96, 160, "triangle"))
_FILL = {"ellipse": (200, 30, 30), "rectangle": (30, 90, 200), "triangle": (30, 160, 60)}


def drawn(w: int, h: int, shape: str) -> Image.Image:
    image = Image.new("RGB", (w, h), (240, 230, 200))
    draw = ImageDraw.Draw(image)
    box = (w // 8, h // 8, w - w // 8, h - h // 8)
    if shape == "triangle":
        draw.polygon([(w // 2, box[1]), (box[2], box[3]), (box[0], box[3])], fill=_FILL[shape])
    else:
        getattr(draw, shape)(box, fill=_FILL[shape])
    return image
