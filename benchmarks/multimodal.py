"""Image inputs: a LLaVA-1.5-7B-shaped checkpoint (or LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Mistral 3, Gemma 3, SmolVLM, InternVL,
Llama 4; random bfloat16 weights
written by transformers), run by transformers' ``LlavaForConditionalGeneration`` (or the shape's class) and by plinth on the same pixels and prompts, in one process.

    python benchmarks/multimodal.py                       # GPU: LLaVA-1.5-7B shape (CLIP-L/14 at 336, Llama-2-7B)
    python benchmarks/multimodal.py --shape tiny --device cpu --requests 8   # anywhere, small
    python benchmarks/multimodal.py --shape qwen2-vl-7b --requests 16    # Qwen2-VL-7B shape (252 positions an image)
    python benchmarks/multimodal.py --shape qwen3-vl-small --device cpu --requests 8   # Qwen3-VL layout, small
    python benchmarks/multimodal.py --shape mistral3-small --device cpu --requests 8   # Mistral 3 layout, small
    python benchmarks/multimodal.py --shape gemma3-4b --requests 16       # gemma-3-4b shape (256 positions an image)
    python benchmarks/multimodal.py --shape smolvlm-256m --requests 16    # SmolVLM-256M shape (17 tiles an image)
    python benchmarks/multimodal.py --shape internvl3-1b --requests 16    # InternVL3-1B shape (tiles and a thumbnail)
    python benchmarks/multimodal.py --shape llama4-small --requests 16    # Llama 4 Scout's vision model, a small Llama 4

Measured, for each system: the image encoder alone (vision tower to the layer LLaVA reads, then the projector) for
batches of images; one request (an image and ``--text-len`` text tokens, greedy, EOS ignored): the time to the first
token (a fresh image: encoded in the request) and the ms per later token (from runs of ``--max-tokens`` / 4 and
``--max-tokens`` tokens); ``--requests`` such requests at once (each its own
image), output tokens per second. transformers runs the batch with left padding in one ``generate``. Whether the
greedy tokens of the single request agree is printed (bfloat16: a near tie may part them).

Floors printed beside: a decode token streams the language model's weights once (bytes over ``--bandwidth``); an
image costs ``2 x params x positions`` FLOPs in the tower (over ``--flops``).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import numpy as np
import torch

#: Qwen2-VL-7B's and Qwen2.5-VL-7B's language model (Qwen2-7B with the multimodal RoPE)
QWEN2_7B_TEXT = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]})

SHAPES = {
    "llava-1.5-7b": dict(
        text=dict(vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096),
        vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                    image_size=336, patch_size=14, projection_dim=768),
        image_token=32000),
    "llava-next-7b": dict(   # LLaVA-1.6 (Vicuna-7B) shape: up to 2x2 tiles of 336 and the base image
        text=dict(vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096),
        vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                    image_size=336, patch_size=14, projection_dim=768),
        image_token=32000, grid=[[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]),
    "qwen2-vl-7b": dict(   # Qwen2-VL-7B: Qwen2-7B, a 32-layer ViT over 14-pixel patches, 2x2 merged
        kind="qwen2_vl",
        text=QWEN2_7B_TEXT,
        vision=dict(depth=32, embed_dim=1280, hidden_size=3584, num_heads=16, mlp_ratio=4, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2),
        image_token=151655, vision_start=151652, vision_end=151653),
    "qwen2.5-vl-7b": dict(   # Qwen2.5-VL-7B: windowed attention in 28 of the ViT's 32 blocks
        kind="qwen2_5_vl",
        text=QWEN2_7B_TEXT,
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                    patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                    fullatt_block_indexes=[7, 15, 23, 31]),
        image_token=151655, vision_start=151652, vision_end=151653),
    "qwen2-vl-2b": dict(   # Qwen2-VL-2B: Qwen2-1.5B (tied head), the 7B's vision transformer
        kind="qwen2_vl",
        text=dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
        vision=dict(depth=32, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2),
        image_token=151655, vision_start=151652, vision_end=151653, tie=True),
    "tiny-qwen2-vl": dict(
        kind="qwen2_vl",
        text=dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=2, bos_token_id=1, pad_token_id=0,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}),
        vision=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2),
        image_token=300, vision_start=301, vision_end=302),
    "qwen3-vl-small": dict(   # Qwen3-VL's layout at a small width: DeepStack after vision blocks 1, 3, 5
        kind="qwen3_vl",
        text=dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=128, max_position_embeddings=32768,
                  rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                                   "mrope_interleaved": True}),
        vision=dict(depth=8, hidden_size=512, intermediate_size=2048, num_heads=8, out_hidden_size=1024,
                    patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                    deepstack_visual_indexes=[1, 3, 5]),
        image_token=151655, vision_start=151652, vision_end=151653, tie=True),
    "mistral3-small": dict(   # Mistral 3's layout at a small width: Pixtral over 14-pixel patches, 2x2 merged
        kind="mistral3",
        text=dict(vocab_size=131072, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=128, max_position_embeddings=32768,
                  rope_theta=1e9),
        vision=dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8, head_dim=64,
                    patch_size=14, image_size=1540),
        image_token=10, image_break=12, image_end=13),
    "gemma3-4b": dict(   # gemma-3-4b: SigLIP-so400m at 896 (4,096 patches pooled to 256 positions), 34 layers
        kind="gemma3",
        text=dict(vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
                  query_pre_attn_scalar=256, sliding_window=1024,
                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
        vision=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                    image_size=896, patch_size=14, vision_use_head=False),
        image_token=262144, boi=255999, eoi=256000),
    "gemma3-small": dict(   # Gemma 3's layout at a small width: 448-pixel images (1,024 patches pooled to 256)
        kind="gemma3",
        text=dict(vocab_size=262208, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=128, max_position_embeddings=32768,
                  query_pre_attn_scalar=128, sliding_window=512),
        vision=dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                    image_size=448, patch_size=14, vision_use_head=False),
        image_token=262144, boi=255999, eoi=256000),
    "smolvlm-256m": dict(   # SmolVLM-256M-Instruct: SmolLM2-135M, a 12-layer SigLIP at 512 (64 positions a tile)
        kind="idefics3",
        text=dict(vocab_size=49280, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                  tie_word_embeddings=True, model_type="llama"),
        vision=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                    image_size=512, patch_size=16),
        scale_factor=4, image_token=49190, fake=49189, global_img=49152, end_of_utterance=49279),
    "internvl3-1b": dict(   # InternVL3-1B: InternViT-300M at 448 (256 positions a tile), Qwen2.5-0.5B
        kind="internvl",
        text=dict(vocab_size=151674, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                  tie_word_embeddings=True, model_type="qwen2"),
        vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                    image_size=[448, 448], patch_size=[14, 14], attention_bias=True, use_mean_pooling=True),
        image_token=151667, image_start=151665, image_end=151666),
    "llama4-small": dict(   # Llama 4 Scout's vision model at 336 (144 positions a tile), a small Llama 4 (8 experts)
        kind="llama4",
        text=dict(vocab_size=202048, hidden_size=1024, intermediate_size=1024, intermediate_size_mlp=4096,
                  num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                  num_local_experts=8, num_experts_per_tok=1, interleave_moe_layer_step=1, attention_chunk_size=8192,
                  max_position_embeddings=32768, rope_theta=500000.0),
        vision=dict(hidden_size=1408, intermediate_size=5632, num_hidden_layers=34, num_attention_heads=16,
                    image_size=336, patch_size=14, projector_input_dim=4096, projector_output_dim=4096,
                    vision_output_dim=4096, pixel_shuffle_ratio=0.5),
        image_token=200092, image_start=200080, image_end=200081, image=200090, tile_x=200084, tile_y=200085),
    "tiny": dict(
        text=dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048),
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=56,
                    patch_size=7, projection_dim=32),
        image_token=300),
    "tiny-next": dict(
        text=dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048),
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=28,
                    patch_size=7, projection_dim=32),
        image_token=300, grid=[[28, 56], [56, 28], [56, 56]]),
}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def is_qwen(shape: dict) -> bool:
    return shape.get("kind") in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def write_checkpoint(shape: dict, path: Path, dtype: torch.dtype, device: str):
    import transformers

    if shape.get("kind") == "gemma3":
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        config = transformers.Gemma3Config(text_config=shape["text"], vision_config=shape["vision"],
                                           image_token_index=shape["image_token"], boi_token_index=shape["boi"],
                                           eoi_token_index=shape["eoi"], dtype=str(dtype).removeprefix("torch."))
        size = shape["vision"]["image_size"]
        processor = Gemma3ImageProcessorPil(size={"height": size, "width": size})
        return _write(transformers.Gemma3ForConditionalGeneration, config, processor, path, dtype, device, shape)
    if shape.get("kind") == "llama4":   # (plinth's processor for both: transformers' needs torchvision)
        from plinth.multimodal.llama4 import ImageProcessor

        config = transformers.Llama4Config(text_config=shape["text"], vision_config=shape["vision"],
                                           image_token_index=shape["image_token"], tie_word_embeddings=False,
                                           dtype=str(dtype).removeprefix("torch."))
        side = shape["vision"]["image_size"]
        model, _ = _write(transformers.Llama4ForConditionalGeneration, config, None, path, dtype, device, shape)
        # (Module.to(dtype) casts complex buffers too: the vision model's rotary table, complex64 as transformers
        # builds it in from_pretrained, is made again)
        rotary = model.vision_model.rotary_embedding
        rotary.freqs_ci = rotary._compute_freqs_ci(model.config.vision_config).to(device)
        (path / "preprocessor_config.json").write_text(json.dumps({"size": {"height": side, "width": side},
                                                                   "max_patches": 16}))
        return model, ImageProcessor(size=side)
    if shape.get("kind") == "internvl":
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

        config = transformers.InternVLConfig(text_config=shape["text"], vision_config=shape["vision"],
                                             image_token_id=shape["image_token"], tie_word_embeddings=True,
                                             dtype=str(dtype).removeprefix("torch."))
        side = shape["vision"]["image_size"][0]
        processor = GotOcr2ImageProcessorPil(size={"height": side, "width": side}, crop_to_patches=True,
                                             image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
        return _write(transformers.InternVLForConditionalGeneration, config, processor, path, dtype, device, shape)
    if shape.get("kind") == "idefics3":
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

        config = transformers.Idefics3Config(text_config=shape["text"], vision_config=shape["vision"],
                                             scale_factor=shape["scale_factor"], image_token_id=shape["image_token"],
                                             tie_word_embeddings=True, dtype=str(dtype).removeprefix("torch."))
        side = shape["vision"]["image_size"]
        processor = SmolVLMImageProcessorPil(size={"longest_edge": 4 * side}, max_image_size={"longest_edge": side})
        return _write(transformers.Idefics3ForConditionalGeneration, config, processor, path, dtype, device, shape)
    if shape.get("kind") == "mistral3":
        from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

        config = transformers.Mistral3Config(text_config=shape["text"], vision_config=shape["vision"],
                                             image_token_id=shape["image_token"], tie_word_embeddings=False,
                                             dtype=str(dtype).removeprefix("torch."))
        unit = shape["vision"]["patch_size"] * 2
        processor = PixtralImageProcessorPil(patch_size={"height": unit, "width": unit},
                                             size={"longest_edge": shape["vision"]["image_size"]})
        return _write(transformers.Mistral3ForConditionalGeneration, config, processor, path, dtype, device,
                      shape)
    if is_qwen(shape):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        cls = {"qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
               "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
               "qwen3_vl": transformers.Qwen3VLForConditionalGeneration}[shape["kind"]]
        config = cls.config_class(text_config=shape["text"], vision_config=shape["vision"],
                                  image_token_id=shape["image_token"], vision_start_token_id=shape["vision_start"],
                                  vision_end_token_id=shape["vision_end"],
                                  tie_word_embeddings=shape.get("tie", False),
                                  dtype=str(dtype).removeprefix("torch."))
        v = shape["vision"]
        processor = Qwen2VLImageProcessorPil(patch_size=v["patch_size"], temporal_patch_size=v["temporal_patch_size"],
                                             merge_size=v["spatial_merge_size"])
        return _write(cls, config, processor, path, dtype, device)
    text = transformers.LlamaConfig(**shape["text"], tie_word_embeddings=False)
    vision = transformers.CLIPVisionConfig(**shape["vision"])
    size = shape["vision"]["image_size"]
    common = dict(text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_index=shape["image_token"],
                  dtype=str(dtype).removeprefix("torch."))
    if "grid" in shape:
        config = transformers.LlavaNextConfig(**common, image_grid_pinpoints=shape["grid"])
        cls = transformers.LlavaNextForConditionalGeneration
        processor = transformers.LlavaNextImageProcessor(size={"shortest_edge": size},
                                                         crop_size={"height": size, "width": size},
                                                         image_grid_pinpoints=shape["grid"])
    else:
        config = transformers.LlavaConfig(**common)
        cls = transformers.LlavaForConditionalGeneration
        processor = transformers.CLIPImageProcessor(size={"shortest_edge": size},
                                                    crop_size={"height": size, "width": size})
    return _write(cls, config, processor, path, dtype, device)


def _write(cls, config, processor, path: Path, dtype: torch.dtype, device: str, shape: dict | None = None):
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config).to(dtype).eval()
    t0 = time.perf_counter()
    model.save_pretrained(path)
    if processor is not None:
        processor.save_pretrained(path)
    if shape is not None:   # a tokenizer that knows the model's image tokens
        _write_tokenizer(path, shape)
    print(f"checkpoint written in {time.perf_counter() - t0:.1f} s", flush=True)
    return model, processor


def _write_word_tokenizer(path: Path, vocab_size: int, names: dict[int, str], special: list[str],
                          newlines: dict[int, str] | None = None, bos: str = "<s>", eos: str = "</s>") -> None:
    """A word-level tokenizer over ``vocab_size`` ids whose ids in ``names`` have those names (``special`` of them
    special tokens; ``newlines``: ids of line-break runs, matched as text) and the others ``t<id>``: the benchmark's
    prompts are token ids, and the engine needs the names of a model's image tokens."""
    from tokenizers import AddedToken, Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    names = {0: "<unk>", **names, **(newlines or {})}
    vocab = {names.get(i, f"t{i}"): i for i in range(vocab_size)}
    for name in (bos, eos):
        vocab.setdefault(name, len(vocab))   # (named where the caller's ids leave them none)
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    if newlines:   # (the longest first)
        inner.add_tokens([AddedToken(t, normalized=False) for t in sorted(newlines.values(), key=len, reverse=True)])
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="<unk>", bos_token=bos, eos_token=eos)
    tok.add_special_tokens({"additional_special_tokens": special})
    tok.save_pretrained(path)


