"""Llama 4 (``Llama4ForConditionalGeneration``) with images: tiny random checkpoints written by transformers, run by
plinth (tiles and a global view through Llama 4's vision model, the pixel shuffle, the adapter and the projector; the
prompt's ``<|image_start|>`` ... ``<|image_end|>`` layout) and by transformers on the same pixels. The expected prompt
follows ``Llama4Processor``'s rule; plinth's image processor is compared with transformers' ``Llama4ImageProcessor``
(which needs torchvision) where torchvision is installed, and with the canvases and sizes it chose, recorded below,
everywhere."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from conftest import decisive_weights, make_tokenizer, random_picture, server_tokens_of_image_chat
from test_llama4 import _randomize, _text_config

import plinth
from plinth.multimodal.llama4 import ImageProcessor

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

#: positions a tile fills: 32-pixel tiles of 4-pixel patches, 2x2 shuffled
PER_TILE = 16
SPECIALS = ["<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>",
            "<|tile_y_separator|>"]
#: what the checkpoint's preprocessor_config.json says (transformers' keys), tiles of the tower's 32 pixels
PREPROCESSOR = {"image_processor_type": "Llama4ImageProcessor", "size": {"height": 32, "width": 32}, "max_patches": 6,
                "resize_to_max_canvas": False, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                "rescale_factor": 1 / 255, "do_resize": True, "do_rescale": True, "do_normalize": True,
                "do_convert_rgb": True, "resample": 2}


def _save(path, **vision_overrides):
    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    vision = {**dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                     patch_size=4, projector_input_dim=48, projector_output_dim=48, vision_output_dim=48,
                     pixel_shuffle_ratio=0.5, rope_parameters={"rope_type": "default", "rope_theta": 100.0}),
              **vision_overrides}
    cfg = transformers.Llama4Config(text_config=_text_config(tok, max_position_embeddings=1024), vision_config=vision,
                                    image_token_index=tok.convert_tokens_to_ids("<|patch|>"),
                                    attn_implementation="eager")
    torch.manual_seed(0)
    model = decisive_weights(transformers.Llama4ForConditionalGeneration(cfg).eval())
    _randomize(model)
    with torch.no_grad():   # (a class token and learned positions that count)
        model.vision_model.class_embedding.normal_(0.0, 0.5)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return model, tok


def _picture(seed: int, size: tuple[int, int] = (40, 90)) -> Image.Image:
    return random_picture(seed, size)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama4")
    return (path, *_save(path))


def _layout(rows: int, cols: int) -> str:
    """``Llama4Processor``'s text for an image of ``rows x cols`` tiles."""
    text = "<|image_start|>"
    if rows * cols > 1:
        for _ in range(rows):
            text += "<|tile_x_separator|>".join(["<|patch|>" * PER_TILE] * cols) + "<|tile_y_separator|>"
    return text + "<|image|>" + "<|patch|>" * PER_TILE + "<|image_end|>"


def _processed(processor, tok, prompt: str, images: list) -> tuple[list[int], torch.Tensor]:
    """Each ``<|image|>`` of ``prompt`` laid out by its tiles; the tiles' pixels in order."""
    outs = [processor(images=[im]) for im in images]
    parts = prompt.split("<|image|>")
    assert len(parts) == len(images) + 1
    text = parts[0] + "".join(_layout(*o["aspect_ratios"][0].tolist()) + rest
                              for o, rest in zip(outs, parts[1:], strict=True))
    return tok(text)["input_ids"], torch.cat([o["pixel_values"] for o in outs])


