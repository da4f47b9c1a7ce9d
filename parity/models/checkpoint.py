"""Loading a Qwen3-VL checkpoint (a Hugging Face id or a local folder) through `from_pretrained`.

Every way a checkpoint can be unusable is a usage error found before any arm runs, with one line
that says what to do: a folder that does not exist, a hub id that is not cached where the hub
cannot be reached (at once, not after the downloader's retries), a config of another model, a
tokenizer that is missing or does not know Qwen's vision tokens, a truncated or corrupt weight file.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from parity.errors import ModelUnavailableError, NothingToProve
from parity.presets import NO_DEEPSTACK_MODEL_TYPES, NO_DEEPSTACK_REASON, no_power_before_any_arm  # noqa: F401

# Qwen3-Omni is released as the whole model, its thinker (the part that sees and reads) nested in
# `thinker_config`: the engines serve it whole, and parity's in-process path runs the thinker.
WHOLE_OMNI = "qwen3_omni_moe"
SUPPORTED_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe", WHOLE_OMNI)
HUB_PROBE_TIMEOUT_S = 3.0


def reading_config(config):
    """The config of the model that sees and reads: a whole Qwen3-Omni's `thinker_config`, else itself."""
    return getattr(config, "thinker_config", None) or config


def is_local(name: str) -> bool:
    """A path rather than a hub id: it exists, or it is written like a path (`/x`, `./x`, `~/x`, `x/`)."""
    return (Path(name).expanduser().exists() or name.startswith(("/", ".", "~"))
            or name.endswith(os.sep) or name.count("/") > 1)


def hub_reachable() -> bool:
    """Whether a connection to the hub opens within a few seconds (no request is sent)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                      timeout=HUB_PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


@dataclass(frozen=True)
class CheckpointSource:
    """Where a checkpoint is read from, decided once: a local folder, or a hub id (cache only when
    the hub cannot be reached, so a missing file fails now, not after the downloader's retries)."""

    name: str
    local: bool
    path: str
    cached_only: bool

    @classmethod
    def of(cls, name: str) -> "CheckpointSource":
        local = is_local(name)
        path = Path(name).expanduser()
        if local and not path.is_dir():
            raise ModelUnavailableError(f"--model {name}: no checkpoint folder there "
                                        f"({'it is a file' if path.exists() else 'no such folder'})")
        return cls(name, local, str(path) if local else name, not local and not hub_reachable())

    def load(self, what: str, loader, **kwargs):
        """`loader.from_pretrained(...)`; any failure is one `ModelUnavailableError` naming `what`."""
        try:
            return loader.from_pretrained(self.path, local_files_only=self.cached_only, **kwargs)
        except Exception as err:  # noqa: BLE001 - a third-party loader failing on the user's files
            raise ModelUnavailableError(_cannot_load(self.name, what, err, self.local, self.cached_only)) from None


def load_config_and_processor(source: CheckpointSource, model_types: tuple[str, ...] = SUPPORTED_MODEL_TYPES):
    """The checkpoint's config and processor, checked to be one of `model_types` with a working tokenizer."""
    from transformers import AutoConfig, AutoProcessor

    config = source.load("config", AutoConfig)
    check_architecture(source.name, config, model_types)
    processor = source.load("processor and tokenizer", AutoProcessor)
    _check_tokenizer(source.name, processor, reading_config(config))
    return config, processor


def check_architecture(name: str, config, model_types: tuple[str, ...] = SUPPORTED_MODEL_TYPES) -> None:
    """A Qwen3-VL passes; a model of a DeepStack family without DeepStack is INCONCLUSIVE_NO_POWER
    before any arm runs (NothingToProve, exit 3); anything else is a usage error naming what parity runs."""
    if config.model_type in model_types:
        return
    indexes = getattr(getattr(config, "vision_config", None), "deepstack_visual_indexes", None)
    if config.model_type in NO_DEEPSTACK_MODEL_TYPES and not indexes:
        raise NothingToProve(no_power_before_any_arm(name, config.model_type))
    with_deepstack = " with DeepStack" if config.model_type in NO_DEEPSTACK_MODEL_TYPES else ""
    raise ModelUnavailableError(f"model {name!r} is a {config.model_type!r} checkpoint{with_deepstack}; parity drives "
                                f"{', '.join(model_types)} checkpoints here, says "
                                f"INCONCLUSIVE_NO_POWER for {' and '.join(NO_DEEPSTACK_MODEL_TYPES)} checkpoints "
                                "without DeepStack, and runs the embedded presets (`parity models`)")


def load_checkpoint(name: str, dtype):
    """(model, processor) of a Qwen3-VL checkpoint, or of a whole Qwen3-Omni's thinker (loaded
    without its talker: parity judges text answers); `ModelUnavailableError` when it cannot be used."""
    from transformers import AutoModelForImageTextToText

    from parity.model_identity import checkpoint_folder
    from parity.models.sizing import check_checkpoint_size

    source = CheckpointSource.of(name)
    config, processor = load_config_and_processor(source)
    # Before it allocates (a whole Qwen3-Omni: its thinker's layers, against all the weights on disk).
    check_checkpoint_size(name, checkpoint_folder(source.path), reading_config(config), dtype.itemsize)
    if config.model_type == WHOLE_OMNI:
        from transformers import Qwen3OmniMoeForConditionalGeneration

        whole = source.load("weights", Qwen3OmniMoeForConditionalGeneration, dtype=dtype, attn_implementation="sdpa",
                            enable_audio_output=False)
        return whole.thinker, processor
    model = source.load("weights", AutoModelForImageTextToText, dtype=dtype, attn_implementation="sdpa")
    return model, processor


def _cannot_load(name: str, what: str, err: Exception, local: bool, cached_only: bool) -> str:
    detail = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), err.__class__.__name__)
    if local:
        return (f"--model {name}: its {what} cannot be loaded from that folder; is it a complete Qwen3-VL "
                f"checkpoint (config.json, tokenizer files, *.safetensors)? ({err.__class__.__name__}: {detail})")
    where = ("it is not in the local Hugging Face cache and the hub cannot be reached from here"
             if cached_only else "it could not be fetched or read")
    return (f"model {name!r}: its {what} cannot be loaded: {where}. Download it where the network is reachable "
            f"(`hf download {name}`) or pass a local folder. ({err.__class__.__name__}: {detail})")


def _check_tokenizer(name: str, processor, config) -> None:
    """A checkpoint without its tokenizer files still loads a processor, with a tokenizer that does
    not know the vision tokens: every image request would then fail. Refuse it now."""
    tokenizer = getattr(processor, "tokenizer", None)
    token = getattr(processor, "image_token", None)
    known = tokenizer is not None and token is not None and tokenizer.convert_tokens_to_ids(token) == config.image_token_id
    if not known:
        raise ModelUnavailableError(
            f"model {name!r}: its tokenizer does not map the image token {token!r} to the config's image_token_id "
            f"{config.image_token_id}: the tokenizer files (tokenizer.json, tokenizer_config.json) are missing or "
            "belong to another model")
    if not (getattr(processor, "chat_template", None) or getattr(tokenizer, "chat_template", None)):
        raise ModelUnavailableError(f"model {name!r}: it has no chat template (chat_template.jinja or "
                                    "tokenizer_config.json), so parity cannot build its prompts")
