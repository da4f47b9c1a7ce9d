"""Embedded tiny Qwen3-VL presets: real transformers classes, random weights, no download.

Everything here is built in code from fixed seeds, so two builds on any machine give the same
tokenizer, the same weights and therefore the same greedy answers.

Plain random weights make a poor instrument: the last prompt row barely depends on the image rows
(attention averages them away), so zeroing DeepStack moves the logits by little more than rounding
noise and often leaves the first token as it was. Scaling the LM head does not help: a flip under
noise depends on the ratio of the top-2 gap to the noise, and scaling changes both alike. So the
recipe gives DeepStack a structural effect instead (`_route_deepstack_through_a_channel`,
`_split_lm_head`): with DeepStack zeroed, even token ids have logit exactly 0 and an odd token wins
by the maximum of ~230 logits of std ~0.8; with DeepStack, an even token wins by as much.
The first token therefore changes for every seed, fixture and prompt, by a margin far above a
tie, while logits stay small enough (|logit| < ~5) that bf16 noise is a few hundredths: tokens
that compete within one half can still swap under noise, but only as near-ties.
"""

from __future__ import annotations


import torch
from transformers import PreTrainedTokenizerFast

from parity.models.qwen3_vl import vision_language_core
from parity.preset_tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, train_tokenizer  # noqa: F401 - tests read them
from parity.presets import OMNI_THINKER as OMNI, ReleasedShape, TinyPreset


def build_tokenizer(preset: TinyPreset | None = None) -> PreTrainedTokenizerFast:
    """The presets' tokenizer (`parity.preset_tokenizer`) as transformers wraps it; the Omni
    thinker's has its audio tokens after all the others."""
    tok = train_tokenizer()
    if preset is not None and preset.model_type == OMNI:
        from parity.models.tiny_omni import omni_tokenizer

        return omni_tokenizer(PreTrainedTokenizerFast(tokenizer_object=tok), CHAT_TEMPLATE)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def build_processor(tokenizer: PreTrainedTokenizerFast, preset: TinyPreset | None = None):
    """The real Qwen3VLProcessor (the Omni processor for the Omni thinker), with pixel bounds small
    enough for CPU runs."""
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
    if preset is not None and preset.model_type == OMNI:
        from parity.models.tiny_omni import omni_processor

        return omni_processor(tokenizer, image_processor, video_processor)
    return Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )


def build_config(preset: TinyPreset, tokenizer: PreTrainedTokenizerFast):
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    if preset.model_type == "qwen3_5":
        return _qwen3_5_config(preset, len(tokenizer), ids)
    if preset.shape is not None:
        return _shape_config(preset.shape, ids)
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
        max_position_embeddings=preset.max_positions,
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
    if preset.model_type == OMNI:
        from parity.models.tiny_omni import omni_config

        return omni_config(preset, tokenizer, text, vision)
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


def _shape_config(shape: ReleasedShape, ids: dict[str, int]):
    """A released checkpoint's config, dimension for dimension, with the presets' tokenizer's ids
    (its vocabulary stays the released one: the rows past the tokenizer are never a token)."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    rope = {"rope_type": "default", "rope_theta": shape.rope_theta, "mrope_section": list(shape.mrope_section),
            "mrope_interleaved": True}
    text = dict(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                head_dim=shape.head_dim, max_position_embeddings=shape.max_positions, rms_norm_eps=1e-6,
                rope_scaling=rope, rope_parameters=rope, tie_word_embeddings=False)
    if shape.experts:
        text.update(num_experts=shape.experts, num_experts_per_tok=shape.experts_per_token,
                    moe_intermediate_size=shape.moe_intermediate, decoder_sparse_step=1)
    vision = dict(depth=shape.vision_depth, hidden_size=shape.vision_hidden, intermediate_size=shape.vision_intermediate,
                  num_heads=shape.vision_heads, patch_size=shape.patch, spatial_merge_size=shape.merge,
                  temporal_patch_size=shape.temporal_patch, out_hidden_size=shape.hidden,
                  num_position_embeddings=shape.vision_positions, deepstack_visual_indexes=list(shape.deepstack_indexes))
    cls = Qwen3VLMoeConfig if shape.experts else Qwen3VLConfig
    return cls(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
               video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
               vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)


def _qwen3_5_config(preset: TinyPreset, vocab: int, ids: dict[str, int]):
    """A Qwen3.5 config at the preset's size with an empty deepstack_visual_indexes, as released
    Qwen3.5 checkpoints ship it (transformers' Qwen3.5 vision config has no such field at all)."""
    from transformers import Qwen3_5Config

    hidden = preset.hidden_size
    config = Qwen3_5Config(
        text_config=dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=preset.num_layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=hidden // 4, max_position_embeddings=preset.max_positions),
        vision_config=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=hidden),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )
    config.vision_config.deepstack_visual_indexes = list(range(preset.deepstack_layers))
    return config


