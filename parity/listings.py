"""The listing commands: `parity fixtures`, `parity arms`, `parity models` (what a run can name)."""

from __future__ import annotations

from pathlib import Path

import click

from parity.errors import UsageError


@click.command()
@click.option("--write", "write_dir", help="Write the image fixtures as PNG files into this folder.")
def fixtures(write_dir: str | None) -> None:
    """List the built-in fixtures: images (`--fixture`) and videos (`--video`), each with its size,
    frames, sha256 of its raw RGB pixels (a video's: of its decoded frames), its twin's, and its prompts."""
    from parity.media.fixtures import builtin_fixtures, load_prompts, write_pngs
    from parity.run_command import check_writable
    from parity.media.videos import builtin_videos

    if write_dir:  # before the listing: a folder that cannot be written is the one line said
        check_writable("--write", Path(write_dir), True)
    prompts = load_prompts()
    for fixture in [*builtin_fixtures(), *builtin_videos()]:
        size = "{}x{}".format(*fixture.size)
        frames = f"{len(fixture.frames)} frames" if fixture.is_video else "image"
        ids = ", ".join(p.id for p in prompts.get(fixture.name, ()))
        click.echo(f"{fixture.name:20} {size:8} {frames:9} {fixture.sha256}  twin {fixture.twin().sha256[:12]}…  "
                   f"prompts: {ids}")
    if write_dir:
        try:
            for path in write_pngs(write_dir):
                click.echo(f"wrote {path}")
        except OSError as err:
            raise UsageError(f"--write {write_dir}: cannot write there ({err.strerror or err})") from None


@click.command()
def arms() -> None:
    """List the arm definitions (name, mode, DeepStack action, description)."""
    from parity.arms import load_arms

    for spec in load_arms().values():
        click.echo(f"{spec.name:22} {spec.mode:6} deepstack={spec.deepstack:7} {spec.description}")


@click.command()
def models() -> None:
    """List the embedded model presets (no download); any Qwen3-VL checkpoint id or path also works."""
    from parity.presets import PRESETS

    for preset in PRESETS.values():
        click.echo(f"{preset.name:26} {preset.description}")
