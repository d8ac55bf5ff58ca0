"""Tiny multimodal checkpoints built locally from their config classes (no hub): Gemma 3, Gemma 4, Mllama, Qwen3.5,
Qwen3.5-MoE and Llama 4, each saved from its composite class (``...ForConditionalGeneration``, as released).

`build_multimodal(path, family)` writes one; `COMPOSITE[family]` names the composite class and `TEXT_ONLY[family]` the
class ``AutoModelForCausalLM`` maps the family to (the composite itself for Gemma 3 and 4).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["COMPOSITE", "FAMILIES", "LLAMA4_IMAGE_TOKENS", "PROCESSORS", "TEXT_ONLY", "WITHOUT_VIDEO",
           "build_multimodal", "build_processor", "build_text_only", "llama4_image_config", "load_processor",
           "multimodal_config"]  # fmt: skip

TEXT = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
# special tokens of the image-text families (ids inside the tiny vocabulary)
IMAGE_TOKEN, BOI_TOKEN, EOI_TOKEN = 5, 3, 4


def _gemma3():
    from transformers import Gemma3Config

    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "image_size": 32, "patch_size": 8}  # fmt: skip
    return Gemma3Config(text_config={**TEXT, "sliding_window": 32}, vision_config=vision, mm_tokens_per_image=4,
                        image_token_index=IMAGE_TOKEN, boi_token_index=BOI_TOKEN, eoi_token_index=EOI_TOKEN)  # fmt: skip


def _gemma4():
    from transformers import Gemma4Config

    text = {**TEXT, "sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"],
            "vocab_size_per_layer_input": 512, "hidden_size_per_layer_input": 8}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": 16, "patch_size": 8, "position_embedding_size": 64,
              "pooling_kernel_size": 2}  # fmt: skip
    audio = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "subsampling_conv_channels": [8, 4],
             "output_proj_dims": 32, "attention_chunk_size": 4, "attention_context_left": 5}  # fmt: skip
    # a vision and an audio tower, as the released Gemma 4 (E2B/E4B)
    return Gemma4Config(text_config=text, vision_config=vision, audio_config=audio, image_token_id=IMAGE_TOKEN,
                        boi_token_id=BOI_TOKEN, eoi_token_id=EOI_TOKEN, audio_token_id=7, boa_token_id=BOI_TOKEN,
                        eoa_token_index=EOI_TOKEN)  # fmt: skip


def _mllama():
    from transformers import MllamaConfig

    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_global_layers": 1,
              "num_attention_heads": 2, "image_size": 32, "patch_size": 16, "vision_output_dim": 64,
              "intermediate_layers_indices": [0]}  # fmt: skip
    return MllamaConfig(text_config={**TEXT, "cross_attention_layers": [1]}, vision_config=vision,
                        image_token_index=MLLAMA_IMAGE_TOKEN)  # fmt: skip


def _qwen_vision():
    return {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 8,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 64,
            "num_position_embeddings": 64}  # fmt: skip


def _qwen_text():
    return {**TEXT, "layer_types": ["linear_attention", "full_attention"], "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4}  # fmt: skip


def _qwen3_5():
    from transformers import Qwen3_5Config

    return Qwen3_5Config(text_config=_qwen_text(), vision_config=_qwen_vision(), image_token_id=IMAGE_TOKEN)


def _qwen3_5_moe():
    from transformers import Qwen3_5MoeConfig

    text = {**_qwen_text(), "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
            "num_experts": 4, "num_experts_per_tok": 2}  # fmt: skip
    return Qwen3_5MoeConfig(text_config=text, vision_config=_qwen_vision(), image_token_id=IMAGE_TOKEN)


def _llama4():
    from transformers import Llama4Config

    text = {**TEXT, "intermediate_size_mlp": 128, "num_local_experts": 2, "moe_layers": [1],
            "layer_types": ["full_attention"] * 2, "no_rope_layers": [1, 1], "attention_chunk_size": 64}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 32, "patch_size": 16, "vision_output_dim": 64, "projector_input_dim": 64,
              "projector_output_dim": 64}  # fmt: skip
    return Llama4Config(text_config=text, vision_config=vision)


# Llama 4 with a vision tower whose forward runs (`_llama4`'s does not: other tests only store or merge it). The pixel
# shuffle (ratio 0.5) hands the vision adapter 4 x the tower's width, so intermediate_size must be 4 x hidden_size;
# 32x32 images in 8x8 patches give 4 image tokens each; image_token_index inside the tiny vocabulary.
LLAMA4_IMAGE_TOKENS = 4


def llama4_image_config():
    config = _llama4()
    config.vision_config.intermediate_size = 4 * config.vision_config.hidden_size
    config.vision_config.patch_size = 8
    config.image_token_index = IMAGE_TOKEN
    return config


_CONFIGS = {"gemma3": _gemma3, "gemma4": _gemma4, "mllama": _mllama, "qwen3_5": _qwen3_5,
            "qwen3_5_moe": _qwen3_5_moe, "llama4": _llama4}  # fmt: skip
FAMILIES = tuple(_CONFIGS)
COMPOSITE = {"gemma3": "Gemma3ForConditionalGeneration", "gemma4": "Gemma4ForConditionalGeneration",
             "mllama": "MllamaForConditionalGeneration", "qwen3_5": "Qwen3_5ForConditionalGeneration",
             "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
             "llama4": "Llama4ForConditionalGeneration"}  # fmt: skip
TEXT_ONLY = {"gemma3": "Gemma3ForConditionalGeneration", "gemma4": "Gemma4ForConditionalGeneration",
             "mllama": "MllamaForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
             "llama4": "Llama4ForCausalLM"}  # fmt: skip


def multimodal_config(family: str):
    return _CONFIGS[family]()


def build_multimodal(path: str | Path, family: str, dtype=torch.float32, seed: int = 0, config=None) -> Path:
    """A tiny `family` checkpoint saved from its composite class (random weights, `seed`; `config`: another config
    of the family, e.g. :func:`llama4_image_config`) at `path`."""
    import transformers

    path = Path(path)
    torch.manual_seed(seed)
    model = getattr(transformers, COMPOSITE[family])(config or multimodal_config(family)).to(dtype)
    with torch.no_grad():  # Mllama's cross-attention gates start at 0 (tanh(0): no image signal, no gradient there)
        for name, param in model.named_parameters():
            if name.endswith(("cross_attn_attn_gate", "cross_attn_mlp_gate")):
                param.fill_(0.5)
    model.save_pretrained(path)
    return path


def build_text_only(path: str | Path, family: str, dtype=torch.float32, seed: int = 0) -> Path:
    """`family`'s language model saved alone from its text-only class (``TEXT_ONLY[family]``, e.g.
    ``Llama4ForCausalLM``: ``architectures`` names it, so trl's loader picks it), random weights, at `path`."""
    import transformers

    path = Path(path)
    torch.manual_seed(seed)
    model = getattr(transformers, TEXT_ONLY[family])(multimodal_config(family).get_text_config()).to(dtype)
    model.save_pretrained(path)
    return path


