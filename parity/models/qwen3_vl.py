"""Input preparation for a loaded Qwen3-VL: prompt, image features, positions, dense DeepStack.

Eager and graph arms share everything here; only the LM body call differs (transformers backend).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from parity.errors import UsageError
from parity.media.audio import AudioClip
from parity.media.fixtures import Fixture
from parity.runner.lm_body import Qwen3VLTextBody


@dataclass(frozen=True)
class PreparedPrompt:
    input_ids: torch.Tensor  # [T] long
    input_embeds: torch.Tensor  # [T, H]
    positions: torch.Tensor  # [3, T] long (mRoPE t/h/w)
    deepstack: torch.Tensor | None  # [T, H * n], zero outside visual rows; None without image/video or n == 0
    visual_token: int | None = None  # the placeholder id of its image or video rows; None for text


def chat_text(processor, fixture: Fixture | None, prompt: str, audio: bool = False) -> str:
    """One user turn through the model's own chat template: the image or video placeholder (and
    the audio's), then the prompt.

    Every backend builds its prompts here, so they all send the model the same text.
    """
    content = ([{"type": fixture.kind}] if fixture is not None else []) + ([{"type": "audio"}] if audio else [])
    content += [{"type": "text", "text": prompt}]
    messages = [{"role": "user", "content": content}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


class _FlatThinker:
    """A Qwen3-Omni thinker as transformers kept it before 5.24 (5.17-5.20 measured): its vision
    and audio towers and rope index on the thinker itself, its text model as `.model`. Seen here
    with the layout later releases and Qwen3-VL share: `.language_model` beside the towers."""

    def __init__(self, thinker: nn.Module) -> None:
        self._thinker = thinker
        self.language_model = thinker.model

    def __getattr__(self, name: str):
        return getattr(self._thinker, name)


def vision_language_core(model: nn.Module):
    """The part of a Qwen3-VL-style model that holds `visual`, `language_model` (and an Omni
    thinker's `audio_tower`) and computes the rope index, in either transformers layout."""
    core = model.model
    return core if hasattr(core, "language_model") else _FlatThinker(model)


class Qwen3VLAdapter:
    """The pieces of a Hugging Face Qwen3-VL that parity drives, and how requests become LM inputs."""

    def __init__(self, model: nn.Module, processor) -> None:
        core = vision_language_core(model)
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.config = model.config
        self.visual = core.visual
        self.embed_tokens = core.language_model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        self._core = core
        self.deepstack_count = len(self.config.vision_config.deepstack_visual_indexes)
        self.body = Qwen3VLTextBody(core.language_model, self.deepstack_count)
        self.hidden_size = self.body.hidden_size
        self.eos_token_ids = _eos_ids(model)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def visual_token_id(self, fixture: Fixture | None) -> int | None:
        """The placeholder token the processor expands for this request's image or video."""
        if fixture is None:
            return None
        return self.config.video_token_id if fixture.is_video else self.config.image_token_id

    @property
    def max_positions(self) -> int:
        return int(self.config.text_config.max_position_embeddings)

    @property
    def takes_audio(self) -> bool:
        return hasattr(self._core, "audio_tower")

    def processor_inputs(self, fixture: Fixture | None, prompt: str, audio: AudioClip | None = None) -> dict:
        """What the model's own processor makes of the request (also fed to HF `generate` in tests).

        A request the processor refuses (an image too small or too elongated for its patching) is
        bad input, not a runtime failure: a `UsageError` naming the image.
        """
        media = {} if fixture is None else (
            video_inputs(fixture, self.processor) if fixture.is_video else {"images": [fixture.image]})
        if audio is not None:
            media["audio"] = [audio.samples]
        text = chat_text(self.processor, fixture, prompt, audio is not None)
        try:
            return dict(self.processor(text=[text], return_tensors="pt", **media))
        except ValueError as err:
            what = f"{fixture.kind} {fixture.name!r} {fixture.size[0]}x{fixture.size[1]}" if fixture else "the prompt"
            raise UsageError(f"the model's processor refuses {what}: {str(err).strip().splitlines()[0]}") from None

    @torch.inference_mode()
    def prepare(self, fixture: Fixture | None, prompt: str, encoder: Callable[..., Any] | None = None,
                audio: AudioClip | None = None) -> PreparedPrompt:
        """The request's LM inputs; `encoder` stands in for the vision tower (encoder graphs).
        Audio (a model that takes it) fills its rows from the audio tower and adds no DeepStack."""
        inputs = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                  for k, v in self.processor_inputs(fixture, prompt, audio).items()}
        input_ids = inputs["input_ids"]  # [1, T]
        embeds = self.embed_tokens(input_ids)[0]
        if audio is not None:
            heard = self._core.get_audio_features(inputs["input_features"].to(self.dtype),
                                                  inputs["feature_attention_mask"], return_dict=True)
            embeds[input_ids[0] == self.config.audio_token_id] = heard.last_hidden_state.to(self.dtype)
        deepstack = None
        video = fixture is not None and fixture.is_video
        grid = inputs.get("video_grid_thw" if video else "image_grid_thw")
        if fixture is not None:
            # Qwen3-VL encodes a video as it encodes an image (frames paired into temporal patches);
            # its DeepStack goes to the video rows as an image's goes to the image rows.
            pixels = inputs["pixel_values_videos" if video else "pixel_values"].to(self.dtype)
            vision = (encoder or self.visual)(pixels, grid_thw=grid, return_dict=True)
            visual_rows = input_ids[0] == self.visual_token_id(fixture)
            embeds[visual_rows] = vision.pooler_output.to(self.dtype)
            if self.deepstack_count:
                deepstack = embeds.new_zeros(embeds.shape[0], self.hidden_size * self.deepstack_count)
                deepstack[visual_rows] = torch.cat(list(vision.deepstack_features), dim=-1).to(self.dtype)
        positions = _rope_index(self._core, inputs, None if video else grid, grid if video else None)
        return PreparedPrompt(input_ids[0], embeds, positions[:, 0, :], deepstack, self.visual_token_id(fixture))


