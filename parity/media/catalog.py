"""Every built-in fixture by name, images and videos alike: what `--fixture` and a results file's
fixture names resolve to. It stands above `fixtures` (images) and `videos`, so neither imports the
other."""

from __future__ import annotations

from parity.media.fixtures import GENERATORS, TWIN_SUFFIX, TWINS, Fixture, builtin_image
from parity.media.videos import GENERATORS as VIDEOS
from parity.media.videos import builtin_video, is_video_name


def builtin_fixture(name: str) -> Fixture:
    """A built-in image or video by name, or its twin as `<name>-twin`."""
    return builtin_video(name) if is_video_name(name) else builtin_image(name)


def builtin_names(twins: bool = False, videos: bool = False) -> list[str]:
    """The built-in images' names (and their twins'; and the built-in videos' and theirs)."""
    names = [*GENERATORS, *(f"{name}{TWIN_SUFFIX}" for name in TWINS if twins)]
    return names + [*VIDEOS, *(f"{name}{TWIN_SUFFIX}" for name in VIDEOS if twins)] if videos else names
