"""How an image or a video reaches a server: the file parity writes, the body that names it, the
prompt ids a scoring request sends, and the rows the evidence calls visual (no engine needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from parity.backends.protocol import Request
from parity.engines.prompts import ChatPrompts, MediaFiles
from parity.engines.sglang import client
from parity.errors import UsageError
from parity.evidence import image_span
from parity.media.catalog import builtin_fixture
from parity.media.videos import builtin_video

av = pytest.importorskip("av")


@pytest.fixture(scope="module")
def prompts(tiny) -> ChatPrompts:
    return ChatPrompts(tiny.adapter.processor)


def decoded(path: str) -> list[np.ndarray]:
    with av.open(path) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def test_a_video_is_written_losslessly_once_and_padded_to_whole_pairs_when_asked(tmp_path: Path) -> None:
    odd = builtin_video("video-bouncing-bar")
    assert len(odd.frames) % 2 == 1
    plain = MediaFiles(tmp_path / "plain").path(odd)
    padded_files = MediaFiles(tmp_path / "padded", video_fps=2.0, even_frames=True)
    padded = padded_files.path(odd)
    expected = [np.asarray(frame.convert("RGB")) for frame in odd.frames]
    assert all((a == b).all() for a, b in zip(decoded(plain), expected, strict=True))
    frames = decoded(padded)
    assert len(frames) == len(expected) + 1 and (frames[-1] == expected[-1]).all()
    assert all((a == b).all() for a, b in zip(frames, expected))
    stamp = Path(padded).stat().st_mtime_ns
    assert padded_files.path(odd) == padded and Path(padded).stat().st_mtime_ns == stamp
    assert Path(padded).is_absolute() and odd.sha256[:12] in padded
    even = builtin_video("video-moving-square")
    assert len(decoded(padded_files.path(even))) == len(even.frames)  # an even count is left as it is


def test_an_image_is_still_a_png_and_text_alone_is_no_file(tmp_path: Path) -> None:
    files = MediaFiles(tmp_path)
    assert files.path(builtin_fixture("rgb-stripes")).endswith(".png") and files.path(None) is None


def test_the_body_names_the_field_for_its_kind() -> None:
    assert client.media_data("/a/v.mkv", is_video=True) == {"video_data": "/a/v.mkv"}
    assert client.media_data("/a/i.png", is_video=False) == {"image_data": "/a/i.png"}
    assert client.media_data(None, is_video=False) == {}
    body = client.generate_body("t", client.media_data("/a/v.mkv", True), 4, rid="g")
    assert body["video_data"] == "/a/v.mkv" and "image_data" not in body
    score = client.score_body([1, 2], [3], expanded_length=30, media={}, rid="s")
    assert "video_data" not in score and "image_data" not in score and score["logprob_start_len"] == 29


def test_a_scoring_prompt_sends_one_placeholder_where_the_generation_had_many(prompts, tiny) -> None:
    from parity.models.qwen3_vl import video_inputs

    processor = tiny.adapter.processor
    ids = {name: processor.tokenizer.convert_tokens_to_ids(name)
           for name in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
    image, video = builtin_fixture("rgb-stripes"), builtin_video("video-moving-square")
    for fixture, pad, visual in ((image, "<|image_pad|>", {"images": [image.image]}),
                                 (video, "<|video_pad|>", video_inputs(video, processor))):
        request = Request(fixture, "Describe it.")
        expanded = processor(text=[prompts.text(request)], **visual)["input_ids"][0]
        sent = list(prompts.scoring_ids(request, expanded))
        at = sent.index(ids[pad])
        assert expanded.count(ids[pad]) > 1 and sent.count(ids[pad]) == 1
        assert sent[at - 1] == ids["<|vision_start|>"] and sent[at + 1] == ids["<|vision_end|>"]
        # Around the placeholder, the prompt is the generation's own.
        assert sent[:at - 1] == expanded[:at - 1] and sent[at + 2:] == expanded[len(expanded) - len(sent) + at + 2:]


def test_a_scoring_answer_is_checked_against_the_generations_prompt() -> None:
    from parity.engines.http import ServerRejected

    entries = [[None, 5, None], [-0.5, 7, None], [-0.25, 8, None]]
    doc = {"prompt_token_ids": [1, 2, 3, 7, 8], "meta_info": {"input_token_logprobs": entries}}
    assert client.parse_scores(doc, [7, 8], expanded=[1, 2, 3]) == (-0.5, -0.25)
    # The answer's text tokenized into other tokens (a video's ids go through text): no score.
    assert client.parse_scores(doc | {"prompt_token_ids": [1, 2, 3, 7, 9]}, [7, 8], expanded=[1, 2, 3]) is None
    assert client.parse_scores(doc | {"prompt_token_ids": [1, 2, 3, 78]}, [7, 8], expanded=[1, 2, 3]) is None
    # The placeholder expanded otherwise than for the generation: the positions cannot be trusted.
    with pytest.raises(ServerRejected, match="expanded the prompt otherwise"):
        client.parse_scores(doc | {"prompt_token_ids": [1, 2, 4, 7, 8]}, [7, 8], expanded=[1, 2, 3])


def test_a_videos_planned_length_is_its_processor_expansion_with_every_frame(prompts, tiny) -> None:
    from parity.models.qwen3_vl import video_inputs

    video = builtin_video("video-bouncing-bar")
    request = Request(video, "Describe it.")
    processor = tiny.adapter.processor
    expanded = processor(text=[prompts.text(request)], **video_inputs(video, processor))["input_ids"][0]
    assert prompts.length(request) == len(expanded)
    pad = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    rows = [i for i, token in enumerate(expanded) if token == pad]
    assert image_span(expanded, prompts.visual_token_ids) == (rows[0], rows[-1] + 1)
    # Three temporal pairs (five frames, the last repeated), one group of rows each.
    assert sum(1 for a, b in zip(rows, rows[1:]) if b != a + 1) == 2


def test_a_processor_without_a_video_placeholder_is_a_usage_error(tiny) -> None:
    class NoVideo:
        def __init__(self, processor) -> None:
            self.tokenizer = processor.tokenizer
            self.image_token = processor.image_token
            self.apply_chat_template = processor.apply_chat_template

    prompts = ChatPrompts(NoVideo(tiny.adapter.processor))
    with pytest.raises(UsageError, match="no video placeholder"):
        prompts.text(Request(builtin_video("video-moving-square"), "Describe it."))


def test_a_prefix_hit_that_covers_every_visual_row_leaves_no_deepstack_for_the_tap(prompts, tiny) -> None:
    from types import SimpleNamespace

    from parity.engines.channel import TapEntry
    from parity.engines.engine import EngineBackend
    from parity.engines.evidence import TaggedRequest, TapSilence, check_fired

    pad = tiny.adapter.processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    ids = [201, 202, pad, pad, 203, pad, pad, 204, 205, 206]  # visual rows [2, 7)
    engine = SimpleNamespace(prompts=prompts, cached_tokens=lambda doc: doc.get("cached"))
    video = Request(builtin_video("video-moving-square"), "Describe it.")

    def computes(doc: dict, request: Request = video) -> bool:
        return EngineBackend.computes_visual_rows(engine, request, doc, ids)

    assert computes({}) and computes({"cached": 6})  # a hit that ends inside the rows leaves some
    assert not computes({"cached": 7}) and not computes({"cached": 8})
    assert not computes({}, Request(None, "Hi"))
    # The suffix's prefill, with no DeepStack rows seen: fine after a hit over every row; where rows
    # were left to compute, the tap was silent (the negative control).
    suffix = (TapEntry("t", 7, "sglang::scheduler", True, 4, 4, False, None),)
    check_fired(TaggedRequest(10, computes({"cached": 8}), suffix), 3, "request")
    with pytest.raises(TapSilence, match="no DeepStack rows"):
        check_fired(TaggedRequest(10, computes({"cached": 6}), suffix), 3, "request")
