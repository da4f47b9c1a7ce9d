"""The listing commands: `parity fixtures`, `parity arms`, `parity models` (what a run can name)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import click

from parity.cli_options import MAX_SEED
from parity.errors import UsageError
from parity.textfiles import described


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


def _made(folder: Path) -> bool:
    """Create the (empty or new) folder now, and write a probe into it; True when it was created."""
    created = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise UsageError(f"FOLDER {folder}: cannot be written ({described(err)})") from None
    return created


@click.command()
def arms() -> None:
    """List the arm definitions (name, mode, DeepStack action, description)."""
    from parity.arms import load_arms

    for spec in load_arms().values():
        click.echo(f"{spec.name:22} {spec.mode:6} deepstack={spec.deepstack:7} {spec.description}")


@click.group(invoke_without_command=True)
@click.pass_context
def models(ctx: click.Context) -> None:
    """List the embedded model presets (no download); any Qwen3-VL checkpoint id or path also works.
    A shape preset (a released checkpoint's dimensions, random weights) is listed with its parameters,
    the memory a run needs in float32 and in bfloat16, and which of them a run here uses (--dtype auto:
    float32 on a CPU, bfloat16 on a GPU)."""
    if ctx.invoked_subcommand is not None:
        return
    from parity.presets import PRESETS, gib

    # `--device auto` takes a GPU where torch sees one; the NVIDIA driver's listing says so without
    # importing torch, which a listing must not do.
    gpus = Path("/proc/driver/nvidia/gpus")
    device = "cuda" if gpus.is_dir() and any(gpus.iterdir()) else "cpu"
    here = "bfloat16" if device == "cuda" else "float32"
    click.echo(f"a shape preset's run here ({device}, --dtype auto) is in {here}")
    for preset in PRESETS.values():
        size = ""
        if preset.shape is not None:
            needs = {name: gib(preset.shape.memory(itemsize)[1]) for name, itemsize in (("float32", 4), ("bfloat16", 2))}
            size = (f"{preset.shape.parameters() / 1e9:.2f} B params; a run needs {needs['float32']} in float32, "
                    f"{needs['bfloat16']} in bfloat16 ({needs[here]} here); ")
        click.echo(f"{preset.name:30} {size}{preset.description}")


@models.command("save")
@click.argument("name")
@click.argument("folder", type=click.Path(file_okay=False, path_type=Path))
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where the weights are drawn (a shape preset never passes through host memory).")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
              show_default=True, help="auto: as `parity run` would load it (bfloat16 for a shape preset on a GPU).")
@click.option("--seed", type=click.IntRange(0, MAX_SEED), default=None,
              help="Build from this seed instead of the preset's own.")
@click.option("--deepstack-scale", type=click.FloatRange(0.0, 1.0), default=1.0, show_default=True,
              help="Scale what the DeepStack mergers add (1e-8: a checkpoint whose DeepStack cannot move the "
                   "answer, where only the freshness witness tells a drop; 0 leaves nothing to drop).")
def save_model(name: str, folder: Path, device: str, dtype: str, seed: int | None, deepstack_scale: float) -> None:
    """Save preset NAME as a checkpoint folder (config, safetensors shards, tokenizer, processor), for
    `parity run --model FOLDER`: the path a user's own checkpoint takes."""
    from parity.presets import PRESETS, gib, misspelled_preset
    from parity.run_command import check_writable

    if name not in PRESETS:
        close = misspelled_preset(name)
        raise UsageError(f"NAME {name}: not an embedded preset{f'; did you mean {close}?' if close else ''} "
                         "(`parity models` lists them)")
    check_writable("FOLDER", folder, True)
    if folder.exists() and any(folder.iterdir()):
        raise UsageError(f"FOLDER {folder}: is not empty; give a new or empty folder (nothing is overwritten)")
    from parity.models import resolve_device, resolve_dtype
    from parity.models.shapes import save

    created = _made(folder)  # before the model is built: /proc, /sys or a full disk refuse here
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device, PRESETS[name].shape is None)
    try:
        written = save(name, folder, torch_device, torch_dtype, seed, deepstack_scale)
    except OSError as err:
        if created:
            shutil.rmtree(folder, ignore_errors=True)
        raise UsageError(f"FOLDER {folder}: the checkpoint cannot be written there ({described(err)})") from None
    files = sorted(p for p in written.iterdir() if p.is_file())
    click.echo(f"wrote {written}: {len(files)} files, {gib(sum(p.stat().st_size for p in files))}; "
               f"run it with `parity run --model {written}`")