@torch.no_grad()
def _hf_greedy(model, ids: list[int], pixels: torch.Tensor | None, n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens (a full forward each step) and their log-probabilities."""
    ids, lps = list(ids), []
    for _ in range(n):
        logits = model(input_ids=torch.tensor([ids]), pixel_values=pixels, use_cache=False).logits[0, -1]
        logp = torch.log_softmax(logits.double(), -1)
        ids.append(int(logp.argmax()))
        lps.append(float(logp.max()))
    return ids[len(ids) - n:], lps


def _matches(out, model, pixels, n: int, tol: float = 2e-4) -> None:
    tokens, lps = _hf_greedy(model, out.prompt_token_ids, pixels, n)
    assert out.outputs[0].token_ids == tokens
    got = [next(iter(s.values())).logprob for s in out.outputs[0].logprobs]
    assert got == pytest.approx(lps, abs=tol)


def test_images_equal_transformers(checkpoint):
    """Two images (one cut into a grid of tiles and a global view, one a tile alone) in one prompt, prefilled in
    chunks of 16 tokens beside a text prompt: the prompt follows the processor's rule, and greedy tokens and each
    step's log-probabilities equal transformers'; the same prompt again is served from the prefix cache."""
    path, model, tok = checkpoint
    llm = plinth.LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off",
                     max_num_batched_tokens=16, enable_chunked_prefill=True, max_model_len=1024)
    a, b = _picture(1), _picture(2, (20, 24))
    prompt = "User: look<|image|> and then<|image|> end"
    params = plinth.SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": [a, b]}}, "plain text here"], params)
    ids, pixels = _processed(ImageProcessor(size=32, max_patches=6), tok, prompt, [a, b])
    assert outs[0].prompt_token_ids == ids
    assert len(pixels) == 8   # a: 2 x 3 tiles (the least enlargement) and its global view; b: one tile
    assert ids.count(model.config.image_token_index) == 8 * PER_TILE
    _matches(outs[0], model, pixels, 6)
    _matches(outs[1], model, None, 6)
    hits = llm.llm_engine.block_manager.stats.hit_tokens
    again = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [a, b]}}, params)[0]
    assert llm.llm_engine.block_manager.stats.hit_tokens - hits >= len(ids) - 4
    assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids
    llm.close()


def test_layout_from_the_size_alone_chat_settings_and_refusals(checkpoint):
    """The tiles an image is cut into, from its size alone, equal the processor's; chat and the server's ``/tokenize``
    lay an image out alike; ``max_patches`` may be set; a prompt already laid out and images given as embeddings are
    refused clearly."""
    from plinth.core.scheduler import RequestRejectedError

    path, model, tok = checkpoint
    llm = plinth.LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off", max_model_len=1024)
    support = llm.llm_engine.images
    for size in [(40, 90), (20, 24), (90, 40), (8, 8), (32, 32), (33, 130), (200, 10), (64, 64)]:
        pic = _picture(3, size)
        assert support.pattern_of(pic) == support._tiled_pictures([pic]).patterns[0], size
    img = _picture(7, (48, 24))
    params = plinth.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    chat = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": img},
                                                  {"type": "text", "text": "Paris"}]}], params)[0]
    rendered = tok.apply_chat_template([{"role": "user", "content": "<|image|>\nParis"}], tokenize=False,
                                       add_generation_prompt=True)
    assert chat.prompt_token_ids == _processed(ImageProcessor(size=32, max_patches=6), tok, rendered, [img])[0]
    one = llm.generate({"prompt": "See <|image|>", "multi_modal_data": {"image": img},
                        "mm_processor_kwargs": {"max_patches": 1}}, params)[0]
    assert one.prompt_token_ids == _processed(ImageProcessor(size=32, max_patches=1), tok, "See <|image|>", [img])[0]
    assert one.prompt_token_ids.count(model.config.image_token_index) == PER_TILE   # one tile, no global view
    laid = _processed(ImageProcessor(size=32, max_patches=6), tok, "See <|image|>", [img])[0]
    with pytest.raises(RequestRejectedError, match="layout already"):
        llm.generate({"prompt_token_ids": laid, "multi_modal_data": {"image": img}})
    with pytest.raises(RequestRejectedError, match="not embeddings"):
        llm.generate({"prompt": "See <|image|>", "multi_modal_data": {"image": torch.zeros(PER_TILE, 64)}})
    with pytest.raises(RequestRejectedError, match="max_patches must be from 1 to 48"):
        llm.generate({"prompt": "See <|image|>", "multi_modal_data": {"image": img},
                      "mm_processor_kwargs": {"max_patches": 0}}, params)
    with pytest.raises(RequestRejectedError, match="image token"):
        llm.generate({"prompt": "See <|image|>"}, params)
    llm.close()
    pytest.importorskip("fastapi")
    assert server_tokens_of_image_chat(path, img, "Paris") == chat.prompt_token_ids


def test_server_request_processor_settings(checkpoint):
    """A chat request's ``mm_processor_kwargs`` (vLLM's field) process its images with those settings: ``/tokenize``
    and the reply's usage count the prompt so laid out, the reply equals the offline engine's with the same settings;
    a setting the processor does not take is a 400 naming the field."""
    pytest.importorskip("fastapi")
    import base64
    import io

    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    path, model, tok = checkpoint
    img = _picture(8, (40, 90))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "Paris"}]}]
    rendered = tok.apply_chat_template([{"role": "user", "content": "<|image|>\nParis"}], tokenize=False,
                                       add_generation_prompt=True)
    want = _processed(ImageProcessor(size=32, max_patches=1), tok, rendered, [img])[0]
    llm = plinth.LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off", max_model_len=1024)
    offline = llm.generate({"prompt_token_ids": tok(rendered)["input_ids"], "multi_modal_data": {"image": img},
                            "mm_processor_kwargs": {"max_patches": 1}},
                           plinth.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    llm.close()
    assert offline.prompt_token_ids == want
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(path), dtype="float32", block_size=4, selection="off",
                                                platform="cpu", max_model_len=1024))
    with TestClient(build_app(AsyncLLMEngine(engine))) as http:
        r = http.post("/tokenize", json={"messages": messages, "mm_processor_kwargs": {"max_patches": 1}})
        assert r.status_code == 200 and r.json()["tokens"] == want, r.text
        assert http.post("/tokenize", json={"messages": messages}).json()["count"] > len(want)   # (6 tiles otherwise)
        r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "temperature": 0,
                                                    "ignore_eos": True, "mm_processor_kwargs": {"max_patches": 1}})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(want)
        assert r.json()["choices"][0]["message"]["content"] == offline.outputs[0].text
        for bad in ({"max_patches": 0}, {"patch_size": 4}):
            r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2,
                                                        "mm_processor_kwargs": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "mm_processor_kwargs", r.text


def test_inconsistent_vision_config_is_refused(tmp_path):
    """A vision config whose adapter cannot take the pixel shuffle's features fails at load, clearly."""
    from plinth.errors import UnsupportedModelError

    _save(tmp_path, intermediate_size=96)
    with pytest.raises(UnsupportedModelError, match="intermediate_size 96"):
        plinth.LLM(str(tmp_path), dtype="float32", platform="cpu", selection="off", block_size=4)


