from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from parity.arms import ARM_ORDER, load_arms, select_arms
from parity.data import data_dir
from parity.errors import UsageError
from parity.fixtures import GENERATORS, builtin_fixture, builtin_fixtures, image_fixture, load_prompts, pixel_sha256


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_committed_png_equals_regenerated_pixels(name):
    committed = Image.open(data_dir("fixtures") / f"{name}.png").convert("RGB")
    fixture = builtin_fixture(name)
    assert committed.size == fixture.size
    assert np.array_equal(np.asarray(committed), np.asarray(fixture.image))
    assert pixel_sha256(committed) == fixture.sha256


def test_fixtures_are_distinct_and_stripes_are_rgb():
    hashes = {f.sha256 for f in builtin_fixtures()}
    assert len(hashes) == len(GENERATORS) >= 3
    pixels = np.asarray(builtin_fixture("rgb-stripes").image)
    assert tuple(pixels[0, 0]) == (255, 0, 0) and tuple(pixels[0, 16]) == (0, 255, 0) and tuple(pixels[0, 32]) == (0, 0, 255)


def test_every_fixture_has_a_prompt():
    prompts = load_prompts()
    assert all(prompts.get(name) for name in GENERATORS)


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
