"""The client side of a request: the checkpoint's chat template and config, and the images and videos as files.

parity never loads the weights for a server backend (the servers do); it reads the checkpoint's
processor (chat template, image and video placeholders) and config (dtype, DeepStack blocks, context), through
the same loader and checks as the transformers backend (`parity.models.checkpoint`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from parity.backends.protocol import Request
from parity.errors import UsageError
from parity.media.fixtures import Fixture
from parity.models.checkpoint import reading_config
from parity.models.qwen3_vl import chat_text, video_inputs
from parity.media.videos import write_lossless


@dataclass(frozen=True)
class CheckpointFacts:
    """What the checkpoint's own config says, for the results' config and the verdict (rule 1b)."""

    dtype: str
    deepstack_layers: int
    max_positions: int | None

    @classmethod
    def of(cls, config: Any) -> "CheckpointFacts":
        config = reading_config(config)  # a whole Qwen3-Omni: its thinker's
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
    """The model's own chat template and visual placeholders, from its processor (client side)."""

    def __init__(self, processor: Any) -> None:
        self._processor = processor
        tokenizer = processor.tokenizer
        self._placeholders = {kind: getattr(processor, f"{kind}_token", None) for kind in ("image", "video")}
        self._ids = {kind: tokenizer.convert_tokens_to_ids(token)
                     for kind, token in self._placeholders.items() if token}
        self.visual_token_ids = frozenset(self._ids.values())

    def text(self, request: Request) -> str:
        text = chat_text(self._processor, request.fixture, request.prompt)
        if request.fixture is not None:
            placeholder = self._placeholders[request.fixture.kind]
            if not placeholder:
                raise UsageError(f"the model's processor has no {request.fixture.kind} placeholder")
            if placeholder not in text:
                raise UsageError(f"the chat template put no {request.fixture.kind} placeholder {placeholder!r} "
                                 "into the prompt")
        return text

    def length(self, request: Request) -> int:
        fixture = request.fixture
        visual = {} if fixture is None else (
            video_inputs(fixture, self._processor) if fixture.is_video else {"images": [fixture.image]})
        try:
            encoded = self._processor(text=[self.text(request)], **visual)
        except ValueError as err:  # an image too small or too elongated for the processor's patching
            what = f"{fixture.kind} {fixture.name!r}" if fixture is not None else "the prompt"
            raise UsageError(f"the model's processor refuses {what}: {str(err).strip().splitlines()[0]}") from None
        return len(encoded["input_ids"][0])

    def decode(self, token_ids: Sequence[int]) -> str:
        """Token ids as the text a chat message carries them in (special tokens kept)."""
        return self._processor.tokenizer.decode([int(t) for t in token_ids], skip_special_tokens=False)

    def scoring_ids(self, request: Request, prompt_ids: Sequence[int]) -> tuple[int, ...]:
        """The prompt ids a scoring request sends, given the prompt as the server expanded it for
        the generation (already expanded ids would each count as an image of their own).

        An image's run of pad tokens folds back into its one placeholder: SGLang rebuilds an image
        prompt from the ids. A video's expansion (a timestamp, then its rows, per pair of frames)
        cannot be folded by token, and need not be: SGLang decodes a video request's ids to text
        and runs the model's processor over it (srt/multimodal/processors/qwen_vl.py::
        _process_mm_data_uncached), so the prompt goes as the chat text tokenizes."""
        if request.fixture is not None and request.fixture.is_video:
            return tuple(self._processor.tokenizer(self.text(request), add_special_tokens=False)["input_ids"])
        image = self._ids.get("image")
        out: list[int] = []
        for token in prompt_ids:
            if not (token == image and out and out[-1] == token):
                out.append(int(token))
        return tuple(out)


class MediaFiles:
    """Fixtures saved once under the run folder, losslessly: an image as PNG, a video as FFV1
    (`parity.media.videos.write_lossless`), each as the engine's decoder reads it."""

    def __init__(self, folder: Path, video_fps: float | None = None, even_frames: bool = False) -> None:
        self._folder = folder
        self._video_fps = video_fps  # None: the video's own rate
        self._even_frames = even_frames

    def path(self, fixture: Fixture | None) -> str | None:
        if fixture is None:
            return None
        suffix = "mkv" if fixture.is_video else "png"
        path = (self._folder / f"{fixture.name}-{fixture.sha256[:12]}.{suffix}").resolve()
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            if fixture.is_video:
                write_lossless(fixture, path, self._video_fps or fixture.fps, self._even_frames)
            else:
                fixture.image.save(path, format="PNG")
        return str(path)  # absolute: SGLang base64-decodes relative paths