def model_class(preset: TinyPreset):
    from transformers import (Qwen3OmniMoeThinkerForConditionalGeneration, Qwen3VLForConditionalGeneration,
                              Qwen3VLMoeForConditionalGeneration)

    return (Qwen3OmniMoeThinkerForConditionalGeneration if preset.model_type == OMNI else
            Qwen3VLMoeForConditionalGeneration if preset.moe else Qwen3VLForConditionalGeneration)


def build_model(preset: TinyPreset, tokenizer: PreTrainedTokenizerFast, device: torch.device | None = None,
                dtype: torch.dtype = torch.float32):
    """Random weights from the preset's seed, drawn where the model will run (the CPU unless
    `device` says otherwise: a shape preset is built on its GPU, never copied through the host);
    special and non-printable tokens can never win argmax."""
    config = build_config(preset, tokenizer)
    device = torch.device("cpu") if device is None else device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
        torch.manual_seed(preset.seed)
        model = model_class(preset)._from_config(config, attn_implementation="sdpa", dtype=dtype)
        _scale_up_init(model)
    _route_deepstack_through_a_channel(model)
    _make_layout_matter(model)
    _split_lm_head(model)
    if preset.moe:
        _soften_expert_switches(model)
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


POSITION_GAIN = 16.0


@torch.no_grad()
def _make_layout_matter(model) -> None:
    """Scale the vision tower's learned position embeddings up: at the common init they are a few
    percent of the patch embeddings, so an image encoded with another grid's positions (the layout
    scenario's bug) moved its DeepStack rows by 3% and its answer by less than bf16's noise; scaled,
    by about 34%, while other pixels still move them by 135%. A larger gain moves bf16 answers more
    for a correct replay too (scripts/measure_noise.py: at 32, one flip that was not a near-tie)."""
    vision_language_core(model).visual.pos_embed.weight.mul_(POSITION_GAIN)


CHANNEL_GAIN = 32.0
DEEPSTACK_GAIN = 2.0
ROUTER_GAIN = 4.0
EXPERT_OWN = 0.3


