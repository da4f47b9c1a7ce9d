"""Input preparation for a loaded Qwen3-VL: prompt, image features, positions, dense DeepStack.

Eager and graph arms share everything here; only the LM body call differs (transformers backend).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from parity.errors import UsageError
from parity.fixtures import Fixture
from parity.lm_body import Qwen3VLTextBody


@dataclass(frozen=True)
class PreparedPrompt:
    input_ids: torch.Tensor  # [T] long
    input_embeds: torch.Tensor  # [T, H]
    positions: torch.Tensor  # [3, T] long (mRoPE t/h/w)
    deepstack: torch.Tensor | None  # [T, H * n], zero outside image rows; None without image or n == 0


def chat_text(processor, fixture: Fixture | None, prompt: str) -> str:
    """One user turn through the model's own chat template: the image placeholder, then the prompt.

    Every backend builds its prompts here, so they all send the model the same text.
    """
    content = ([{"type": "image"}] if fixture is not None else []) + [{"type": "text", "text": prompt}]
    messages = [{"role": "user", "content": content}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


class Qwen3VLAdapter:
    """The pieces of a Hugging Face Qwen3-VL that parity drives, and how requests become LM inputs."""

    def __init__(self, model: nn.Module, processor) -> None:
        core = model.model
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

    @property
    def max_positions(self) -> int:
        return int(self.config.text_config.max_position_embeddings)

    def processor_inputs(self, fixture: Fixture | None, prompt: str) -> dict:
        """What the model's own processor makes of the request (also fed to HF `generate` in tests).

        A request the processor refuses (an image too small or too elongated for its patching) is
        bad input, not a runtime failure: a `UsageError` naming the image.
        """
        images = [fixture.image] if fixture is not None else None
        try:
            return dict(self.processor(text=[chat_text(self.processor, fixture, prompt)], images=images,
                                       return_tensors="pt"))
        except ValueError as err:
            what = f"image {fixture.name!r} {fixture.size[0]}x{fixture.size[1]}" if fixture else "the prompt"
            raise UsageError(f"the model's processor refuses {what}: {str(err).strip().splitlines()[0]}") from None

    @torch.inference_mode()
    def prepare(self, fixture: Fixture | None, prompt: str, encoder: Callable[..., Any] | None = None) -> PreparedPrompt:
        """The request's LM inputs; `encoder` stands in for the vision tower (encoder graphs)."""
        inputs = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                  for k, v in self.processor_inputs(fixture, prompt).items()}
        input_ids = inputs["input_ids"]  # [1, T]
        embeds = self.embed_tokens(input_ids)[0]
        deepstack = None
        grid = inputs.get("image_grid_thw")
        if fixture is not None:
            vision = (encoder or self.visual)(inputs["pixel_values"].to(self.dtype), grid_thw=grid, return_dict=True)
            image_rows = input_ids[0] == self.config.image_token_id
            embeds[image_rows] = vision.pooler_output.to(self.dtype)
            if self.deepstack_count:
                deepstack = embeds.new_zeros(embeds.shape[0], self.hidden_size * self.deepstack_count)
                deepstack[image_rows] = torch.cat(list(vision.deepstack_features), dim=-1).to(self.dtype)
        positions, _ = self._core.get_rope_index(
            input_ids,
            mm_token_type_ids=inputs.get("mm_token_type_ids", torch.zeros_like(input_ids)),
            image_grid_thw=grid,
            video_grid_thw=None,
        )
        return PreparedPrompt(input_ids[0], embeds, positions[:, 0, :], deepstack)


def _eos_ids(model: nn.Module) -> frozenset[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, (list, tuple)) else [eos])
