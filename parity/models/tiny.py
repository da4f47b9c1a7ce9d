"""Embedded tiny Qwen3-VL presets: real transformers classes, random weights, no download.

Everything here is built in code from fixed seeds, so two builds on any machine give the same
tokenizer, the same weights and therefore the same greedy answers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# Qwen's special tokens, in Qwen's order; the processor and config refer to them by name.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen3-VL's own chat template, reduced to what parity sends: text and image parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = (
    "Describe the image in one sentence. What colors do you see? The picture shows red, green "
    "and blue stripes, a checkerboard of black and white squares, and a smooth gradient with a "
    "bright circle in the middle. Answer briefly and name the shapes, the colors and the layout. "
    "There is a small square, a large circle, a thin line, a wide band, left and right, top and "
    "bottom, dark and light, warm and cool tones, one two three four five six seven eight nine ten."
)

TOKENIZER_VOCAB = 512
_CORPUS_REPEATS = 8


@dataclass(frozen=True)
class TinyPreset:
    """One embedded model: which Qwen3-VL class and which knobs differ from the base recipe."""

    name: str
    description: str
    moe: bool = False
    deepstack_layers: int = 3
    hidden_size: int = 64
    num_layers: int = 4
    seed: int = 0


PRESETS: dict[str, TinyPreset] = {
    p.name: p
    for p in (
        # Seeds picked for varied text, DeepStack power on every built-in fixture and prompt, and
        # (on the CPU) fewest bf16 near-tie flips between padded replay and eager.
        TinyPreset("tiny-qwen3-vl", "dense Qwen3-VL, DeepStack added after 3 decoder layers", seed=4),
        TinyPreset("tiny-qwen3-vl-moe", "Qwen3-VL-MoE (4 experts, top-2), DeepStack after 3 layers", moe=True, seed=8),
        TinyPreset(
            "tiny-qwen3-vl-nodeepstack",
            "dense Qwen3-VL with deepstack_visual_indexes=[]: the negative control for power",
            deepstack_layers=0,
            seed=4,
        ),
        TinyPreset(
            "mid-qwen3-vl",
            "hidden 1024, 8 layers: a mid-size dense preset for GPU timings (slow on CPU)",
            hidden_size=1024,
            num_layers=8,
        ),
    )
}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained in code on a fixed corpus (deterministic)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * _CORPUS_REPEATS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def build_processor(tokenizer: PreTrainedTokenizerFast):
    """The real Qwen3VLProcessor, with pixel bounds small enough for CPU runs."""
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    # 32 px = patch 16 x merge 2: one LM token per 32x32 block, at most 64 image tokens.
    size = {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 64}
    image_processor = Qwen2VLImageProcessor(
        size=size, patch_size=16, merge_size=2, temporal_patch_size=2,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )
    video_processor = Qwen3VLVideoProcessor(size=size, patch_size=16, merge_size=2, temporal_patch_size=2)
    return Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )


def build_config(preset: TinyPreset, tokenizer: PreTrainedTokenizerFast):
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    hidden = preset.hidden_size
    heads = max(4, hidden // 64)
    head_dim = hidden // heads
    # mrope sections split head_dim/2 rotary frequencies over (t, h, w), as Qwen does (24/20/20 of 64).
    half = head_dim // 2
    mrope = [half - 2 * (half * 5 // 16), half * 5 // 16, half * 5 // 16]
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rope_scaling={"rope_type": "default", "mrope_section": mrope, "mrope_interleaved": True},
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope,
                         "mrope_interleaved": True},
        tie_word_embeddings=False,
    )
    if preset.moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden, decoder_sparse_step=1)
    vision = dict(
        depth=4,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=hidden,
        num_position_embeddings=64,
        # ViT block indexes whose features become DeepStack inputs; their count is the number of
        # decoder layers DeepStack is added after.
        deepstack_visual_indexes=list(range(preset.deepstack_layers)),
    )
    cls = Qwen3VLMoeConfig if preset.moe else Qwen3VLConfig
    return cls(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def build_model(preset: TinyPreset, tokenizer: PreTrainedTokenizerFast):
    """Random weights from the preset's seed; special and non-printable tokens can never win argmax."""
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

    config = build_config(preset, tokenizer)
    cls = Qwen3VLMoeForConditionalGeneration if preset.moe else Qwen3VLForConditionalGeneration
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(preset.seed)
        model = cls._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
        _scale_up_init(model)
    _silence_unprintable_tokens(model, tokenizer)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


@torch.no_grad()
def _scale_up_init(model) -> None:
    # HF's init (std 0.02) makes a 64-wide random model answer almost the same token everywhere;
    # a larger spread gives varied text and a clear response to the image and its DeepStack rows.
    for name, param in model.named_parameters():
        if param.dim() >= 2 and "norm" not in name:
            torch.nn.init.normal_(param, std=param.shape[-1] ** -0.5)


@torch.no_grad()
def _silence_unprintable_tokens(model, tokenizer) -> None:
    """Zero the LM-head rows of special tokens and of tokens that do not decode to printable ASCII.

    A zero row gives logit 0, and with hundreds of random rows some logit is always positive, so
    greedy decoding never picks them: texts stay readable and never stop early on a special token.
    """
    head = model.get_output_embeddings().weight
    special = set(tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)))
    for token_id in range(head.shape[0]):
        text = tokenizer.decode([token_id]) if token_id < len(tokenizer) else ""
        if token_id in special or not text or not (text.isascii() and text.isprintable()):
            head[token_id].zero_()
