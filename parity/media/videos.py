"""Deterministic test videos (`video-…`) and user videos (`--video PATH`), as `Fixture`s of frames.

A video's identity is the sha256 of its decoded RGB frames (`Fixture.sha256`): containers and
encoders differ in their bytes, decoded pixels do not. The model's processor groups frames in pairs
(`temporal_patch_size` 2) and each pair becomes one temporal patch of visual tokens with its own
timestamp, so frame counts are chosen to land on that: an even count, and an odd one whose last
frame the processor repeats to fill its pair.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image, ImageSequence, UnidentifiedImageError

from parity.errors import UsageError
from parity.media.fixtures import MAX_MEDIA_BYTES, TWIN_SUFFIX, Fixture, blocks
from parity.textfiles import user_bytes

VIDEO_PREFIX = "video-"
FPS = 2.0  # the built-in videos' frame rate: their pairs of frames are one second apart
MAX_FRAMES = 64  # a user video's frames past this are a usage error: CPU runs stay short


def _moving_square() -> list[np.ndarray]:
    """128x96, 4 frames: a white 32 px square crossing a dark blue field left to right."""
    frames = []
    for t in range(4):
        pixels = np.zeros((96, 128, 3), np.uint8)
        pixels[:, :] = (0, 0, 96)
        pixels[32:64, 32 * t:32 * t + 32] = 255
        frames.append(pixels)
    return frames


def _colour_cycle() -> list[np.ndarray]:
    """64x64, 4 frames: the whole picture red, green, blue, then yellow, with a black top-left block."""
    frames = []
    for colour in ((255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0)):
        pixels = blocks([[colour, colour], [colour, colour]])
        pixels[:32, :32] = 0
        frames.append(pixels)
    return frames


def _bouncing_bar() -> list[np.ndarray]:
    """96x64, 5 frames (an odd count: the processor repeats the last to fill its pair): an orange
    bar going down and up over a grey field while the field darkens."""
    frames = []
    for t, row in enumerate((0, 16, 32, 16, 0)):
        pixels = np.full((64, 96, 3), 200 - 30 * t, np.uint8)
        pixels[row:row + 32, 32:64] = (255, 140, 0)
        frames.append(pixels)
    return frames


GENERATORS: dict[str, Callable[[], list[np.ndarray]]] = {
    "video-moving-square": _moving_square,
    "video-colour-cycle": _colour_cycle,
    "video-bouncing-bar": _bouncing_bar,
}


def is_video_name(name: str) -> bool:
    return name.startswith(VIDEO_PREFIX)


def builtin_video(name: str) -> Fixture:
    """A built-in video by name; `<name>-twin` is its frames' twin (same size and count)."""
    primary = name.removesuffix(TWIN_SUFFIX)
    if primary not in GENERATORS:
        raise UsageError(f"unknown video fixture {name!r}; known videos: {', '.join(GENERATORS)} "
                         f"(each also as NAME{TWIN_SUFFIX})")
    video = Fixture.video(primary, (Image.fromarray(f, mode="RGB") for f in GENERATORS[primary]()), FPS, builtin=True)
    return video if primary == name else video.twin()


def builtin_videos() -> list[Fixture]:
    return [builtin_video(name) for name in GENERATORS]


def video_fixture(path: str | Path) -> Fixture:
    """A user video: every frame decoded (PyAV for any container it reads, else Pillow for animated
    GIF, PNG and WebP), converted to RGB."""
    data = user_bytes("--video", path, MAX_MEDIA_BYTES)
    path = Path(path)
    frames, fps = _decode_av(path, data) if has_av() else (None, None)
    if frames is None:
        frames, fps = _decode_pillow(path, data)
    if not frames:
        raise UsageError(f"--video {path}: no frames decoded")
    if len(frames) > MAX_FRAMES:  # decoding stops one frame past the limit: the true count is not known
        raise UsageError(f"--video {path}: more than the {MAX_FRAMES} frames parity takes; cut it shorter")
    if len({f.size for f in frames}) > 1:
        raise UsageError(f"--video {path}: its frames change size ({sorted({f.size for f in frames})})")
    return Fixture.video(path.stem, frames, fps or FPS)


def has_av() -> bool:
    """Whether PyAV is installed: it reads video containers and `write_lossless` writes with it."""
    import importlib.util

    return importlib.util.find_spec("av") is not None


def _decode_av(path: Path, data: bytes) -> tuple[list[Image.Image] | None, float | None]:
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise UsageError(f"--video {path}: the file has no video stream")
            stream = container.streams.video[0]
            rate = float(stream.average_rate) if stream.average_rate else None
            frames = []
            for frame in container.decode(video=0):
                frames.append(frame.to_image().convert("RGB"))
                if len(frames) > MAX_FRAMES:
                    break
            return frames, rate
    except av.FFmpegError:
        return None, None  # not a container FFmpeg reads: Pillow may read it (an animated image)


def _decode_pillow(path: Path, data: bytes) -> tuple[list[Image.Image], float | None]:
    try:
        with Image.open(io.BytesIO(data)) as opened:
            frames = [frame.convert("RGB") for _, frame in zip(range(MAX_FRAMES + 1), ImageSequence.Iterator(opened))]
            duration = opened.info.get("duration")
    except (UnidentifiedImageError, OSError) as err:
        hint = "" if has_av() else "; install PyAV (pip install 'parity[video]') to read video containers (mp4, mkv, webm)"
        raise UsageError(f"--video {path}: not a readable video ({err.__class__.__name__}){hint}") from None
    return frames, (1000.0 / duration if duration else None)


def write_lossless(fixture: Fixture, path: Path, fps: float, even: bool = False) -> None:
    """The video's frames as FFV1 in Matroska (lossless: a decoder returns the RGB frames bit for bit)
    at `fps`; `even` repeats the last frame of an odd count, as the model's processor pads a
    temporal pair, for decoders that would drop it instead."""
    if not has_av():
        raise UsageError(f"sending video {fixture.name!r} to a server writes it with PyAV: pip install 'parity[video]'")
    from fractions import Fraction

    import av

    frames = list(fixture.frames) + ([fixture.frames[-1]] if even and len(fixture.frames) % 2 else [])
    with av.open(str(path), "w", format="matroska") as container:
        stream = container.add_stream("ffv1", rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height = fixture.size
        stream.pix_fmt = "bgr0"  # FFV1's RGB layout: the frames' bytes survive the round trip
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_image(frame.convert("RGB")).reformat(format="bgr0")))
        container.mux(stream.encode())
