"""Idefics3 and SmolVLM (``Idefics3ForConditionalGeneration``: SmolVLM-256M/500M/2B-Instruct, Idefics3-8B;
``SmolVLMForConditionalGeneration``: SmolVLM2) with images: tiny random checkpoints written by transformers, run by
plinth (tiles and a global view through the SigLIP tower, the pixel shuffle and projection, the prompt laid out by
the tiles) and by transformers on the same pixels."""

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

SPECIAL = (["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
           + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)])
#: positions a tile fills: 32-pixel tiles of 4-pixel patches, 2x2 shuffled
PER_TILE = 16


def _save(path, kind: str):
    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=tok.eos_token_id,
                bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id, model_type="llama")
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, patch_size=4,
                  image_size=32)
    cls = (transformers.Idefics3ForConditionalGeneration if kind == "idefics3"
           else transformers.SmolVLMForConditionalGeneration)
    cfg = cls.config_class(text_config=text, vision_config=vision, scale_factor=2,
                           image_token_id=tok.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    model = decisive_weights(cls(cfg).eval())
    model.save_pretrained(path)
    tok.save_pretrained(path)
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    images = SmolVLMImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    images.save_pretrained(path)
    return model, Idefics3Processor(images, tok, image_seq_len=PER_TILE)


def _picture(seed: int, size: tuple[int, int] = (40, 52)) -> Image.Image:
    return random_picture(seed, size)


@pytest.fixture(scope="module", params=["idefics3", "smolvlm"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return (path, *_save(path, request.param))


def _matches(out, model, processor, prompt: str, images: list) -> None:
    """``out``'s prompt is the processor's for ``prompt`` and ``images``, its tokens and log-probs transformers'."""
    inputs = processor(text=prompt, images=[images] if images else None, return_tensors="pt")
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    extra = ({"pixel_values": inputs["pixel_values"], "pixel_attention_mask": inputs["pixel_attention_mask"]}
             if images else {})
    output_matches_transformers(out, model, **extra)


def test_images_equal_transformers(checkpoint):
    """Two images (one cut into 2x2 tiles and a global view, one into a row of tiles) in one prompt, prefilled in
    chunks of 16 tokens beside a text prompt: the prompt is the processor's (each tile's tokens, a line break after
    each row, the global view last) and greedy tokens and each step's log-probabilities equal transformers'; the same
    prompt again is served from the prefix cache."""
    path, model, processor = checkpoint
    llm = plinth.LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off",
                     max_num_batched_tokens=16, enable_chunked_prefill=True, max_model_len=1024)
    a, b = _picture(1), _picture(2, (20, 70))
    prompt = "User: look<image> and then<image> end"
    params = plinth.SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    outs = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": [a, b]}}, "plain text here"], params)
    image = model.config.image_token_id
    assert outs[0].prompt_token_ids.count(image) == (4 + 1 + 2 + 1) * PER_TILE
    _matches(outs[0], model, processor, prompt, [a, b])
    _matches(outs[1], model, processor, "plain text here", [])
    hits = llm.llm_engine.block_manager.stats.hit_tokens
    again = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [a, b]}}, params)[0]
    assert llm.llm_engine.block_manager.stats.hit_tokens - hits >= len(outs[0].prompt_token_ids) - 4
    assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids
    llm.close()


def test_layout_from_the_size_alone(checkpoint):
    """The tiles an image is cut into, from its size alone (what the server counts before any pixels are made),
    equal the processor's for wide, tall, small, one-tile and odd sizes; a prompt already laid out and images given
    as embeddings are refused clearly."""
    from plinth.core.scheduler import RequestRejectedError
    from plinth.multimodal.idefics3 import grid_of

    path, model, processor = checkpoint
    images = processor.image_processor
    for size in [(40, 52), (20, 70), (70, 20), (8, 8), (32, 32), (33, 31), (1, 300), (500, 3), (64, 64), (63, 65)]:
        out = images(images=[_picture(3, size)], return_tensors="pt", return_row_col_info=True)
        assert grid_of(images, size) == (out["rows"][0][0], out["cols"][0][0]), size
    llm = plinth.LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off", max_model_len=1024)
    support = llm.llm_engine.images
    for size in [(40, 52), (20, 70), (8, 8)]:
        pic = _picture(4, size)
        assert support.pattern_of(pic) == support._tiled_pictures([pic]).patterns[0]
    fixed = type(images)(size={"height": 64, "width": 64}, max_image_size={"longest_edge": 32})
    with pytest.raises(KeyError):   # (a size as height and width: the server runs the processor for the count)
        grid_of(fixed, (30, 40))
    laid = processor(text="See <image>", images=[[_picture(5)]], return_tensors="pt")["input_ids"][0].tolist()
    with pytest.raises(RequestRejectedError, match="plinth lays out its tiles"):
        llm.generate({"prompt_token_ids": laid, "multi_modal_data": {"image": _picture(5)}})
    with pytest.raises(RequestRejectedError, match="not embeddings"):
        llm.generate({"prompt": "See <image>", "multi_modal_data": {"image": torch.zeros(PER_TILE, 64)}})
    llm.close()


def test_chat_and_tokenize(checkpoint):
    """``LLM.chat`` with an image part and the server's ``/tokenize`` lay the image out as ``generate`` does."""
    pytest.importorskip("fastapi")
    path, model, processor = checkpoint
    img = _picture(7, (48, 24))
    llm = plinth.LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off")
    params = plinth.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    chat = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": img},
                                                  {"type": "text", "text": "Paris"}]}], params)[0]
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": "<image>\nParis"}], tokenize=False,
                                                   add_generation_prompt=True)
    inputs = processor(text=text, images=[[img]], return_tensors="pt", add_special_tokens=False)
    assert chat.prompt_token_ids == inputs["input_ids"][0].tolist()
    llm.close()
    assert server_tokens_of_image_chat(path, img, "Paris") == chat.prompt_token_ids


def test_images_on_tensor_parallel_workers(tmp_path):
    """Two tensor-parallel ranks (each encodes the tiles) give the one-process engine's tokens."""
    from conftest import generate_on_tp_workers

    _save(tmp_path, "idefics3")
    prompts = [{"prompt": "A<image> then<image> end", "multi_modal_data": {"image": [_picture(3), _picture(4)]}},
               "plain text here"]
    params = plinth.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = plinth.LLM(str(tmp_path), dtype="float32", platform="cpu", block_size=4, selection="off")
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.close()
    got = generate_on_tp_workers(tmp_path, prompts, params, size=2)
    assert [o.outputs[0].token_ids for o in got] == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_images_equal_transformers(tmp_path):
    """On a GPU: float32 tokens of an image prompt beside a text prompt equal transformers' on the CPU."""
    model, processor = _save(tmp_path, "idefics3")
    llm = plinth.LLM(str(tmp_path), dtype="float32", platform="cuda", block_size=16, gpu_memory_utilization=0.3)
    a = _picture(11, (56, 40))
    prompt = "See<image> now"
    outs = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": a}}, "Large language models"],
                        plinth.SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True))
    inputs = processor(text=prompt, images=[[a]], return_tensors="pt")
    assert outs[0].prompt_token_ids == inputs["input_ids"][0].tolist()
    output_matches_transformers(outs[0], model, steps=8, tol=1e-3, pixel_values=inputs["pixel_values"],
                                pixel_attention_mask=inputs["pixel_attention_mask"])
    output_matches_transformers(outs[1], model, steps=8, tol=1e-3)
    llm.close()
