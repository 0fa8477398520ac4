"""InternVL (``InternVLForConditionalGeneration``: InternVL3 / InternVL3.5 in transformers' layout) with images: tiny
random checkpoints written by transformers, run by plinth (tiles and a thumbnail through InternViT, the pixel shuffle
and the projector; the prompt's ``<img>`` / ``</img>`` layout) and by transformers on the same pixels. The expected
prompt follows ``InternVLProcessor``'s rule (its constructor needs torchvision for its video side)."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import (
    decisive_weights,
    make_tokenizer,
    output_matches_transformers,
    random_picture,
    server_tokens_of_image_chat,
)

import plinth

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

#: positions a tile fills: 32-pixel tiles of 4-pixel patches, 2x2 shuffled
PER_TILE = 16


def _save(path, qk_norm: bool):
    """``qk_norm``: InternViT-6B's blocks (RMSNorms, q/k norms, no attention bias, a final LayerNorm); else
    InternViT-300M's (LayerNorms, biased attention, no final norm)."""
    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<img>", "</img>", "<IMG_CONTEXT>", "<video>"]})
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=tok.eos_token_id,
                bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id, model_type="qwen2")
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, patch_size=[4, 4],
                  image_size=[32, 32], use_qk_norm=qk_norm, norm_type="rms_norm" if qk_norm else "layer_norm",
                  use_mean_pooling=not qk_norm, attention_bias=not qk_norm)
    cfg = transformers.InternVLConfig(text_config=text, vision_config=vision, image_seq_length=PER_TILE,
                                      image_token_id=tok.convert_tokens_to_ids("<IMG_CONTEXT>"))
    torch.manual_seed(0)
    model = decisive_weights(transformers.InternVLForConditionalGeneration(cfg).eval())
    with torch.no_grad():   # (layer scales away from their initial 0.1, so that they count)
        for name, p in model.named_parameters():
            if "lambda" in name:
                p.normal_(1.0, 0.3)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    # (saved as the released -hf checkpoints save it, crop_to_patches off: InternVLProcessor turns it on for every
    # call, and so does plinth)
    GotOcr2ImageProcessorPil(size={"height": 32, "width": 32}, crop_to_patches=False, max_patches=6).save_pretrained(path)
    images = GotOcr2ImageProcessorPil(size={"height": 32, "width": 32}, crop_to_patches=True, max_patches=6)
    return model, images, tok


def _picture(seed: int, size: tuple[int, int] = (40, 90)) -> Image.Image:
    return random_picture(seed, size)


@pytest.fixture(scope="module", params=[False, True], ids=["internvit_300m", "internvit_6b"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("internvl")
    return (path, *_save(path, request.param))


def _processed(images_processor, tok, prompt: str, images: list) -> tuple[list[int], torch.Tensor | None]:
    """InternVLProcessor's rule: each ``<IMG_CONTEXT>`` becomes ``<img>``, the image's tiles' positions, ``</img>``;
    the tiles' pixels in order."""
    outs = [images_processor(images=[im], return_tensors="pt") for im in images]
    parts = prompt.split("<IMG_CONTEXT>")
    assert len(parts) == len(images) + 1
    text = parts[0] + "".join("<img>" + "<IMG_CONTEXT>" * PER_TILE * int(o["num_patches"][0]) + "</img>" + rest
                              for o, rest in zip(outs, parts[1:], strict=True))
    pixels = torch.cat([o["pixel_values"] for o in outs]) if outs else None
    return tok(text)["input_ids"], pixels


def test_images_equal_transformers(checkpoint):
    """Two images (one cut into a grid of tiles and a thumbnail, one a tile alone) in one prompt, prefilled in chunks
    of 16 tokens beside a text prompt: the prompt follows the processor's rule, and greedy tokens and each step's
    log-probabilities equal transformers'; the same prompt again is served from the prefix cache."""
    path, model, images, tok = checkpoint
    llm = plinth.LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off",
                     max_num_batched_tokens=16, enable_chunked_prefill=True, max_model_len=1024)
    a, b = _picture(1), _picture(2, (20, 24))
    prompt = "User: look<IMG_CONTEXT> and then<IMG_CONTEXT> end"
    params = plinth.SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    outs = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": [a, b]}}, "plain text here"], params)
    ids, pixels = _processed(images, tok, prompt, [a, b])
    assert outs[0].prompt_token_ids == ids
    assert len(pixels) == 4   # a: 2 tiles and its thumbnail; b: one tile
    output_matches_transformers(outs[0], model, pixel_values=pixels)
    output_matches_transformers(outs[1], model)
    hits = llm.llm_engine.block_manager.stats.hit_tokens
    again = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [a, b]}}, params)[0]
    assert llm.llm_engine.block_manager.stats.hit_tokens - hits >= len(ids) - 4
    assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids
    llm.close()


