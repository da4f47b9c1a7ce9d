import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from parity.arms import ARM_ORDER, load_arms, select_arms
from parity.data import data_dir
from parity.errors import UsageError
from parity.media.catalog import builtin_fixture, builtin_names
from parity.media.fixtures import (
    GENERATORS,
    builtin_fixtures,
    default_prompts,
    image_fixture,
    load_prompts,
    pixel_sha256,
)


def prefill_ladder(max_tokens: int = 4096) -> list[int]:
    """SGLang's prefill capture sizes (until parity.runner.buckets lands): a prompt replays in the first >= n."""
    sizes = [*range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64), *range(1280, 4097, 256)]
    return [s for s in sizes if s <= max_tokens]


def prompt_tokens(loaded, fixture, prompt) -> int:
    return int(loaded.adapter.processor_inputs(fixture, prompt.text)["input_ids"].shape[1])


def image_tokens(loaded, fixture) -> int:
    ids = loaded.adapter.processor_inputs(fixture, "x")["input_ids"][0]
    return int((ids == loaded.adapter.config.image_token_id).sum())


@pytest.mark.parametrize("name", builtin_names(twins=True))
def test_committed_png_equals_regenerated_pixels(name):
    committed = Image.open(data_dir("fixtures") / f"{name}.png").convert("RGB")
    fixture = builtin_fixture(name)
    assert committed.size == fixture.size
    assert np.array_equal(np.asarray(committed), np.asarray(fixture.image))
    assert pixel_sha256(committed) == fixture.sha256


def test_fixtures_are_distinct_and_stripes_are_rgb():
    hashes = {builtin_fixture(name).sha256 for name in builtin_names(twins=True)}
    assert len(hashes) == 2 * len(GENERATORS) >= 14
    pixels = np.asarray(builtin_fixture("rgb-stripes").image)
    assert tuple(pixels[0, 0]) == (255, 0, 0) and tuple(pixels[0, 16]) == (0, 255, 0) and tuple(pixels[0, 32]) == (0, 0, 255)


def test_every_fixture_has_a_prompt():
    prompts = load_prompts()
    assert all(prompts.get(name) for name in GENERATORS)
    assert all(default_prompts(f.twin()) == default_prompts(f) for f in builtin_fixtures())


def test_builtin_fixtures_are_the_primaries_and_twins_resolve_by_name():
    assert [f.name for f in builtin_fixtures()] == list(GENERATORS)
    twin = builtin_fixture("mosaic-twin")
    assert twin == builtin_fixture("mosaic").twin() and twin.builtin
    with pytest.raises(UsageError, match="unknown fixture 'plaid-twin'.*NAME-twin"):
        builtin_fixture("plaid-twin")


def test_fixture_sizes_reach_the_bucket_edges(tiny):
    """First prompts land below, exactly on and just past a ladder bucket; images from 4 to 64 tokens."""
    ladder = prefill_ladder()
    firsts = {f.name: prompt_tokens(tiny, f, default_prompts(f)[0]) for f in builtin_fixtures()}
    assert firsts == {"rgb-stripes": 39, "checkerboard": 39, "gradient-circle": 39,
                      "quadrants": 31, "bands": 48, "diagonal-stripes": 49, "mosaic": 94}
    assert firsts["bands"] in ladder  # exact fit: no padded row
    assert firsts["diagonal-stripes"] - 1 in ladder  # one past a bucket: the next one is ...
    assert min(b for b in ladder if b >= firsts["diagonal-stripes"]) == 64  # ... 15 rows of padding
    counts = {f.name: image_tokens(tiny, f) for f in builtin_fixtures()}
    assert counts["quadrants"] == 4 and counts["mosaic"] == 64 and counts["rgb-stripes"] == 12


def _grey(tmp_path: Path) -> Path:
    ys, xs = np.mgrid[0:64, 0:96]
    Image.fromarray(((xs + ys) % 256).astype(np.uint8), mode="L").save(tmp_path / "grey.png")
    return tmp_path / "grey.png"


def test_twins_keep_size_and_token_count_and_change_pixels(tiny, tmp_path: Path):
    Image.fromarray(np.asarray(builtin_fixture("gradient-circle").image)).save(tmp_path / "mine.png")
    user = [image_fixture(tmp_path / "mine.png"), image_fixture(_grey(tmp_path))]
    for fixture in [*builtin_fixtures(), *user]:
        twin = fixture.twin()
        assert twin.name == f"{fixture.name}-twin" and twin.image.mode == "RGB"
        assert twin.size == fixture.size and twin.sha256 != fixture.sha256
        prompt = default_prompts(fixture)[0]
        assert prompt_tokens(tiny, twin, prompt) == prompt_tokens(tiny, fixture, prompt), fixture.name
        # Clearly different content, not a one-pixel change.
        changed = np.any(np.asarray(twin.image) != np.asarray(fixture.image), axis=2).mean()
        assert changed > 0.5, (fixture.name, changed)


def test_user_image_twin_is_a_deterministic_channel_rotation_or_inversion(tmp_path: Path):
    Image.fromarray(np.asarray(builtin_fixture("rgb-stripes").image)).save(tmp_path / "stripes.png")
    twin = image_fixture(tmp_path / "stripes.png").twin()
    assert np.array_equal(np.asarray(twin.image), np.roll(np.asarray(builtin_fixture("rgb-stripes").image), -1, axis=2))
    grey = image_fixture(_grey(tmp_path))
    assert np.array_equal(np.asarray(grey.twin().image), 255 - np.asarray(grey.image))
    assert grey.twin() == grey.twin() and grey.twin().twin().sha256 != grey.twin().sha256


def test_user_image_is_converted_to_rgb_and_hashed_by_pixels(tmp_path: Path):
    rgba = Image.fromarray(np.asarray(builtin_fixture("checkerboard").image)).convert("RGBA")
    rgba.save(tmp_path / "mine.png")
    fixture = image_fixture(tmp_path / "mine.png")
    assert fixture.image.mode == "RGB" and fixture.name == "mine"
    assert fixture.sha256 == builtin_fixture("checkerboard").sha256


def test_non_image_and_missing_image_are_usage_errors(tmp_path: Path):
    (tmp_path / "notes.txt").write_text("not an image")
    with pytest.raises(UsageError, match="not a readable image"):
        image_fixture(tmp_path / "notes.txt")
    with pytest.raises(UsageError, match="no such file"):
        image_fixture(tmp_path / "missing.png")


def test_decompression_bomb_is_a_usage_error(tmp_path: Path, monkeypatch):
    builtin_fixture("mosaic").image.save(tmp_path / "big.png")  # 65,536 pixels
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # over twice the limit: Pillow raises
    with pytest.raises(UsageError, match=r"--image .*big.png: too many pixels"):
        image_fixture(tmp_path / "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 40_000)  # over the limit only: Pillow warns
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with pytest.raises(UsageError, match="too many pixels"):
            image_fixture(tmp_path / "big.png")


def test_arms_load_in_canonical_order_with_sglang_flags():
    arms = load_arms()
    assert tuple(arms) == ARM_ORDER
    for spec in arms.values():
        flag = spec.backend_settings("sglang")["server_args"]
        assert flag == ["--cuda-graph-backend-prefill", "breakable" if spec.mode == "bcg" else "disabled"]


def test_arm_selection():
    assert [a.name for a in select_arms("all")] == list(ARM_ORDER)
    assert [a.name for a in select_arms("bcg_normal, eager_normal")] == ["eager_normal", "bcg_normal"]
    with pytest.raises(UsageError, match="unknown arm nope; known arms: all, eager_normal"):
        select_arms("eager_normal,nope")