def _channel(hidden: int) -> slice:
    """The last quarter of the hidden dims: the DeepStack channel."""
    return slice(hidden - hidden // 4, hidden)


@torch.no_grad()
def _route_deepstack_through_a_channel(model) -> None:
    """Only DeepStack writes the channel; only half the attention heads carry it, into the channel.

    Token embeddings, the vision merger, MLPs and the other heads never write the channel, and the
    channel heads read nothing else, so with DeepStack zeroed (or absent) the channel is exactly
    zero in every row after every layer, in any dtype. With DeepStack, the channel heads of layers
    1.. bring the image rows' DeepStack into every later row. Their output is scaled by
    CHANNEL_GAIN because a last row gives its few image rows only part of its attention (4 of 31
    rows for `quadrants`): scaled, the channel outweighs the text dims in the final norm anyway.
    DeepStack rows confined to a quarter of the dims are scaled by DEEPSTACK_GAIN, so they still
    move the image rows' hidden states by a sizeable fraction (a graph that drops them is far off).
    """
    core = vision_language_core(model)
    cfg = core.language_model.config
    channel = _channel(cfg.hidden_size)
    text = slice(0, channel.start)
    # GQA: query head i reads kv head i // (heads / kv_heads), so the last half of each carries the channel.
    kv_heads = slice((cfg.num_key_value_heads - max(1, cfg.num_key_value_heads // 2)) * cfg.head_dim,
                     cfg.num_key_value_heads * cfg.head_dim)
    q_heads = slice((cfg.num_attention_heads - max(1, cfg.num_attention_heads // 2)) * cfg.head_dim,
                    cfg.num_attention_heads * cfg.head_dim)
    core.language_model.embed_tokens.weight[:, channel] = 0
    for writer in _writers_of_the_lm_input(core):
        writer.weight[channel] = 0
        writer.bias[channel] = 0
    for merger in _deepstack_mergers(core.visual):
        _last_linear(merger).weight[text] = 0
        _last_linear(merger).bias[text] = 0
        _last_linear(merger).weight.mul_(DEEPSTACK_GAIN)
    for layer in core.language_model.layers:
        attn = layer.self_attn
        attn.v_proj.weight[kv_heads, text] = 0
        attn.o_proj.weight[channel, :q_heads.start] = 0
        attn.o_proj.weight[channel, q_heads] *= CHANNEL_GAIN
        if hasattr(layer.mlp, "experts"):
            layer.mlp.experts.down_proj[:, channel, :] = 0  # [experts, hidden, intermediate]
        else:
            layer.mlp.down_proj.weight[channel] = 0


@torch.no_grad()
def scale_deepstack(model, factor: float) -> None:
    """Scale what every DeepStack merger adds to the language model by `factor` (its output
    projection, weight and bias): a checkpoint whose DeepStack barely moves the answer, where only
    the freshness witness can tell a dropped DeepStack (design §6)."""
    for merger in _deepstack_mergers(vision_language_core(model).visual):
        _last_linear(merger).weight.mul_(factor)
        _last_linear(merger).bias.mul_(factor)


def _last_linear(merger) -> torch.nn.Linear:
    """A patch merger's output projection (`linear_fc2` in Qwen3-VL, `mlp[2]` in Qwen3-Omni)."""
    return merger.linear_fc2 if hasattr(merger, "linear_fc2") else merger.mlp[-1]


def _deepstack_mergers(visual) -> list:
    return list(visual.deepstack_merger_list if hasattr(visual, "deepstack_merger_list") else visual.merger_list)


def _writers_of_the_lm_input(core) -> list:
    """Every projection that writes a row of the language model's input other than DeepStack: the
    vision merger, and the Omni audio tower's last projection."""
    writers = [_last_linear(core.visual.merger)]
    audio = getattr(core, "audio_tower", None)
    return writers + ([audio.proj2] if audio is not None else [])


@torch.no_grad()
def _split_lm_head(model) -> None:
    """Even token ids read only the DeepStack channel, odd ids only the text dims.

    With DeepStack zeroed the channel is exactly zero, so every even logit is exactly 0 while the
    best of ~230 odd logits (std ~0.8) is well above it; with DeepStack the channel dominates the
    final norm, so the best even logit is as far above the shrunken odd ones. Either way the other
    run's first token is out of the race by a margin of order 1 (at least 1.6 measured over seeds
    0-4 and every fixture and prompt), whatever the seed.
    """
    head = model.get_output_embeddings().weight  # [vocab, hidden]
    channel = _channel(head.shape[1])
    head[0::2, :channel.start] = 0
    head[1::2, channel] = 0


@torch.no_grad()
def _soften_expert_switches(model) -> None:
    """Make a top-2 routing swap (which bf16 noise can trigger) move the MoE output only a little.

    A swap replaces one expert's output by another's: a jump, not a drift, that can turn a
    near-tie into a clear flip. Experts that share most of their weights (a common expert plus
    EXPERT_OWN of their own) jump little, and a sharper router (ROUTER_GAIN) gives the second and
    third expert little weight whenever they are close enough to swap.
    """
    for layer in vision_language_core(model).language_model.layers:
        moe = layer.mlp
        moe.gate.weight.mul_(ROUTER_GAIN)
        for weight in (moe.experts.gate_up_proj, moe.experts.down_proj):
            shared = weight[0].clone()
            weight.copy_((shared + EXPERT_OWN * weight) / (1 + EXPERT_OWN ** 2) ** 0.5)


@torch.no_grad()
def _silence_unprintable_tokens(model, tokenizer) -> None:
    """Zero the LM-head rows of special tokens and of tokens that do not decode to printable ASCII.

    A zero row gives logit 0, and with hundreds of random rows some logit is always positive, so
    greedy decoding never picks them: texts stay readable and never stop early on a special token.
    """
    head = model.get_output_embeddings().weight
    special = set(tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)))
    head[len(tokenizer):].zero_()  # a released vocabulary's rows past the presets' tokenizer: never a token
    for token_id in range(min(head.shape[0], len(tokenizer))):
        text = tokenizer.decode([token_id])
        if token_id in special or not text or not (text.isascii() and text.isprintable()):
            head[token_id].zero_()