def test_layout_from_the_size_alone_chat_and_refusals(checkpoint):
    """The tiles an image is cut into, from its size alone, equal the processor's; chat and the server's ``/tokenize``
    lay an image out alike; a prompt already laid out and images given as embeddings are refused clearly."""
    from plinth.core.scheduler import RequestRejectedError

    path, model, images, tok = checkpoint
    llm = plinth.LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off", max_model_len=1024)
    support = llm.llm_engine.images
    for size in [(40, 90), (20, 24), (90, 40), (8, 8), (32, 32), (33, 130), (200, 10)]:
        pic = _picture(3, size)
        assert support.pattern_of(pic) == support._tiled_pictures([pic]).patterns[0], size
    img = _picture(7, (48, 24))
    chat = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": img},
                                                  {"type": "text", "text": "Paris"}]}],
                    plinth.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    rendered = tok.apply_chat_template([{"role": "user", "content": "<IMG_CONTEXT>\nParis"}], tokenize=False,
                                       add_generation_prompt=True)
    assert chat.prompt_token_ids == _processed(images, tok, rendered, [img])[0]
    laid = _processed(images, tok, "See <IMG_CONTEXT>", [img])[0]
    with pytest.raises(RequestRejectedError, match="layout already"):
        llm.generate({"prompt_token_ids": laid, "multi_modal_data": {"image": img}})
    with pytest.raises(RequestRejectedError, match="not embeddings"):
        llm.generate({"prompt": "See <IMG_CONTEXT>", "multi_modal_data": {"image": torch.zeros(PER_TILE, 64)}})
    llm.close()
    pytest.importorskip("fastapi")
    assert server_tokens_of_image_chat(path, img, "Paris") == chat.prompt_token_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_images_equal_transformers(tmp_path):
    """On a GPU: float32 tokens of an image prompt beside a text prompt equal transformers' on the CPU."""
    model, images, tok = _save(tmp_path, qk_norm=True)
    llm = plinth.LLM(str(tmp_path), dtype="float32", platform="cuda", block_size=16, gpu_memory_utilization=0.3)
    a = _picture(11, (56, 100))
    prompt = "See<IMG_CONTEXT> now"
    outs = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": a}}, "Large language models"],
                        plinth.SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True))
    ids, pixels = _processed(images, tok, prompt, [a])
    assert outs[0].prompt_token_ids == ids
    # (3e-3: InternViT's large random layer scales carry the GPU's float32 rounding further than other towers')
    output_matches_transformers(outs[0], model, steps=8, tol=3e-3, pixel_values=pixels)
    output_matches_transformers(outs[1], model, steps=8, tol=3e-3)
    llm.close()


def test_tile_count_settings(checkpoint):
    """``mm_processor_kwargs`` may set InternVL's tile counts (``max_patches``, ``min_patches``, ``crop_to_patches``),
    for the engine or one prompt: the prompt and pixels follow the processor so set; bad values are refused."""
    from plinth.config import ConfigError
    from plinth.core.scheduler import RequestRejectedError

    path, model, images, tok = checkpoint
    llm = plinth.LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off", max_model_len=1024,
                     mm_processor_kwargs={"max_patches": 2})
    a = _picture(1, (40, 130))
    params = plinth.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate({"prompt": "See <IMG_CONTEXT>", "multi_modal_data": {"image": a}}, params)[0]
    import copy

    fewer = copy.deepcopy(images)
    fewer.max_patches = 2
    assert out.prompt_token_ids == _processed(fewer, tok, "See <IMG_CONTEXT>", [a])[0]
    one = llm.generate({"prompt": "See <IMG_CONTEXT>", "multi_modal_data": {"image": a},
                        "mm_processor_kwargs": {"crop_to_patches": False}}, params)[0]
    assert one.prompt_token_ids.count(model.config.image_token_id) == PER_TILE   # one tile, no thumbnail
    with pytest.raises(RequestRejectedError, match="max_patches must be from 1 to 48"):
        llm.generate({"prompt": "See <IMG_CONTEXT>", "multi_modal_data": {"image": a},
                      "mm_processor_kwargs": {"max_patches": 0}}, params)
    llm.close()
    with pytest.raises(ConfigError, match="min_patches 3 is more than max_patches 2"):
        plinth.LLM(str(path), dtype="float32", platform="cpu", mm_processor_kwargs={"min_patches": 3,
                                                                                    "max_patches": 2})


def test_encoder_profile_takes_the_pair_sized_tiles(tmp_path):
    """Start-up's encoder pass (run on GPUs to size the KV cache) takes InternVL's tile size, which its config gives as
    a pair."""
    from plinth.config import ModelConfig
    from plinth.model_registry.loader import resolve_model_source
    from plinth.multimodal.runner import load_image_features

    _save(tmp_path, qk_norm=False)
    source = resolve_model_source(ModelConfig(model=str(tmp_path)))
    features = load_image_features(source, torch.float32, torch.device("cpu"))
    features.profile(1024, None)   # (13 tiles of 32x32; it raised on the pair before)
    assert features.encoder(torch.zeros(2, 3, 32, 32)).shape == (2, PER_TILE, 64)