def test_preprocessor_config_values(tmp_path):
    """A ``preprocessor_config.json``'s settings: one mean and deviation for every channel (as transformers takes
    them) give the processor the lists give; a ``max_patches`` out of range, a non-square tile or another resampling
    fail at load, clearly."""
    from types import SimpleNamespace

    from plinth.errors import ModelLoadError

    config = SimpleNamespace(vision_config=SimpleNamespace(image_size=32))
    img = _picture(9, (40, 70))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**PREPROCESSOR, "image_mean": 0.5,
                                                                   "image_std": 0.25}))
    scalar = ImageProcessor.for_checkpoint(config, str(tmp_path))
    lists = ImageProcessor(size=32, max_patches=6, image_std=(0.25, 0.25, 0.25))
    assert torch.equal(scalar(images=[img])["pixel_values"], lists(images=[img])["pixel_values"])
    for change, message in [({"max_patches": 0}, "max_patches must be an integer from 1 to 48"),
                            ({"size": {"height": 32, "width": 64}}, "tiles are square"),
                            ({"resample": 3}, "bilinearly"), ({"image_mean": [0.5, 0.5]}, "one value a channel")]:
        (tmp_path / "preprocessor_config.json").write_text(json.dumps({**PREPROCESSOR, **change}))
        with pytest.raises(ModelLoadError, match=message):
            ImageProcessor.for_checkpoint(config, str(tmp_path))


