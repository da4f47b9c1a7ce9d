"""The embedded Qwen3-Omni thinker (`tiny-qwen3-omni`): transformers' `qwen3_omni_moe` thinker with
the tiny presets' text and vision shapes, an audio tower, and the same decisive recipe (tiny.py).

The thinker is the part of Qwen3-Omni that reads images, video and audio and writes text; its
vision tower returns DeepStack features for image and video rows as Qwen3-VL's does, and its MoE
language model adds them after the first decoder layers. Audio rows get no DeepStack. The talker
(speech out) is not built: parity compares text answers.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from parity.media.audio import RATE
from parity.presets import TinyPreset

# The names the Omni processor reads from its tokenizer.
TOKEN_ROLES = {
    "image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "audio_token": "<|audio_pad|>",
    "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>",
}
MEL_BINS = 128


def omni_tokenizer(tokenizer: PreTrainedTokenizerFast, chat_template: str) -> PreTrainedTokenizerFast:
    """The tiny tokenizer with the audio tokens appended (every other id unchanged) and the token
    roles the Omni processor looks up."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=chat_template, extra_special_tokens=dict(TOKEN_ROLES),
    )


def omni_config(preset: TinyPreset, tokenizer: PreTrainedTokenizerFast, text: dict, vision: dict):
    """The thinker's config from the tiny presets' text (MoE) and vision settings."""
    from transformers import Qwen3OmniMoeThinkerConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (*TOKEN_ROLES.values(),)}
    audio = dict(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=MEL_BINS,
                 output_dim=preset.hidden_size, n_window=50, n_window_infer=400, max_source_positions=1500,
                 downsample_hidden_size=32)
    config = Qwen3OmniMoeThinkerConfig(
        text_config=text, vision_config=vision, audio_config=audio,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"], audio_token_id=ids["<|audio_pad|>"],
        audio_start_token_id=ids["<|audio_start|>"], vision_start_token_id=ids["<|vision_start|>"],
        tie_word_embeddings=False,
    )
    config.vision_end_token_id = ids["<|vision_end|>"]
    return config


def omni_processor(tokenizer: PreTrainedTokenizerFast, image_processor, video_processor):
    from transformers import Qwen3OmniMoeProcessor, WhisperFeatureExtractor

    features = WhisperFeatureExtractor(feature_size=MEL_BINS, sampling_rate=RATE)
    return Qwen3OmniMoeProcessor(image_processor=image_processor, video_processor=video_processor,
                                 feature_extractor=features, tokenizer=tokenizer,
                                 chat_template=tokenizer.chat_template)