def _rope_index(core, inputs: dict, image_grid, video_grid) -> torch.Tensor:
    """mRoPE positions `[3, 1, T]` from the model's own `get_rope_index`: Qwen3-VL's takes the
    token types, the Omni thinker's the audio lengths and each video grid's seconds."""
    input_ids = inputs["input_ids"]
    params = inspect.signature(core.get_rope_index).parameters
    if "mm_token_type_ids" in params:
        types = inputs.get("mm_token_type_ids", torch.zeros_like(input_ids))
        return core.get_rope_index(input_ids, mm_token_type_ids=types, image_grid_thw=image_grid,
                                   video_grid_thw=video_grid)[0]
    mask = inputs.get("feature_attention_mask")
    return core.get_rope_index(input_ids, image_grid_thw=image_grid, video_grid_thw=video_grid,
                               attention_mask=torch.ones_like(input_ids),
                               audio_seqlens=None if mask is None else mask.sum(-1),
                               second_per_grids=inputs.get("video_second_per_grid"))[0]


def video_inputs(fixture: Fixture, processor) -> dict:
    """The processor's video arguments: every frame kept (no resampling), at the video's own rate,
    so the timestamps in the prompt are the video's."""
    from transformers.video_utils import VideoMetadata

    count = len(fixture.frames)
    metadata = VideoMetadata(total_num_frames=count, fps=fixture.fps, width=fixture.size[0],
                             height=fixture.size[1], frames_indices=list(range(count)))
    inputs = {"videos": [list(fixture.frames)], "video_metadata": [metadata], "do_sample_frames": False}
    if hasattr(processor.video_processor, "cap_pixels_per_frame"):
        # Keep every frame's pixels (the processor's default, said explicitly: the transformers
        # releases that added the reference cap warn until it is chosen).
        inputs["cap_pixels_per_frame"] = False
    return inputs


def _eos_ids(model: nn.Module) -> frozenset[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, (list, tuple)) else [eos])