def _write_tokenizer(path: Path, shape: dict) -> None:
    """The shape's tokenizer: its image tokens at their ids (Mistral 3's rows, Gemma 3's line breaks, SmolVLM's tile
    tags, InternVL's image brackets)."""
    vocab = shape["text"]["vocab_size"]
    kind = shape.get("kind")
    if kind == "mistral3":
        names = {shape["image_token"]: "[IMG]", shape["image_break"]: "[IMG_BREAK]", shape["image_end"]: "[IMG_END]",
                 1: "<s>", 2: "</s>"}
        _write_word_tokenizer(path, vocab, names, ["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
    elif kind == "gemma3":   # (ids 107 to 111: runs of one to five line breaks, as in Gemma's vocabulary)
        names = {shape["boi"]: "<start_of_image>", shape["eoi"]: "<end_of_image>",
                 shape["image_token"]: "<image_soft_token>", 1: "<eos>", 2: "<bos>"}
        _write_word_tokenizer(path, vocab, names, [names[shape["boi"]], names[shape["eoi"]],
                                                   names[shape["image_token"]]],
                              {106 + k: "\n" * k for k in range(1, 6)}, bos="<bos>", eos="<eos>")
    elif kind == "idefics3":   # (SmolVLM's ids; 198 and 271: one and two line breaks)
        tags = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
        names = {shape["image_token"]: "<image>", shape["fake"]: "<fake_token_around_image>",
                 shape["global_img"]: "<global-img>", shape["end_of_utterance"]: "<end_of_utterance>",
                 **{shape["global_img"] + 1 + k: tag for k, tag in enumerate(tags)}, 1: "<|im_start|>", 2: "<|im_end|>"}
        _write_word_tokenizer(path, vocab, names, ["<image>", "<fake_token_around_image>", "<global-img>",
                                                   "<end_of_utterance>", *tags], {198: "\n", 271: "\n\n"},
                              bos="<|im_start|>", eos="<|im_end|>")
    elif kind == "llama4":
        names = {shape["image_token"]: "<|patch|>", shape["image_start"]: "<|image_start|>",
                 shape["image_end"]: "<|image_end|>", shape["image"]: "<|image|>",
                 shape["tile_x"]: "<|tile_x_separator|>", shape["tile_y"]: "<|tile_y_separator|>",
                 1: "<|begin_of_text|>", 2: "<|eot|>"}
        _write_word_tokenizer(path, vocab, names, [names[k] for k in names if k > 2], bos="<|begin_of_text|>",
                              eos="<|eot|>")
    elif kind == "internvl":
        names = {shape["image_token"]: "<IMG_CONTEXT>", shape["image_start"]: "<img>", shape["image_end"]: "</img>",
                 1: "<|im_start|>", 2: "<|im_end|>"}
        _write_word_tokenizer(path, vocab, names, ["<img>", "</img>", "<IMG_CONTEXT>"], bos="<|im_start|>",
                              eos="<|im_end|>")


def pictures(n: int, seed: int = 0) -> list:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray((rng.random((400, 500, 3)) * 255).astype("uint8")) for _ in range(n)]


def prompts_for(n: int, text_len: int, shape: dict, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    image_token = shape["image_token"]
    image = [shape["vision_start"], image_token, shape["vision_end"]] if is_qwen(shape) else [image_token]
    low = min(shape["text"]["vocab_size"], image_token, shape.get("vision_start", image_token)) - 1
    if shape.get("kind") == "mistral3":   # (its image tokens sit low in the vocabulary)
        low = shape["text"]["vocab_size"] - 1
    if shape.get("kind") == "gemma3":   # (a prompt names an image by its <start_of_image>)
        image, low = [shape["boi"]], shape["boi"] - 1
    if shape.get("kind") == "idefics3":   # (below its image tokens and tags)
        low = shape["global_img"] - 1
    if shape.get("kind") == "internvl":   # (below its image tokens)
        low = shape["image_start"] - 1
    if shape.get("kind") == "llama4":   # (a prompt names an image by <|image|>; below its image tokens)
        image, low = [shape["image"]], shape["image_start"] - 1
    out = []
    for _ in range(n):
        words = [int(t) for t in rng.integers(100, low, text_len)]
        out.append([1] + image + words)
    return out


def encoder_times(encode, batches: list[int], device: str, iters: int = 5) -> dict:
    """ms to encode the first ``b`` images, for each ``b`` of ``batches``."""
    out = {}
    for b in batches:
        encode(b)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            encode(b)
        sync(device)
        out[b] = (time.perf_counter() - t0) / iters * 1e3
    return out


def hf_run(model, processor, expanded: list[list[int]], images: list, args) -> dict:
    device = args.device
    image_token = SHAPES[args.shape]["image_token"]
    inputs: dict[int, dict] = {}

    def pixels_of(k: int) -> dict:   # the first k images as the model takes them
        if k not in inputs:
            extra = {}
            if SHAPES[args.shape].get("kind") == "mistral3":   # (as PixtralProcessor calls it: merged patches)
                unit = SHAPES[args.shape]["vision"]["patch_size"] * 2
                extra = {"patch_size": {"height": unit, "width": unit}}
            processed = processor(images=images[:k], return_tensors="pt", **extra)
            inputs[k] = {key: processed[key].to(device) for key in ("pixel_values", "image_sizes", "image_grid_thw",
                                                                     "pixel_attention_mask") if key in processed}
            inputs[k]["pixel_values"] = inputs[k]["pixel_values"].to(model.dtype)
        return inputs[k]

    res: dict = {}
    with torch.inference_mode():
        import inspect

        # (older transformers' Llama 4 asks for the feature strategy, which it then ignores)
        strategy = ({"vision_feature_select_strategy": "default"}
                    if "vision_feature_select_strategy" in inspect.signature(model.get_image_features).parameters
                    else {})
        res["encoder_ms"] = encoder_times(lambda k: model.get_image_features(**pixels_of(k), **strategy),
                                          args.encoder_batches, device)

        def gen(ids_rows, n):
            width = max(len(r) for r in ids_rows)
            ids = torch.tensor([[0] * (width - len(r)) + r for r in ids_rows], device=device)
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids_rows], device=device)
            extra = dict(pixels_of(len(ids_rows)))
            if "image_grid_thw" in extra:
                extra["mm_token_type_ids"] = (ids == image_token).int()
            if SHAPES[args.shape].get("kind") == "gemma3":   # (its image positions' bidirectional mask)
                extra["token_type_ids"] = (ids == image_token).long()
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, **extra)

        gen(expanded[:1], 4)
        gen(expanded, 4)

        def timed(n):
            sync(device)
            t0 = time.perf_counter()
            out = gen(expanded[:1], n)
            sync(device)
            return (time.perf_counter() - t0) * 1e3, out

        res["ttft_ms"] = timed(1)[0]
        short, _ = timed(args.max_tokens // 4)
        total, out = timed(args.max_tokens)
        res["ms_per_token"] = (total - short) / (args.max_tokens - args.max_tokens // 4)
        res["tokens"] = out[0, len(expanded[0]):].tolist()
        t0 = time.perf_counter()
        gen(expanded, args.max_tokens)
        sync(device)
        res["batch_tok_s"] = len(expanded) * args.max_tokens / (time.perf_counter() - t0)
    return res


def plinth_run(path: Path, prompts: list[list[int]], images: list, args) -> dict:
    from plinth import LLM, SamplingParams

    llm = LLM(str(path), dtype=args.dtype, platform=args.platform, max_model_len=args.max_model_len,
              max_num_seqs=max(args.requests, 1), gpu_memory_utilization=args.gpu_memory_utilization,
              enable_prefix_caching=False, seed=0, **json.loads(args.engine_kwargs))
    engine = llm.llm_engine
    res: dict = {}
    features = engine.runner.images
    prepared = [engine.images.prepare({"image": img}) for img in images]
    from plinth.multimodal.images import ImageItem

    def encode(k):   # the runner's path: the tower over every tile (LLaVA-NeXT: each image packed; Qwen2-VL: patches)
        items = [ImageItem(0, p.lengths[0], p.pixels[0], f"bench-{i}-{time.perf_counter()}", p.sizes[0],
                           p.grids[0] if p.grids else None,
                           mask=np.asarray(p.patterns[0]) == engine.images.embedding_token if p.patterns else None)
                 for i, p in enumerate(prepared[:k])]
        out = features.embeddings(items)
        features.clear()
        return out

    with torch.inference_mode():
        res["encoder_ms"] = encoder_times(encode, args.encoder_batches, args.device)

    def params(n):
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)

    def reqs(k, offset=0):
        return [{"prompt_token_ids": p, "multi_modal_data": {"image": images[(i + offset) % len(images)]}}
                for i, p in enumerate(prompts[:k])]

    for k in (1, args.requests):   # warm-up (the images encoded then dropped)
        llm.generate(reqs(k, 3), params(4), use_tqdm=False)

    def timed(n):
        engine.runner.images.clear()
        sync(args.device)
        t0 = time.perf_counter()
        out = llm.generate(reqs(1), params(n), use_tqdm=False)[0]
        sync(args.device)
        return (time.perf_counter() - t0) * 1e3, out

    res["ttft_ms"] = timed(1)[0]
    short, _ = timed(args.max_tokens // 4)
    total, out = timed(args.max_tokens)
    res["ms_per_token"] = (total - short) / (args.max_tokens - args.max_tokens // 4)
    res["tokens"] = list(out.outputs[0].token_ids)
    res["expanded"] = [list(o.prompt_token_ids) for o in llm.generate(reqs(args.requests), params(1), use_tqdm=False)]
    engine.runner.images.clear()
    t0 = time.perf_counter()
    llm.generate(reqs(args.requests), params(args.max_tokens), use_tqdm=False)
    sync(args.device)
    res["batch_tok_s"] = args.requests * args.max_tokens / (time.perf_counter() - t0)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llava-1.5-7b", choices=sorted(SHAPES),
                    help="llava-1.5-7b (576 positions an image), llava-next-7b (tiles: ~2,000-2,900), "
                         "qwen2-vl-7b / qwen2.5-vl-7b (252 for the 400x500 images used)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model-dir", default="/tmp/plinth-llava-bench")
    ap.add_argument("--text-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--encoder-batches", default="1,8,32")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: 2048 (LLaVA-1.5), 4096 (LLaVA-NeXT)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s (H100 SXM nominal)")
    ap.add_argument("--flops", type=float, default=989e12, help="dense bfloat16 FLOP/s (H100 SXM nominal)")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--engine-kwargs", default=None,
                    help="more LLM(...) keywords, as JSON (LLaVA-NeXT default: a token budget of 8192, above its "
                         "prompts, as session 55's figures were taken)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    args.encoder_batches = [int(b) for b in args.encoder_batches.split(",")]
    tiled = "grid" in SHAPES[args.shape]
    if args.max_model_len is None:
        args.max_model_len = 4096 if tiled or is_qwen(SHAPES[args.shape]) else 2048
    if args.engine_kwargs is None:
        args.engine_kwargs = '{"max_num_batched_tokens": 8192}' if tiled else "{}"
    args.platform = "cpu" if args.device == "cpu" else "cuda"
    dtype = getattr(torch, args.dtype)
    shape = SHAPES[args.shape]
    path = Path(args.model_dir)
    model, processor = write_checkpoint(shape, path, dtype, args.device)
    images = pictures(max(args.requests, max(args.encoder_batches)))
    lm_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters(remove_duplicate=False)
                   if "vision_tower" not in n and "multi_modal_projector" not in n and "embed_tokens" not in n
                   and "visual" not in n and "vision_model" not in n and "connector" not in n)
    vision = shape["vision"]
    if shape.get("kind") == "llama4":   # a decode token reads one expert of each layer's (and the shared one)
        experts = shape["text"]["num_local_experts"]
        lm_bytes -= sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                        if ".feed_forward.experts." in n) * (experts - 1) // experts
    if is_qwen(shape):   # every block runs; a patch a position
        positions = int(processor(images=images[:1], return_tensors="pt")["image_grid_thw"].prod())
        tower_params = sum(p.numel() for n, p in model.named_parameters() if "visual" in n)
    elif shape.get("kind") == "gemma3":   # every layer runs; the pooling and projection are small
        positions = (vision["image_size"] // vision["patch_size"]) ** 2
        tower_params = sum(p.numel() for n, p in model.named_parameters() if "vision_tower" in n)
    elif shape.get("kind") == "internvl":   # a tile (an image is several, and a thumbnail)
        positions = (vision["image_size"][0] // vision["patch_size"][0]) ** 2 + 1
        tower_params = sum(p.numel() for n, p in model.named_parameters() if "vision_tower" in n)
    elif shape.get("kind") == "llama4":   # a tile and its class token (an image is several, and a global view)
        positions = (vision["image_size"] // vision["patch_size"]) ** 2 + 1
        tower_params = sum(p.numel() for n, p in model.named_parameters() if "vision_model" in n)
    elif shape.get("kind") == "idefics3":   # a tile (an image is several, and a global view)
        positions = (vision["image_size"] // vision["patch_size"]) ** 2
        tower_params = sum(p.numel() for n, p in model.named_parameters() if "vision_model" in n)
    elif shape.get("kind") == "mistral3":
        unit = vision["patch_size"] * 2
        sizes = processor(images=images[:1], patch_size={"height": unit, "width": unit}, return_tensors="pt")
        positions = int(sizes["image_sizes"][0].prod()) // vision["patch_size"] ** 2
        tower_params = sum(p.numel() for n, p in model.named_parameters() if "vision_tower" in n)
    else:
        positions = (vision["image_size"] // vision["patch_size"]) ** 2 + 1
        tower_params = sum(p.numel() for n, p in model.named_parameters() if "vision_tower" in n) \
            * (vision["num_hidden_layers"] - 1) / vision["num_hidden_layers"]
    floors = {"decode_ms_per_token": lm_bytes / args.bandwidth * 1e3,
              "encoder_ms_per_tile": 2 * tower_params * positions / args.flops * 1e3}
    prompts = prompts_for(args.requests, args.text_len, shape)
    model_cpu = None
    if args.skip_transformers:
        del model
    else:
        model_cpu = model
    gc.collect()
    if args.device.startswith("cuda") and model_cpu is not None:   # plinth first, with the GPU to itself
        model_cpu = model_cpu.to("cpu")
        torch.cuda.empty_cache()
    ours = plinth_run(path, prompts, images, args)
    gc.collect()   # the engine and its KV cache
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    results = {"shape": args.shape, "device": torch.cuda.get_device_name() if args.device.startswith("cuda")
               else "cpu", "floors": floors, "plinth": {k: v for k, v in ours.items() if k != "expanded"}}
    if model_cpu is not None:
        model = model_cpu.to(args.device)
        theirs = hf_run(model, processor, ours["expanded"], images, args)
        results["transformers"] = theirs
        results["same_tokens"] = theirs["tokens"] == ours["tokens"]
        agree = next((i for i, (a, b) in enumerate(zip(theirs["tokens"], ours["tokens"], strict=False)) if a != b),
                     len(ours["tokens"]))
        results["tokens_agree_for"] = agree
    for name in ("plinth", "transformers"):
        r = results.get(name)
        if r is None:
            continue
        enc = ", ".join(f"{b}: {ms:.2f} ms" for b, ms in r["encoder_ms"].items())
        print(f"{name:12s} encoder [{enc}]  TTFT {r['ttft_ms']:.1f} ms  decode {r['ms_per_token']:.2f} ms/token  "
              f"{args.requests} requests: {r['batch_tok_s']:.1f} output tok/s", flush=True)
    print(f"floors: decode {floors['decode_ms_per_token']:.2f} ms/token, encoder "
          f"{floors['encoder_ms_per_tile']:.3f} ms a tile (LLaVA, Qwen2-VL: an image; LLaVA-NeXT: up to 5 an image)",
          flush=True)
    if "same_tokens" in results:
        print(f"greedy tokens agree for the first {results['tokens_agree_for']} of {args.max_tokens}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