# the special tokens of every family's processor (ids 3..), then words t{id}
SPECIALS = ["<boi>", "<eoi>", "<image>", "<|image|>", "<|python_tag|>"]
MLLAMA_IMAGE_TOKEN = 3 + SPECIALS.index("<|image|>")


def build_tokenizer(path: str | Path | None = None, **extra):
    """A word-level tokenizer over t8..t511 with <pad>=0, <eos>=1, <unk>=2 and the image-text families' specials
    (<boi>=3, <eoi>=4, <image>=5, <|image|>=6, ...; `extra`: more named special tokens), saved at `path` if given."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{name: 3 + i for i, name in enumerate(SPECIALS)}}
    vocab.update({f"t{i}": i for i in range(len(vocab), TEXT["vocab_size"])})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<eos>", unk_token="<unk>",
        extra_special_tokens={"boi_token": "<boi>", "eoi_token": "<eoi>", "image_token": "<image>", **extra},
    )  # fmt: skip
    if path is not None:
        tokenizer.save_pretrained(path)
    return tokenizer


def _gemma3_processor(tokenizer):
    from transformers import Gemma3ImageProcessor, Gemma3Processor

    image = Gemma3ImageProcessor(size={"height": 32, "width": 32}, do_pan_and_scan=False)
    return Gemma3Processor(image_processor=image, tokenizer=tokenizer, image_seq_length=4), "<boi>"


def _mllama_processor(tokenizer):
    from transformers import MllamaImageProcessor, MllamaProcessor

    image = MllamaImageProcessor(size={"height": 32, "width": 32})  # 4 tiles, as the vision config
    return MllamaProcessor(image_processor=image, tokenizer=tokenizer), "<|image|>"


class _WithoutVideo:
    """Drops a ``video_processor=None`` on its way to ``ProcessorMixin.__init__`` (put after the processor class)."""

    def __init__(self, *args, **kwargs):
        if "video_processor" in kwargs and kwargs["video_processor"] is None:
            del kwargs["video_processor"]
        super().__init__(*(a for a in args if a is not None), **kwargs)


def _init_with_audio(self, feature_extractor, image_processor, tokenizer, chat_template=None, **kwargs):
    type(self).__mro__[1].__init__(self, feature_extractor, image_processor, tokenizer, None,
                                   chat_template=chat_template, **kwargs)  # fmt: skip


def _init_images(self, image_processor, tokenizer, chat_template=None, **kwargs):
    type(self).__mro__[1].__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def _image_only(processor_cls):
    """`processor_cls` without its video processor. Gemma 4's and Qwen3.5's processors hold one, and their video
    processors have a torchvision backend only (not installed here): neither the processor nor AutoProcessor's load
    can be built without it. Images go through the PIL image processor. Same name, so it saves as released; its
    ``__init__`` names the attributes kept (ProcessorMixin reads them from the signature)."""
    from transformers.processing_utils import ProcessorMixin

    mixin = type("WithoutVideo", (_WithoutVideo, ProcessorMixin), {})
    init = _init_with_audio if "feature_extractor" in processor_cls.get_attributes() else _init_images
    return type(processor_cls.__name__, (processor_cls, mixin), {"__init__": init})


def _gemma4_processor(tokenizer):
    from transformers import Gemma4AudioFeatureExtractor, Gemma4ImageProcessorPil, Gemma4Processor

    # 70 soft tokens is the smallest budget Gemma 4's image processor takes (a 32x32 image gives 64)
    image = Gemma4ImageProcessorPil(patch_size=8, pooling_kernel_size=2, max_soft_tokens=70)
    return _image_only(Gemma4Processor)(
        Gemma4AudioFeatureExtractor(), image, tokenizer, image_seq_length=70
    ), "<image>"


def _qwen_processor(tokenizer):
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLProcessor

    pixels = 32 * 32  # one 32x32 image: 4x4 patches of 8, merged 2x2 into 4 tokens
    image = Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2,
                                     size={"shortest_edge": pixels, "longest_edge": pixels})  # fmt: skip
    return _image_only(Qwen3VLProcessor)(image, tokenizer), "<image>"


PROCESSORS = {"gemma3": _gemma3_processor, "mllama": _mllama_processor, "gemma4": _gemma4_processor,
              "qwen3_5": _qwen_processor, "qwen3_5_moe": _qwen_processor}  # fmt: skip
# built without their video processor (see _image_only); AutoProcessor cannot load them without torchvision
WITHOUT_VIDEO = {"gemma4": "Gemma4Processor", "qwen3_5": "Qwen3VLProcessor", "qwen3_5_moe": "Qwen3VLProcessor"}
# the video processor class each names in the video_preprocessor_config.json released checkpoints ship
VIDEO_PROCESSOR = {"gemma4": "Gemma4VideoProcessor", "qwen3_5": "Qwen3VLVideoProcessor",
                   "qwen3_5_moe": "Qwen3VLVideoProcessor"}  # fmt: skip


def _tokenizer_for(family: str):
    if family == "mllama":
        return build_tokenizer(image_token="<|image|>")
    if family == "gemma4":  # Gemma 4's processor checks for the audio tokens even on images (ids as in the config)
        return build_tokenizer(audio_token="<|python_tag|>", boa_token="<boi>", eoa_token="<eoi>")
    return build_tokenizer()


def load_processor(model_path: str | Path, family: str):
    """The processor saved beside the model: ``AutoProcessor`` where it loads here, else the class without its video
    processor, with the word-level tokenizer read as such (AutoTokenizer would take Qwen3.5's BPE class)."""
    import transformers
    from transformers import AutoProcessor, PreTrainedTokenizerFast

    if family not in WITHOUT_VIDEO:
        return AutoProcessor.from_pretrained(model_path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_path)
    return _image_only(getattr(transformers, WITHOUT_VIDEO[family])).from_pretrained(model_path, tokenizer=tokenizer)


def build_processor(model_path: str | Path, family: str) -> Path:
    """`family`'s processor over the tiny tokenizer, saved beside the model (as released checkpoints ship it) with
    ``image_prefix.txt``: the text that stands for one image in a row (the processor expands it to its tokens)."""
    processor, prefix = PROCESSORS[family](_tokenizer_for(family))
    path = Path(model_path)
    processor.save_pretrained(path)
    if family in VIDEO_PROCESSOR:  # written by hand: the class cannot be built without torchvision
        video = {"video_processor_type": VIDEO_PROCESSOR[family], "processor_class": WITHOUT_VIDEO[family]}
        (path / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
    (path / "image_prefix.txt").write_text(prefix + "\n")
    return path
