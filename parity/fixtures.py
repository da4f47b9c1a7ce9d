"""Deterministic RGB test images and their prompts.

A fixture's identity is the sha256 of its raw RGB pixel bytes plus its size: PNG encoders differ
in their bytes, pixels do not.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image, UnidentifiedImageError

from parity.data import data_dir
from parity.errors import UsageError

WIDTH, HEIGHT = 128, 96
DEFAULT_FIXTURE = "rgb-stripes"


@dataclass(frozen=True)
class Fixture:
    name: str
    image: Image.Image  # always mode RGB

    @property
    def size(self) -> tuple[int, int]:
        return self.image.size

    @property
    def sha256(self) -> str:
        return pixel_sha256(self.image)


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str


def pixel_sha256(image: Image.Image) -> str:
    return hashlib.sha256(image.convert("RGB").tobytes()).hexdigest()


def _stripes() -> np.ndarray:
    """Vertical red, green and blue stripes, 16 px wide."""
    pixels = np.zeros((HEIGHT, WIDTH, 3), dtype=np.uint8)
    for x in range(WIDTH):
        pixels[:, x, (x // 16) % 3] = 255
    return pixels


def _checkerboard() -> np.ndarray:
    """Black and white 16 px squares with a yellow top-left square."""
    ys, xs = np.mgrid[0:HEIGHT, 0:WIDTH]
    white = ((ys // 16 + xs // 16) % 2 == 0).astype(np.uint8) * 255
    pixels = np.repeat(white[:, :, None], 3, axis=2)
    pixels[:16, :16] = (255, 255, 0)
    return pixels


def _gradient_circle() -> np.ndarray:
    """A horizontal blue-to-orange gradient with a white disc in the middle."""
    ys, xs = np.mgrid[0:HEIGHT, 0:WIDTH]
    t = xs / (WIDTH - 1)
    pixels = np.stack([255 * t, 128 * t, 255 * (1 - t)], axis=2).round().astype(np.uint8)
    disc = (xs - WIDTH / 2) ** 2 + (ys - HEIGHT / 2) ** 2 <= (HEIGHT / 4) ** 2
    pixels[disc] = 255
    return pixels


GENERATORS: dict[str, Callable[[], np.ndarray]] = {
    "rgb-stripes": _stripes,
    "checkerboard": _checkerboard,
    "gradient-circle": _gradient_circle,
}


def builtin_fixture(name: str) -> Fixture:
    if name not in GENERATORS:
        raise UsageError(f"unknown fixture {name!r}; known fixtures: {', '.join(GENERATORS)}")
    return Fixture(name, Image.fromarray(GENERATORS[name](), mode="RGB"))


def builtin_fixtures() -> list[Fixture]:
    return [builtin_fixture(name) for name in GENERATORS]


def image_fixture(path: str | Path) -> Fixture:
    """A user image, converted to RGB and hashed like the built-in ones."""
    path = Path(path)
    try:
        with Image.open(path) as opened:
            image = opened.convert("RGB")
    except FileNotFoundError:
        raise UsageError(f"--image {path}: no such file") from None
    except (UnidentifiedImageError, OSError) as err:
        raise UsageError(f"--image {path}: not a readable image ({err.__class__.__name__})") from None
    return Fixture(path.stem, image)


def load_prompts() -> dict[str, tuple[Prompt, ...]]:
    """Prompts per fixture name, from fixtures/prompts.json."""
    raw = json.loads((data_dir("fixtures") / "prompts.json").read_text())
    return {name: tuple(Prompt(p["id"], p["text"]) for p in items) for name, items in raw.items()}


def default_prompts(fixture: Fixture) -> tuple[Prompt, ...]:
    """The fixture's own prompts; a user image gets the generic ones."""
    prompts = load_prompts()
    return prompts.get(fixture.name, prompts["*"])


def write_pngs(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for fixture in builtin_fixtures():
        path = folder / f"{fixture.name}.png"
        fixture.image.save(path, format="PNG")
        paths.append(path)
    return paths