#: ``(height, width, max_patches, resize_to_max_canvas, rows, cols, resized height, resized width)``: the canvas of
#: tiles transformers' ``Llama4ImageProcessor`` (transformers 5.25, 336-pixel tiles) chose for an image, and the size
#: it resized the image to in it (found from its padding); recorded with torchvision installed
RECORDED = [
    (720, 1280, 16, False, 3, 4, 720, 1280), (360, 640, 16, False, 2, 2, 360, 640),
    (500, 700, 16, False, 2, 3, 500, 700), (336, 336, 16, False, 1, 1, 336, 336),
    (100, 100, 16, False, 1, 1, 336, 336), (1000, 200, 16, False, 3, 1, 1000, 200),
    (200, 1000, 16, False, 1, 3, 200, 1000), (337, 335, 16, False, 2, 1, 337, 335),
    (2000, 1500, 16, False, 4, 3, 1344, 1008), (50, 900, 16, False, 1, 3, 50, 900),
    (672, 336, 16, False, 2, 1, 672, 336), (1, 1, 16, False, 1, 1, 336, 336),
    (3, 500, 16, False, 1, 2, 3, 500), (900, 901, 16, False, 3, 3, 900, 901),
    (1344, 1344, 16, False, 4, 4, 1344, 1344), (1080, 1920, 16, False, 3, 5, 945, 1680),
    (480, 640, 16, False, 2, 2, 480, 640), (768, 1024, 16, False, 3, 4, 768, 1024),
    (299, 1201, 16, False, 1, 4, 299, 1201), (1500, 40, 16, False, 5, 1, 1500, 40),
    (720, 1280, 16, True, 3, 5, 945, 1680), (360, 640, 16, True, 3, 5, 945, 1680),
    (500, 700, 16, True, 3, 5, 1008, 1411), (336, 336, 16, True, 4, 4, 1344, 1344),
    (100, 100, 16, True, 4, 4, 1344, 1344), (1000, 200, 16, True, 8, 2, 2688, 537),
    (200, 1000, 16, True, 2, 8, 537, 2688), (337, 335, 16, True, 4, 4, 1344, 1336),
    (2000, 1500, 16, True, 4, 3, 1344, 1008), (50, 900, 16, True, 1, 16, 298, 5376),
    (672, 336, 16, True, 5, 3, 1680, 840), (1, 1, 16, True, 4, 4, 1344, 1344),
    (3, 500, 16, True, 1, 16, 32, 5376), (900, 901, 16, True, 4, 4, 1342, 1344),
    (1344, 1344, 16, True, 4, 4, 1344, 1344), (1080, 1920, 16, True, 3, 5, 945, 1680),
    (480, 640, 16, True, 3, 4, 1008, 1344), (768, 1024, 16, True, 3, 4, 1008, 1344),
    (299, 1201, 16, True, 2, 8, 669, 2688), (1500, 40, 16, True, 16, 1, 5376, 143),
    (720, 1280, 4, False, 2, 2, 377, 672), (360, 640, 4, False, 2, 2, 360, 640),
    (500, 700, 4, False, 2, 2, 480, 672), (336, 336, 4, False, 1, 1, 336, 336),
    (100, 100, 4, False, 1, 1, 336, 336), (1000, 200, 4, False, 3, 1, 1000, 200),
    (200, 1000, 4, False, 1, 3, 200, 1000), (337, 335, 4, False, 2, 1, 337, 335),
    (2000, 1500, 4, False, 2, 2, 672, 504), (50, 900, 4, False, 1, 3, 50, 900),
    (672, 336, 4, False, 2, 1, 672, 336), (1, 1, 4, False, 1, 1, 336, 336), (3, 500, 4, False, 1, 2, 3, 500),
    (900, 901, 4, False, 2, 2, 671, 672), (1344, 1344, 4, False, 2, 2, 672, 672),
    (1080, 1920, 4, False, 2, 2, 378, 672), (480, 640, 4, False, 2, 2, 480, 640),
    (768, 1024, 4, False, 2, 2, 504, 672), (299, 1201, 4, False, 1, 4, 299, 1201),
    (1500, 40, 4, False, 4, 1, 1344, 35), (720, 1280, 1, False, 1, 1, 188, 336),
    (360, 640, 1, False, 1, 1, 188, 336), (500, 700, 1, False, 1, 1, 240, 336),
    (336, 336, 1, False, 1, 1, 336, 336), (100, 100, 1, False, 1, 1, 336, 336),
    (1000, 200, 1, False, 1, 1, 336, 67), (200, 1000, 1, False, 1, 1, 67, 336),
    (337, 335, 1, False, 1, 1, 336, 334), (2000, 1500, 1, False, 1, 1, 336, 252),
    (50, 900, 1, False, 1, 1, 18, 336), (672, 336, 1, False, 1, 1, 336, 168),
    (1, 1, 1, False, 1, 1, 336, 336), (3, 500, 1, False, 1, 1, 2, 336), (900, 901, 1, False, 1, 1, 335, 336),
    (1344, 1344, 1, False, 1, 1, 336, 336), (1080, 1920, 1, False, 1, 1, 189, 336),
    (480, 640, 1, False, 1, 1, 251, 336), (768, 1024, 1, False, 1, 1, 252, 336),
    (299, 1201, 1, False, 1, 1, 83, 336), (1500, 40, 1, False, 1, 1, 336, 8),
    (720, 1280, 6, False, 2, 3, 567, 1008), (360, 640, 6, False, 2, 2, 360, 640),
    (500, 700, 6, False, 2, 3, 500, 700), (336, 336, 6, False, 1, 1, 336, 336),
    (100, 100, 6, False, 1, 1, 336, 336), (1000, 200, 6, False, 3, 1, 1000, 200),
    (200, 1000, 6, False, 1, 3, 200, 1000), (337, 335, 6, False, 2, 1, 337, 335),
    (2000, 1500, 6, False, 3, 2, 896, 672), (50, 900, 6, False, 1, 3, 50, 900),
    (672, 336, 6, False, 2, 1, 672, 336), (1, 1, 6, False, 1, 1, 336, 336), (3, 500, 6, False, 1, 2, 3, 500),
    (900, 901, 6, False, 2, 3, 672, 672), (1344, 1344, 6, False, 2, 2, 672, 672),
    (1080, 1920, 6, False, 2, 3, 567, 1008), (480, 640, 6, False, 2, 2, 480, 640),
    (768, 1024, 6, False, 2, 3, 672, 896), (299, 1201, 6, False, 1, 4, 299, 1201),
    (1500, 40, 6, False, 5, 1, 1500, 40),
]


