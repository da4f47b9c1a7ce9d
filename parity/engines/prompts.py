"""The client side of a request: the checkpoint's chat template and config, and the images as files.

parity never loads the weights for a server backend (the servers do); it reads the checkpoint's
processor (chat template, image placeholder) and config (dtype, DeepStack blocks, context), through
the same loader and checks as the transformers backend (`parity.models.checkpoint`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from parity.backends.protocol import Request
from parity.errors import UsageError
from parity.fixtures import Fixture
from parity.models.qwen3_vl import chat_text


@dataclass(frozen=True)
class CheckpointFacts:
    """What the checkpoint's own config says, for the results' config and the verdict (rule 1b)."""

    dtype: str
    deepstack_layers: int
    max_positions: int | None

    @classmethod
    def of(cls, config: Any) -> "CheckpointFacts":
        vision = getattr(config, "vision_config", None)
        indexes = getattr(vision, "deepstack_visual_indexes", None)
        if indexes is None:
            raise UsageError("the checkpoint's config has no vision_config.deepstack_visual_indexes: "
                             "the server backends check Qwen3-VL checkpoints")
        text = getattr(config, "text_config", config)
        dtype = getattr(text, "dtype", None) or getattr(config, "dtype", None) or "bfloat16"
        return cls(dtype=str(dtype).removeprefix("torch."), deepstack_layers=len(indexes),
                   max_positions=getattr(text, "max_position_embeddings", None))

class ChatPrompts:
    """The model's own chat template and image placeholder, from its processor (client side)."""

    def __init__(self, processor: Any) -> None:
        self._processor = processor
        placeholder = getattr(processor, "image_token", None)
        self.image_token_id = processor.tokenizer.convert_tokens_to_ids(placeholder) if placeholder else None

    def text(self, request: Request) -> str:
        text = chat_text(self._processor, request.fixture, request.prompt)
        placeholder = getattr(self._processor, "image_token", None)
        if request.fixture is not None and placeholder and placeholder not in text:
            raise UsageError(f"the chat template put no image placeholder {placeholder!r} into the prompt")
        return text

    def length(self, request: Request) -> int:
        images = [request.fixture.image] if request.fixture is not None else None
        try:
            encoded = self._processor(text=[self.text(request)], images=images)
        except ValueError as err:  # an image too small or too elongated for the processor's patching
            what = f"image {request.fixture.name!r}" if request.fixture is not None else "the prompt"
            raise UsageError(f"the model's processor refuses {what}: {str(err).strip().splitlines()[0]}") from None
        return len(encoded["input_ids"][0])

    def decode(self, token_ids: Sequence[int]) -> str:
        """Token ids as the text a chat message carries them in (special tokens kept)."""
        return self._processor.tokenizer.decode([int(t) for t in token_ids], skip_special_tokens=False)

    def unexpanded(self, prompt_ids: Sequence[int]) -> tuple[int, ...]:
        """Expanded prompt ids (as the server returns them) with each run of image tokens folded
        back into the one placeholder a prompt carries, so the server expands it again the same way."""
        out: list[int] = []
        for token in prompt_ids:
            if not (token == self.image_token_id and out and out[-1] == token):
                out.append(int(token))
        return tuple(out)


class ImageFiles:
    """Fixtures saved once as PNG (lossless, decoded by PIL in SGLang) under the run folder."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder

    def path(self, fixture: Fixture | None) -> str | None:
        if fixture is None:
            return None
        path = (self._folder / f"{fixture.name}-{fixture.sha256[:12]}.png").resolve()
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fixture.image.save(path, format="PNG")
        return str(path)  # absolute: SGLang base64-decodes relative paths
