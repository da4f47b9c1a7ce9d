"""Video requests: the built-in `video-…` fixtures, user videos (`--video PATH`), Qwen3-VL's video
path (frames paired into temporal patches, DeepStack on the video rows, positions per patch), and
the verdicts: fixed PASS, the planted bugs FAIL, on video as on images."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from parity.errors import UsageError
from parity.media.catalog import builtin_fixture
from parity.media.fixtures import default_prompts
from parity.media.videos import GENERATORS, builtin_video, builtin_videos, video_fixture

# The built-in videos' identities (integer pixel arithmetic: the same on every machine).
PINNED = {
    "video-moving-square": "5b56b59d4ea89e166efcdf85616920faff0300f9a47930200ee4ed8d49035681",
    "video-colour-cycle": "6f31c350e5795e2aa93364f854679354dd7d4091f07254c25e2f2874a6102f7e",
    "video-bouncing-bar": "3e33875097feb8465a850cd4259865421d3e09a4c905edfc6706590cd9f4a96c",
}


def test_builtin_videos_are_pinned_distinct_and_their_twins_keep_the_shape():
    assert {v.name: v.sha256 for v in builtin_videos()} == PINNED
    for video in builtin_videos():
        twin = builtin_fixture(f"{video.name}-twin")
        assert twin.is_video and twin.size == video.size and len(twin.frames) == len(video.frames)
        assert twin.sha256 != video.sha256 and default_prompts(twin) == default_prompts(video)
        assert len({np.asarray(f).tobytes() for f in video.frames}) == len(video.frames)  # every frame moves
    assert sorted(len(v.frames) % 2 for v in builtin_videos()) == [0, 0, 1]  # one odd count: a padded pair


def test_a_video_is_identified_by_its_frames_not_its_first_image():
    video = builtin_video("video-colour-cycle")
    one_frame = type(video).video("one", video.frames[:1], 2.0)
    assert one_frame.sha256 != builtin_fixture("rgb-stripes").sha256
    assert one_frame.sha256 != type(video)("one", video.frames[0]).sha256  # an image of the same pixels


def test_unknown_video_names_list_the_known_ones():
    with pytest.raises(UsageError, match="known videos: video-moving-square"):
        builtin_video("video-nope")


@pytest.mark.parametrize("name", list(GENERATORS))
def test_the_video_path_pairs_frames_into_temporal_patches_with_deepstack_on_their_rows(tiny, name):
    adapter = tiny.adapter
    video = builtin_video(name)
    inputs = adapter.processor_inputs(video, "What happens?")
    t, h, w = inputs["video_grid_thw"][0].tolist()
    assert t == (len(video.frames) + 1) // 2  # two frames a temporal patch, an odd last one padded
    prompt = adapter.prepare(video, "What happens?")
    rows = prompt.input_ids == adapter.config.video_token_id
    assert prompt.visual_token == adapter.config.video_token_id
    assert int(rows.sum()) == t * h * w // 4  # 2x2 spatial merge
    assert not (prompt.input_ids == adapter.config.image_token_id).any()
    nonzero = prompt.deepstack.abs().sum(dim=1) > 0
    assert torch.equal(nonzero, rows)
    # Each temporal patch starts the next time position: the video's rows do not all share one.
    assert len(set(prompt.positions[0, rows].tolist())) == t


def test_a_user_video_file_decodes_to_the_frames_it_holds(tmp_path):
    av = pytest.importorskip("av")
    frames = builtin_video("video-bouncing-bar").frames
    path = tmp_path / "bar.mkv"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("ffv1", rate=4)  # lossless: the decoded pixels are the source's
        stream.width, stream.height, stream.pix_fmt = frames[0].size[0], frames[0].size[1], "bgr0"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_image(frame)))
        container.mux(stream.encode())
    decoded = video_fixture(path)
    assert decoded.name == "bar" and decoded.fps == 4.0
    assert decoded.sha256 == builtin_video("video-bouncing-bar").sha256


def test_an_animated_gif_is_a_video_without_pyav(tmp_path, monkeypatch):
    import parity.media.videos as videos

    monkeypatch.setattr(videos, "has_av", lambda: False)
    frames = [Image.new("RGB", (64, 64), colour) for colour in ("red", "green", "blue")]
    path = tmp_path / "flags.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=500, loop=0)
    video = video_fixture(path)
    assert len(video.frames) == 3 and video.fps == 2.0
    assert [video.frames[i].getpixel((0, 0)) for i in range(3)] == [(255, 0, 0), (0, 128, 0), (0, 0, 255)]


@pytest.mark.parametrize("content, message", [
    (b"not a video", "not a readable video"),
    (None, "no such file"),
])
def test_bad_video_files_are_usage_errors(parity_cli, tmp_path, content, message):
    path = tmp_path / "clip.mp4"
    if content is not None:
        path.write_bytes(content)
    result = parity_cli("run", "--device", "cpu", "--video", str(path), "--out", str(tmp_path / "out"))
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_too_many_frames_is_a_usage_error(tmp_path):
    frames = [Image.new("RGB", (32, 32), (i, 0, 0)) for i in range(70)]
    path = tmp_path / "long.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100)
    with pytest.raises(UsageError, match="more than the 64 frames parity takes"):
        video_fixture(path)


def test_fixed_passes_and_legacy_drops_deepstack_on_a_video(parity_cli):
    fixed, doc, out = parity_cli.run("--video", "video-bouncing-bar", "--max-new-tokens", "6")
    assert fixed.exit_code == 0 and doc["verdict"]["code"] == "PASS", fixed.output
    case = doc["cases"][0]
    assert case["fixture"]["frames"] == 5 and case["fixture"]["name"] == "video-bouncing-bar"
    assert "video `video-bouncing-bar` 96×64, 5 frames" in (out / "report.md").read_text()
    legacy, doc, _ = parity_cli.run("--video", "video-bouncing-bar", "--max-new-tokens", "6", "--runner", "legacy",
                                    name="legacy")
    assert legacy.exit_code == 1 and doc["verdict"]["code"] == "FAIL_DEEPSTACK_DROPPED", legacy.output


@pytest.mark.parametrize("runner, scenario, verdict", [
    ("no-clear", "stream", "FAIL_STALE_STATE"),
    ("chunk-misaligned", "chunked", "FAIL_DEEPSTACK_DROPPED"),
    ("prefix-offset", "prefix", "FAIL_DEEPSTACK_DROPPED"),  # the freshness witness: rows written wrong
    ("layout-keyed", "layout", "FAIL_INPUT_NOT_FRESH"),  # the witness: the encoder graph's grid is another's
])
def test_every_planted_bug_fails_its_scenario_on_a_video(parity_cli, runner, scenario, verdict):
    result, doc, _ = parity_cli.run("--video", "video-moving-square", "--scenario", scenario, "--runner", runner,
                                    "--max-new-tokens", "4")
    assert result.exit_code == 1 and doc["verdict"]["code"] == verdict, result.output


def test_a_user_video_run_localizes_with_the_video_given_again(parity_cli, tmp_path):
    frames = [Image.fromarray(255 - f) for f in GENERATORS["video-moving-square"]()]  # no built-in's pixels
    path = tmp_path / "clip.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=500, loop=0)
    result, doc, out = parity_cli.run("--video", str(path), "--runner", "legacy", "--max-new-tokens", "4")
    assert result.exit_code == 1, result.output
    missing = parity_cli("localize", str(out / "results.json"))
    assert missing.exit_code == 2 and "pass it with --video PATH" in missing.output
    found = parity_cli("localize", str(out / "results.json"), "--video", str(path), "--json")
    assert found.exit_code == 0, found.output
    assert json.loads(found.output)


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
def test_a_server_without_pyav_to_write_the_video_is_refused_before_starting_anything(parity_cli, tmp_path,
                                                                                       monkeypatch, backend):
    import parity.media.videos

    monkeypatch.setattr(parity.media.videos, "has_av", lambda: False)
    result = parity_cli("run", "--backend", backend, "--video", "video-colour-cycle", "--out", str(tmp_path / "o"))
    assert result.exit_code == 2 and "pip install 'parity[video]'" in result.output, result.output
    assert not (tmp_path / "o").exists()


def test_parity_fixtures_lists_the_videos_with_their_frames(parity_cli):
    result = parity_cli("fixtures")
    for video in builtin_videos():
        assert f"{len(video.frames)} frames" in result.output and video.sha256 in result.output