def test_canvas_and_size_equal_recorded_transformers():
    """The canvas and the resized size equal transformers' for images of many shapes and settings (enlarging,
    reducing, ties among canvases, the float32 scale transformers computes where the bound is the canvas's)."""
    for h, w, most, widest, rows, cols, new_h, new_w in RECORDED:
        proc = ImageProcessor(max_patches=most, resize_to_max_canvas=widest)
        assert proc.grid(h, w) == (rows, cols), (h, w, most, widest)
        assert proc.fitted(h, w, rows * 336, cols * 336) == (new_h, new_w), (h, w, most, widest)
        assert proc.tiles(h, w) == rows * cols + (rows * cols > 1)


def test_processor_equals_transformers(checkpoint):
    """With torchvision installed: pixels and aspect ratios equal transformers' ``Llama4ImageProcessor``'s exactly,
    and ``Llama4Processor`` makes the prompt plinth makes."""
    pytest.importorskip("torchvision")
    from transformers.models.llama4.image_processing_llama4 import Llama4ImageProcessor

    rng = np.random.default_rng(0)
    for most, widest, extra in [(16, False, {}), (16, True, {}), (4, False, {}), (1, False, {}),
                                (4, False, {"do_normalize": False}), (4, False, {"rescale_factor": 0.5 / 255})]:
        theirs = Llama4ImageProcessor(max_patches=most, resize_to_max_canvas=widest, **extra)
        mine = ImageProcessor(max_patches=most, resize_to_max_canvas=widest, **extra)
        for h, w in [(500, 700), (720, 1280), (100, 100), (337, 335), (2000, 1500), (3, 500), (1080, 1920)]:
            img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            want, got = theirs(images=[img], return_tensors="pt"), mine(images=[img])
            assert want["aspect_ratios"].tolist() == got["aspect_ratios"].tolist()
            assert torch.equal(want["pixel_values"].float(), got["pixel_values"]), (h, w, most, widest, extra)
    rgba = Image.fromarray(rng.integers(0, 256, (50, 90, 4), dtype=np.uint8), "RGBA")   # (transparency over white)
    want = Llama4ImageProcessor(max_patches=4)(images=[rgba], return_tensors="pt")["pixel_values"].float()
    assert torch.equal(want, ImageProcessor(max_patches=4)(images=[rgba])["pixel_values"])
    path, model, tok = checkpoint
    processor = transformers.Llama4Processor(image_processor=Llama4ImageProcessor(**{
        k: v for k, v in PREPROCESSOR.items() if k != "image_processor_type"}), tokenizer=tok, patch_size=4)
    a, b = _picture(4, (70, 20)), _picture(5, (30, 33))
    prompt = "Two: <|image|> and <|image|>."
    want = processor(text=prompt, images=[a, b], return_tensors="pt")
    llm = plinth.LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off", max_model_len=1024)
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [a, b]}},
                       plinth.SamplingParams(temperature=0, max_tokens=4, logprobs=0, ignore_eos=True))[0]
    assert out.prompt_token_ids == want["input_ids"][0].tolist()
    _matches(out, model, want["pixel_values"].float(), 4)
    llm.close()


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tensor_parallel", "pipeline_stages"])
def test_images_on_worker_processes(checkpoint, tp, pp):
    """Two tensor-parallel ranks (the experts' and heads' features split) or two pipeline stages give the
    one-process engine's tokens for image prompts."""
    from conftest import generate_on_tp_workers

    path = checkpoint[0]
    prompts = [{"prompt": "A <|image|> then <|image|> end", "multi_modal_data": {"image": [_picture(3), _picture(4)]}},
               {"prompt": "<|image|> alone", "multi_modal_data": {"image": _picture(5, (32, 32))}}]
    params = plinth.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = plinth.LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off")
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.close()
    got = generate_on_tp_workers(path, prompts, params, size=tp, pp=pp)
    assert [o.outputs[0].token_ids for o in got] == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_images_equal_transformers(tmp_path):
    """On a GPU: float32 tokens of an image prompt beside a text prompt equal transformers' on the CPU."""
    model, tok = _save(tmp_path)
    llm = plinth.LLM(str(tmp_path), dtype="float32", platform="cuda", block_size=8, gpu_memory_utilization=0.3)
    a = _picture(11, (56, 100))
    prompt = "See<|image|> now"
    outs = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": a}}, "Large language models"],
                        plinth.SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True))
    ids, pixels = _processed(ImageProcessor(size=32, max_patches=6), tok, prompt, [a])
    assert outs[0].prompt_token_ids == ids
    _matches(outs[0], model, pixels, 8, tol=1e-3)
    _matches(outs[1], model, None, 8, tol=1e-3)
    llm.close()
