"""Image inputs (LLaVA): tiny random LLaVA checkpoints written by transformers, run by plinth and by transformers'
``LlavaForConditionalGeneration`` on the same pixels."""

from __future__ import annotations

import base64
import io
import json
import threading
import time

import numpy as np
import pytest
import torch
import transformers
from conftest import decisive_weights, generate_on_tp_workers, make_tokenizer, random_picture

from plinth import LLM, SamplingParams
from plinth.core.scheduler import RequestRejectedError

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

IMAGE = 28   # pixels a side; patches of 7: 16 positions an image
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
        "{% if p['type'] == 'image' %}<image>\n{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _picture(seed: int, size: tuple[int, int] = (40, 52)) -> Image.Image:
    return random_picture(seed, size)


def _save_llava(path, tower: str = "clip", seed: int = 0, vision_hidden: int = 32, text_model: str = "llama",
                **extra):
    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_id = tok.convert_tokens_to_ids("<image>")
    text_kw = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   tie_word_embeddings=False, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                   pad_token_id=tok.pad_token_id)
    text = {"llama": lambda: transformers.LlamaConfig(**text_kw),
            "granite": lambda: transformers.GraniteConfig(**text_kw, embedding_multiplier=12.0, logits_scaling=1.0,
                                                          attention_multiplier=0.25),
            "gemma": lambda: transformers.GemmaConfig(**{**text_kw, "tie_word_embeddings": True}, head_dim=16,
                                                      hidden_activation="gelu_pytorch_tanh")}[text_model]()
    common = dict(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden, num_hidden_layers=3,
                  num_attention_heads=2, image_size=IMAGE, patch_size=7)
    if tower == "siglip":
        vision = transformers.SiglipVisionConfig(**common)
        processor = transformers.SiglipImageProcessor(size={"height": IMAGE, "width": IMAGE})
    else:
        vision = transformers.CLIPVisionConfig(projection_dim=32, **common)
        processor = transformers.CLIPImageProcessor(size={"shortest_edge": IMAGE},
                                                    crop_size={"height": IMAGE, "width": IMAGE})
    if tower == "next":   # LLaVA-NeXT: tiles of up to 2x2 tile sizes
        grid = [[IMAGE, 2 * IMAGE], [2 * IMAGE, IMAGE], [2 * IMAGE, 2 * IMAGE]]
        processor = transformers.LlavaNextImageProcessor(size={"shortest_edge": IMAGE},
                                                         crop_size={"height": IMAGE, "width": IMAGE},
                                                         image_grid_pinpoints=grid)
        config = transformers.LlavaNextConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                              image_token_index=image_id, image_grid_pinpoints=grid, **extra)
        cls = transformers.LlavaNextForConditionalGeneration
    else:
        config = transformers.LlavaConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                          image_token_index=image_id, **extra)
        cls = transformers.LlavaForConditionalGeneration
    torch.manual_seed(seed)
    model = decisive_weights(cls(config).eval())
    model.save_pretrained(path)
    tok.chat_template = CHAT
    tok.save_pretrained(path)
    processor.save_pretrained(path)
    return model, processor, tok


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    path = tmp_path_factory.mktemp("llava")
    model, processor, tok = _save_llava(path)
    return path, model, processor, tok


@pytest.fixture(scope="module")
def llm(llava):
    return LLM(str(llava[0]), dtype="float32", platform="cpu", block_size=4, selection="off")


def _reference(model, processor, ids, images, steps=6):
    """transformers' greedy tokens and each step's log-probabilities for an expanded prompt and its images."""
    extra = {k: v for k, v in processor(images=images, return_tensors="pt").items()
             if k in ("pixel_values", "image_sizes")} if images else {}
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=steps, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, **extra)
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, [torch.log_softmax(s[0].float(), -1) for s in out.scores]


def _greedy(steps=6, logprobs=5):
    return SamplingParams(max_tokens=steps, temperature=0.0, logprobs=logprobs, ignore_eos=True)


def test_tokens_and_logprobs_equal_transformers(llava, llm):
    """A prompt with an image in its middle: the placeholder widened to the image's 16 positions, whose embeddings
    are the vision tower's next-to-last layer through the projector; greedy tokens and every step's top
    log-probabilities equal transformers' on the same pixels."""
    _, model, processor, _ = llava
    img = _picture(1)
    out = llm.generate({"prompt": "The quick <image> brown fox", "multi_modal_data": {"image": img}}, _greedy())[0]
    image_id = model.config.image_token_index
    assert out.prompt_token_ids.count(image_id) == 16
    tokens, logprobs = _reference(model, processor, out.prompt_token_ids, [img])
    assert out.outputs[0].token_ids == tokens
    for step, ref in zip(out.outputs[0].logprobs, logprobs, strict=True):
        for tid, lp in step.items():
            assert abs(lp.logprob - ref[tid].item()) < 1e-4
    # the image matters: another picture gives other log-probabilities
    other = llm.generate({"prompt": "The quick <image> brown fox", "multi_modal_data": {"image": _picture(2)}},
                         _greedy())[0]
    first = {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}
    second = {t: lp.logprob for t, lp in other.outputs[0].logprobs[0].items()}
    assert first != second


def test_two_images_in_one_prompt_and_a_batch(llava, llm):
    """Two images in one prompt (in order), and a batch mixing prompts with and without images: each equal to
    transformers alone."""
    _, model, processor, _ = llava
    a, b = _picture(3), _picture(4, (60, 30))
    prompts = [{"prompt": "<image> Paris <image> is", "multi_modal_data": {"image": [a, b]}},
               "The quick brown fox",
               {"prompt": "Berlin <image>", "multi_modal_data": {"image": b}},
               {"prompt": "<image><image> compare", "multi_modal_data": {"image": [b, a]}}]   # adjacent images
    outs = llm.generate(prompts, _greedy(logprobs=None))
    assert outs[0].prompt_token_ids.count(model.config.image_token_index) == 32
    assert outs[3].prompt_token_ids.count(model.config.image_token_index) == 32
    for out, images in zip(outs, [[a, b], [], [b], [b, a]], strict=True):
        assert out.outputs[0].token_ids == _reference(model, processor, out.prompt_token_ids, images)[0]
    # (the prompts' images are processed together before any is queued: one unreadable image queues none)
    from plinth.core.scheduler import RequestRejectedError

    with pytest.raises(RequestRejectedError, match="cannot be read as an image"):
        llm.generate([{"prompt": "<image> a", "multi_modal_data": {"image": a}},
                      {"prompt": "<image> b", "multi_modal_data": {"image": b"not an image"}}], _greedy())
    assert not llm.llm_engine.has_unfinished_requests()


def test_prefix_cache_keys_blocks_by_image(llava):
    """Blocks holding image positions are cached under the image's digest: the same image and text again hits the
    cache through the image, another image with the same text does not (and still gets its own tokens)."""
    path, model, processor, _ = llava
    llm = LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off", enable_prefix_caching=True)
    prompt = "Paris is the capital <image> of France, and Berlin"
    a, b = _picture(5), _picture(6)
    first = llm.generate({"prompt": prompt, "multi_modal_data": {"image": a}}, _greedy(logprobs=None))[0]
    again = llm.generate({"prompt": prompt, "multi_modal_data": {"image": a}}, _greedy(logprobs=None))[0]
    other = llm.generate({"prompt": prompt, "multi_modal_data": {"image": b}}, _greedy(logprobs=None))[0]
    start = first.prompt_token_ids.index(model.config.image_token_index)
    assert again.num_cached_tokens > start + 16   # past the image
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens <= start       # the blocks before the image only
    assert other.outputs[0].token_ids == _reference(model, processor, other.prompt_token_ids, [b])[0]


def test_chunked_prefill_splits_an_image(llava):
    """A prefill budget of 8 tokens a step cuts the image's 16 positions over several steps: the encoder runs once
    and each chunk takes its slice; the tokens equal transformers'."""
    path, model, processor, _ = llava
    llm = LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off", max_num_batched_tokens=8,
              max_num_seqs=2, enable_chunked_prefill=True)
    calls = []
    encoder = llm.llm_engine.runner.images.encoder
    encoder.register_forward_hook(lambda *_: calls.append(1))
    img = _picture(7)
    out = llm.generate({"prompt": "The <image> fox jumps", "multi_modal_data": {"image": img}},
                       _greedy(logprobs=None))[0]
    assert out.outputs[0].token_ids == _reference(model, processor, out.prompt_token_ids, [img])[0]
    assert len(calls) == 1


@pytest.mark.parametrize("strategy,layer,positions", [("full", -1, 16), ("default", -2, 15)])
def test_siglip_tower(tmp_path, strategy, layer, positions):
    """A SigLIP vision tower (no class token, biased patch embedding) with the ``full`` strategy and its last layer's
    features, and with the ``default`` strategy, which drops the first feature whatever the tower (transformers'
    rule): the image fills 16 or 15 positions, and the tokens equal transformers'."""
    model, processor, _ = _save_llava(tmp_path, tower="siglip", seed=3, vision_feature_layer=layer,
                                      vision_feature_select_strategy=strategy)
    llm = LLM(str(tmp_path), dtype="float32", platform="cpu", block_size=4, selection="off")
    img = _picture(8)
    out = llm.generate({"prompt": "Paris <image> Large language models", "multi_modal_data": {"image": img}},
                       _greedy(logprobs=None))[0]
    assert out.prompt_token_ids.count(model.config.image_token_index) == positions
    assert out.outputs[0].token_ids == _reference(model, processor, out.prompt_token_ids, [img])[0]


@pytest.mark.parametrize("text_model", ["granite", "gemma"])
def test_language_models_that_scale_their_embeddings(tmp_path, text_model):
    """Granite multiplies the merged embeddings (image rows too) by its embedding_multiplier; Gemma scales its token
    embeddings only: both equal transformers with an image."""
    model, processor, _ = _save_llava(tmp_path, text_model=text_model, seed=6)
    llm = LLM(str(tmp_path), dtype="float32", platform="cpu", block_size=4, selection="off")
    img = _picture(20)
    out = llm.generate({"prompt": "The quick <image> brown fox", "multi_modal_data": {"image": img}}, _greedy())[0]
    tokens, logprobs = _reference(model, processor, out.prompt_token_ids, [img])
    assert out.outputs[0].token_ids == tokens
    assert all(abs(lp.logprob - ref[t].item()) < 1e-4
               for step, ref in zip(out.outputs[0].logprobs, logprobs, strict=True) for t, lp in step.items())


def test_new_weights_reach_the_image_encoder(llava, tmp_path, monkeypatch):
    """update_weights from a LLaVA checkpoint: the vision tower and projector take their tensors too, and images
    encoded with the old weights are forgotten; the tokens then equal a fresh engine's on the new checkpoint."""
    monkeypatch.setenv("PLINTH_CPU_PACKED", "0")   # weights update_weights() can take (the CPU path's plain ones)
    other, _, _ = _save_llava(tmp_path / "other", seed=7)
    llm = LLM(str(llava[0]), dtype="float32", platform="cpu", block_size=4, selection="off")
    prompt = {"prompt": "The <image> fox", "multi_modal_data": {"image": _picture(21)}}
    before = llm.generate(prompt, _greedy(logprobs=None))[0].outputs[0].token_ids
    assert llm.update_weights(str(tmp_path / "other")) == len(safe_names(tmp_path / "other"))   # every tensor given
    after = llm.generate(prompt, _greedy(logprobs=None))[0].outputs[0].token_ids
    fresh = LLM(str(tmp_path / "other"), dtype="float32", platform="cpu", block_size=4, selection="off")
    assert after == fresh.generate(prompt, _greedy(logprobs=None))[0].outputs[0].token_ids != before
    # a transformers model's state dict (its language model's names under model.language_model.) does the same
    back = LLM(str(llava[0]), dtype="float32", platform="cpu", block_size=4, selection="off")
    back.update_weights(other.state_dict())
    assert back.generate(prompt, _greedy(logprobs=None))[0].outputs[0].token_ids == after
    # a refused update writes nothing, the image encoder's tensors included; an unknown encoder name is refused
    from plinth.errors import ModelLoadError

    weight = llm.llm_engine.runner.images.encoder.linear_1.weight
    kept = weight.clone()
    with pytest.raises(ModelLoadError, match="shape"):
        llm.update_weights({"multi_modal_projector.linear_1.weight": torch.ones_like(weight),
                            "model.layers.0.self_attn.q_proj.weight": torch.ones(3, 3)})
    assert torch.equal(weight, kept)
    with pytest.raises(ModelLoadError, match="no such tensor in the image encoder"):
        llm.update_weights({"multi_modal_projector.linear_3.weight": torch.ones(4, 4)})


def test_new_weights_on_pipeline_stages(llava, tmp_path):
    """Two pipeline stages: the first stage's image encoder takes the new vision tower and projector tensors, the
    second (no encoder) its layers' and passes over the encoder's; the tokens then equal a one-process engine's on
    the new checkpoint."""
    _save_llava(tmp_path / "other", seed=7)
    prompts = [{"prompt": "The <image> fox", "multi_modal_data": {"image": _picture(21)}}, {"prompt": "A fox"}]
    fresh = LLM(str(tmp_path / "other"), dtype="float32", platform="cpu", block_size=4, selection="off")
    want = [o.outputs[0].token_ids for o in fresh.generate(prompts, _greedy(logprobs=None))]
    fresh.close()
    llm = LLM(str(llava[0]), dtype="float32", platform="cpu", block_size=4, selection="off",
              pipeline_parallel_size=2, distributed_executor="mp")
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(logprobs=None))] != want
        assert llm.update_weights(str(tmp_path / "other")) == len(safe_names(tmp_path / "other"))
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(logprobs=None))] == want
    finally:
        llm.close()


def safe_names(path):
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return list(f.keys())  # noqa: SIM118


def test_encoded_images_are_kept_per_salt_and_epoch_and_alone(llava):
    """The encoder's cache: another cache_salt, or a request after reset_prefix_cache, encodes the image again (no
    tenant can time another's images); a kept image holds its own embeddings, not the whole pass's output."""
    llm = LLM(str(llava[0]), dtype="float32", platform="cpu", block_size=4, selection="off")
    calls = []
    llm.llm_engine.runner.images.encoder.register_forward_hook(lambda *_: calls.append(1))
    img = _picture(22)

    def run(salt=None):
        prompt = {"prompt": "The <image> fox", "multi_modal_data": {"image": img}}
        if salt is not None:
            prompt["cache_salt"] = salt
        return llm.generate(prompt, _greedy(logprobs=None))[0].outputs[0].token_ids

    first = run("tenant-a")
    assert run("tenant-a") == first and len(calls) == 1
    assert run("tenant-b") == first and len(calls) == 2
    llm.reset_prefix_cache()
    assert run("tenant-a") == first and len(calls) == 3
    llm.generate([{"prompt": "<image> x", "multi_modal_data": {"image": _picture(30 + i)}} for i in range(6)],
                 _greedy(logprobs=None))
    for features in llm.llm_engine.runner.images._cache.values():
        assert features.untyped_storage().nbytes() == features.numel() * features.element_size()


def test_transparent_images_and_what_a_request_carries(llava, llm, tmp_path):
    """An image with transparent pixels is put over white as transformers' processors do (not its alpha dropped):
    tokens equal transformers'; each image's pixels are its own (a request's pickled images are their own size); a
    LLaVA-NeXT config whose tile features cannot form a grid is refused at load."""
    import pickle

    _, model, processor, _ = llava
    rgba = _picture(25).convert("RGBA")
    alpha = np.full((rgba.height, rgba.width), 255, dtype=np.uint8)
    alpha[:, : rgba.width // 2] = 0
    rgba.putalpha(Image.fromarray(alpha))
    out = llm.generate({"prompt": "The <image> fox", "multi_modal_data": {"image": rgba}}, _greedy(logprobs=None))[0]
    assert out.outputs[0].token_ids == _reference(model, processor, out.prompt_token_ids, [rgba])[0]
    prepared = llm.llm_engine.images.prepare({"image": [_picture(26 + i) for i in range(8)]})
    one = prepared.pixels[0]
    assert len(pickle.dumps(prepared.pixels[0])) < 2 * one.numel() * one.element_size()
    from plinth.errors import UnsupportedModelError

    _save_llava(tmp_path / "next-full", tower="next", vision_feature_select_strategy="full")
    with pytest.raises(UnsupportedModelError, match="do not form the 4x4 grid"):
        LLM(str(tmp_path / "next-full"), dtype="float32", platform="cpu", selection="off")


def test_llava_next_tiles_by_image_size(tmp_path):
    """LLaVA-NeXT: each image is the base tile and the grid of its best resolution, packed without the padding rows
    and with a newline embedding after each row, so images of other shapes fill other numbers of positions; greedy
    tokens and log-probabilities equal transformers' LlavaNextForConditionalGeneration, two images of two shapes in
    one prompt, a batch of prompts, and a prefill cut into chunks through the images."""
    model, processor, _ = _save_llava(tmp_path, tower="next", seed=5)
    wide, tall = _picture(18, (30, 70)), _picture(19, (64, 40))
    prompts = [{"prompt": "The <image> fox", "multi_modal_data": {"image": wide}},
               {"prompt": "<image> Paris <image>", "multi_modal_data": {"image": [tall, wide]}}]
    image_id = model.config.image_token_index
    for kwargs in ({}, {"max_num_batched_tokens": 16, "enable_chunked_prefill": True, "max_num_seqs": 2}):
        llm = LLM(str(tmp_path), dtype="float32", platform="cpu", block_size=4, selection="off", **kwargs)
        outs = llm.generate(prompts, _greedy())
        first = outs[0].prompt_token_ids.count(image_id)
        assert first > 16 and outs[1].prompt_token_ids.count(image_id) > first   # more than one tile's 16
        for out, images in zip(outs, [[wide], [tall, wide]], strict=True):
            tokens, logprobs = _reference(model, processor, out.prompt_token_ids, images)
            assert out.outputs[0].token_ids == tokens
            for step, ref in zip(out.outputs[0].logprobs, logprobs, strict=True):
                assert all(abs(lp.logprob - ref[t].item()) < 1e-4 for t, lp in step.items())


def _data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_chat_with_image_parts(llava, llm):
    """LLM.chat: image_url (a data URL) and image_pil parts become the image token where they stand, and the
    images go with the prompt; the reply equals generate on the same rendered prompt."""
    _, model, processor, tok = llava
    img = _picture(9)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(img)}},
                                             {"type": "text", "text": "The quick brown fox"}]}]
    out = llm.chat(messages, _greedy(logprobs=None))[0]
    assert "<image>\nThe quick brown fox" in out.prompt
    assert out.outputs[0].token_ids == _reference(model, processor, out.prompt_token_ids, [img])[0]
    pil = [{"role": "user", "content": [{"type": "image_pil", "image_pil": img},
                                        {"type": "text", "text": "The quick brown fox"}]}]
    assert llm.chat(pil, _greedy(logprobs=None))[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_the_processors_chat_template(llava, tmp_path):
    """A checkpoint whose chat template is its processor's (``chat_template.json``, as llava-hf writes it) and not
    the tokenizer's: the engine takes it, and sees that it loops over content parts (through a filter, with
    transformers' ``generation`` blocks), so text and image parts reach it as parts."""
    import shutil

    path = tmp_path / "llava"
    shutil.copytree(llava[0], path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    # in the style of llava-hf's templates: images first through a filter, the assistant's text in generation blocks
    template = ("{% for m in messages %}{{ m['role'].upper() + ': ' }}"
                "{% for c in m['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\\n' }}{% endfor %}"
                "{% for c in m['content'] | selectattr('type', 'equalto', 'text') %}"
                "{% if m['role'] == 'assistant' %}{% generation %}{{ c['text'] }}{% endgeneration %}"
                "{% else %}{{ c['text'] + ' ' }}{% endif %}{% endfor %}{% endfor %}"
                "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")
    (path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    llm = LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off")
    messages = [{"role": "user", "content": [{"type": "text", "text": "Paris"},
                                             {"type": "image_pil", "image_pil": _picture(24)}]}]
    assert llm.chat(messages, _greedy(logprobs=None))[0].prompt == "USER: <image>\nParis ASSISTANT:"
    text_only = [{"role": "user", "content": "The quick fox"}, {"role": "assistant", "content": "ok"},
                 {"role": "user", "content": "again"}]
    assert llm.chat(text_only, _greedy(logprobs=None))[0].prompt == \
        "USER: The quick fox ASSISTANT: okUSER: again ASSISTANT:"


def test_generate_rows_with_image_parts(llava, llm, tmp_path):
    """`plinth generate`: a row's messages with an image_url part (a data URL) give LLM.chat's tokens."""
    from plinth.entrypoints.cli import main

    img = _picture(27)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(img)}},
                                             {"type": "text", "text": "The quick brown fox"}]}]
    rows = tmp_path / "in.jsonl"
    rows.write_text(json.dumps({"id": "r1", "messages": messages, "max_tokens": 6, "temperature": 0}) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["generate", str(llava[0]), "--dtype", "float32", "--ignore-eos", "--selection", "off",
                 "--platform", "cpu", "--input", str(rows), "--output", str(out)]) == 0
    got = json.loads(out.read_text().splitlines()[0])
    want = llm.chat(messages, _greedy(logprobs=None))[0]
    assert got["id"] == "r1" and got["outputs"][0]["token_ids"] == list(want.outputs[0].token_ids)
    assert got["prompt_tokens"] == len(want.prompt_token_ids)   # the image's positions counted


def test_server_chat_with_an_image_url(llava):
    """POST /v1/chat/completions with an image_url part: the reply equals transformers' on the rendered prompt, and
    /v1/responses with an input_image part gives the same; a remote URL, bad base64 and bytes that are not an image
    are 400s naming messages."""
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import ImagePart, LLMEngine, TextParts
    from plinth.entrypoints.openai.api_server import build_app

    path, model, processor, _ = llava
    img = _picture(10)
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(path), dtype="float32", block_size=4, selection="off",
                                                platform="cpu", served_model_name="llava"))
    content = [{"type": "text", "text": "Paris is"}, {"type": "image_url", "image_url": {"url": _data_url(img)}}]
    with TestClient(build_app(AsyncLLMEngine(engine))) as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                    "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        parts = TextParts(["Paris is", ImagePart("<image>")])   # as the server reads the message
        rendered = engine.render_chat([{"role": "user", "content": parts}])
        assert rendered.endswith("Paris is<image>\n<|im_end|>\n<|im_start|>assistant\n")
        ids = engine.tokenize(rendered, add_special_tokens=False)
        expanded, _ = engine.images.expand(ids, [16])
        want = _reference(model, processor, expanded, [img])[0]
        assert r.json()["choices"][0]["message"]["content"] == engine.tokenizer.decode(want, skip_special_tokens=True)
        assert r.json()["usage"]["prompt_tokens"] == len(expanded)
        reply = r.json()["choices"][0]["message"]["content"]
        # the Responses API's input_image parts take the same way
        items = [{"role": "user", "content": [{"type": "input_text", "text": "Paris is"},
                                              {"type": "input_image", "image_url": _data_url(img)}]}]
        r = http.post("/v1/responses", json={"input": items, "max_output_tokens": 6, "temperature": 0,
                                             "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["output"][-1]["content"][0]["text"] == reply
        for url, words in [("https://example.com/cat.png", "fetches no image URLs"),
                           ("file:///etc/passwd", "file:// URLs are not allowed"), ("data:image/png;base64,@@@",
                           "not valid base64"), ("data:image/png;base64," + base64.b64encode(b"no image").decode(),
                                                 "cannot be read as an image")]:
            bad = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "x"}]
            r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": bad}],
                                                        "max_tokens": 2})
            assert r.status_code == 400, r.text
            assert words in r.json()["error"]["message"] and r.json()["error"]["param"] == "messages"


def test_server_checks_of_image_requests(llava):
    """The chat route with images: the length checked with each image widened, truncate_prompt_tokens refused, more
    images than --limit-mm-per-prompt refused before any is decoded, the image token in text without an image part
    refused (naming messages), echo and continuous usage stats with the widened prompt, /tokenize widened."""
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(llava[0]), dtype="float32", block_size=4, selection="off",
                                                platform="cpu", max_model_len=40, limit_mm_per_prompt={"image": 2}))
    url = _data_url(_picture(23))
    content = [{"type": "text", "text": "Paris"}, {"type": "image_url", "image_url": {"url": url}}]
    messages = [{"role": "user", "content": content}]
    with TestClient(build_app(AsyncLLMEngine(engine))) as http:
        tokens = http.post("/tokenize", json={"messages": messages}).json()
        assert tokens["count"] == len(tokens["tokens"]) and tokens["tokens"].count(300) == 16
        ok = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == tokens["count"]
        for extra, status, words, param in [
                ({"max_tokens": 30}, 400, "maximum context length", "max_tokens"),
                ({"truncate_prompt_tokens": 20}, 400, "cannot cut a prompt with images", "truncate_prompt_tokens"),
                ({"use_beam_search": True, "n": 2}, 400, "beam search", "use_beam_search")]:
            r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3, **extra})
            assert r.status_code == status and words in r.json()["error"]["message"], r.text
            assert r.json()["error"]["param"] == param
        many = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@"}}]
                 * 3}]
        r = http.post("/v1/chat/completions", json={"messages": many, "max_tokens": 2})
        assert r.status_code == 400 and "3 images, at most 2" in r.json()["error"]["message"]   # (none decoded)
        literal = [{"role": "user", "content": "a <image> here"}]
        r = http.post("/v1/chat/completions", json={"messages": literal, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        echoed = [{"role": "user", "content": "x"}, {"role": "assistant", "content": content[::-1]}]
        r = http.post("/v1/chat/completions", json={"messages": echoed, "max_tokens": 2, "echo": True,
                                                    "add_generation_prompt": False, "continue_final_message": True})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith("<image>\nParis"), \
            r.text
        r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3, "ignore_eos": True,
                                                    "stream": True, "stream_options": {
                                                        "include_usage": True, "continuous_usage_stats": True}})
        usages = [json.loads(line[6:])["usage"]["prompt_tokens"] for line in r.text.splitlines()
                  if line.startswith("data: {") and '"usage"' in line and '"usage":null' not in line]
        assert usages and set(usages) == {tokens["count"]}


def test_refusals(llava, llm, tiny_llama_dir, tmp_path):
    """Clear errors: images that the prompt does not name (or names too often), an image token without an image, a
    run of image tokens of the wrong length, something that is not an image (a PIL image of a truncated file too), a
    thin strip, an image-and-text model
    whose language model plinth does not run (BLIP-2 over OPT), images for a text-only model, and an image part in a
    text-only model's chat."""
    img = _picture(11)
    engine = llm.llm_engine
    image_id = llava[1].config.image_token_index
    buf = io.BytesIO()
    img.convert("L").save(buf, format="PNG")
    truncated = Image.open(io.BytesIO(buf.getvalue()[:len(buf.getvalue()) // 2]))   # (opened lazily: read later)
    cases = [
        ("The fox", {"image": img}, r"names 0 image\(s\)"),
        ("<image> and <image>", {"image": img}, r"names 2 image\(s\)"),
        ("The <image> fox", None, "no image"),
        ([5, image_id, image_id, 6], {"image": img}, "run of 2 image tokens"),
        ("The <image> fox", {"image": "cat.png"}, "must be a PIL image"),
        ("The <image> fox", {"video": img}, "images only"),
        ("The <image> fox", {"image": b"not an image"}, "cannot be read as an image"),
        ("The <image> fox", {"image": truncated}, "cannot be read as an image"),
        ("The <image> fox", {"image": Image.new("RGB", (5000, 10))}, "longer than 100 times its width"),
    ]
    for prompt, data, words in cases:
        with pytest.raises(RequestRejectedError, match=words):
            engine.add_request("bad", prompt, SamplingParams(max_tokens=2), multi_modal_data=data)
    assert not engine.has_unfinished_requests()
    blip2 = transformers.Blip2Config(   # BLIP-2 over OPT, a language model plinth does not run
        text_config=dict(model_type="opt", vocab_size=100, hidden_size=32, num_hidden_layers=1, ffn_dim=64,
                         num_attention_heads=2, word_embed_proj_dim=32),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=8, patch_size=4),
        qformer_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                            encoder_hidden_size=32), num_query_tokens=2)
    transformers.Blip2ForConditionalGeneration(blip2).save_pretrained(tmp_path / "blip2")
    from plinth.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="whose language model .* plinth does not run"):
        LLM(str(tmp_path / "blip2"), dtype="float32", platform="cpu", selection="off")
    text_only = LLM(str(tiny_llama_dir), dtype="float32", platform="cpu", selection="off")
    with pytest.raises(RequestRejectedError, match="takes no image inputs"):
        text_only.generate({"prompt": "The fox", "multi_modal_data": {"image": img}})
    with pytest.raises(ValueError, match="takes no images"):
        text_only.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": img}]}])


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tensor_parallel", "pipeline_stages"])
def test_worker_processes_encode_the_image(tp, pp, llava, llm):
    """Two worker processes: as tensor-parallel ranks each encodes the image (the batch carries its pixels); as two
    pipeline stages the first encodes it, in each micro-batch that holds image rows. The tokens equal the
    single-process engine's."""
    path = str(llava[0])
    prompts = [{"prompt": "The <image> quick brown", "multi_modal_data": {"image": _picture(12)}},
               {"prompt": "<image> Paris <image>", "multi_modal_data": {"image": [_picture(13), _picture(12)]}},
               {"prompt": "No picture here"}]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(logprobs=None))]
    got = generate_on_tp_workers(path, prompts, _greedy(logprobs=None), size=tp, pp=pp)
    assert [o.outputs[0].token_ids for o in got] == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_tokens_equal_transformers(llava):
    """On a GPU (CUDA graphs for the decode steps, the Triton attention kernels for the prefill through the image):
    float32 tokens equal transformers' on the CPU, for a batch of two prompts with images and one without."""
    path, model, processor, _ = llava
    llm = LLM(str(path), dtype="float32", platform="cuda", block_size=16, gpu_memory_utilization=0.3)
    a, b = _picture(14), _picture(15)
    prompts = [{"prompt": "The quick <image> brown fox", "multi_modal_data": {"image": a}},
               {"prompt": "<image> Paris <image> is", "multi_modal_data": {"image": [b, a]}},
               "Large language models"]
    outs = llm.generate(prompts, _greedy(logprobs=None))
    for out, images in zip(outs, [[a], [b, a], []], strict=True):
        assert out.outputs[0].token_ids == _reference(model, processor, out.prompt_token_ids, images)[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_llava_next_equals_transformers(tmp_path):
    """LLaVA-NeXT on a GPU: images of two shapes in one prompt, float32 tokens equal transformers' on the CPU."""
    model, processor, _ = _save_llava(tmp_path, tower="next", seed=5)
    llm = LLM(str(tmp_path), dtype="float32", platform="cuda", block_size=16, gpu_memory_utilization=0.3)
    wide, tall = _picture(18, (30, 70)), _picture(19, (64, 40))
    out = llm.generate({"prompt": "<image> Paris <image>", "multi_modal_data": {"image": [tall, wide]}},
                       _greedy(logprobs=None))[0]
    assert out.outputs[0].token_ids == _reference(model, processor, out.prompt_token_ids, [tall, wide])[0]


@pytest.fixture
def image_site(tmp_path):
    """A local HTTP server (127.0.0.1) serving a PNG at /cat.png and redirecting /away to another host."""
    import http.server

    img = _picture(16)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    png = buf.getvalue()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if self.path == "/cat.png":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(png)))
                self.end_headers()
                self.wfile.write(png)
            elif self.path == "/garbage":
                self.wfile.write(b"GARBAGE\r\n\r\n")
            elif self.path == "/slow":
                self.send_response(200)
                self.end_headers()
                for _ in range(40):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.1)
            elif self.path == "/slow-headers":
                self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                for _ in range(40):
                    self.wfile.write(b"X-Slow: 1\r\n")
                    self.wfile.flush()
                    time.sleep(0.1)
            elif self.path.startswith("/hop"):
                time.sleep(0.4)
                self.send_response(302)
                self.send_header("Location", f"/hop{len(self.path)}")
                self.end_headers()
            elif self.path == "/away":
                self.send_response(302)
                self.send_header("Location", "http://localhost.invalid/cat.png")
                self.end_headers()
            else:
                self.send_response(404)
                self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", img, png
    server.shutdown()
    server.server_close()


def test_image_urls_where_the_server_allows_them(llava, image_site, tmp_path):
    """--allowed-media-domains: http(s) image URLs of those hosts are fetched (before the request is rendered, off the
    event loop), a redirect out of them and other hosts are refused; --allowed-local-media-path: file:// URLs under
    the directory are read, paths outside it refused; --limit-mm-per-prompt caps the images of a prompt."""
    from starlette.testclient import TestClient

    pytest.importorskip("fastapi")
    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    base, img, png = image_site
    media = tmp_path / "media"
    media.mkdir()
    (media / "cat.png").write_bytes(png)
    (tmp_path / "secret.png").write_bytes(png)
    engine = LLMEngine(EngineConfig.from_kwargs(
        model=str(llava[0]), dtype="float32", block_size=4, selection="off", platform="cpu",
        allowed_media_domains=["127.0.0.1"], allowed_local_media_path=str(media), limit_mm_per_prompt='{"image": 2}'))

    def chat(http, *urls):
        content = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": "Paris"}]
        return http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                       "max_tokens": 4, "temperature": 0, "ignore_eos": True})

    with TestClient(build_app(AsyncLLMEngine(engine))) as http:
        inline = chat(http, _data_url(img))
        assert inline.status_code == 200, inline.text
        for url in (f"{base}/cat.png", f"file://{media}/cat.png"):
            r = chat(http, url)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == inline.json()["choices"][0]["message"]["content"]
        for url, words in [(f"{base}/away", "outside the allowed media domains"),
                           (f"{base}/garbage", "cannot fetch the image"),
                           (f"file://{media}/cat%00.png", "cannot read the file"),
                           (f"file://{media}/{'x' * 5000}.png", "cannot read the file"),
                           (f"{base}/missing.png", "HTTP 404"),
                           ("http://localhost.invalid/cat.png", "not among the allowed media domains"),
                           (f"file://{tmp_path}/secret.png", "secret.png is outside the allowed local media path"),
                           (f"file://{media}/../secret.png", "outside the allowed local media path")]:
            r = chat(http, url)
            assert r.status_code == 400 and words in r.json()["error"]["message"], (url, r.text)
        r = chat(http, _data_url(img), _data_url(img), _data_url(img))
        assert r.status_code == 400 and "at most 2 a prompt" in r.json()["error"]["message"], r.text
    # a fetch has a deadline as a whole, not only per read (a server trickling a byte at a time)
    from plinth.multimodal.images import MediaPolicy, fetch_url

    for path in ("/slow", "/slow-headers", "/hop"):   # a trickled body or headers, redirect after redirect
        started = time.monotonic()
        with pytest.raises(RequestRejectedError, match="took more than 1 s"):
            fetch_url(f"{base}{path}", MediaPolicy(domains=("127.0.0.1",), timeout_s=1.0))
        assert time.monotonic() - started < 2.0, path
    # LLM.chat counts images against the limit before reading the one past it
    llm = LLM(str(llava[0]), dtype="float32", platform="cpu", selection="off", limit_mm_per_prompt={"image": 1})
    parts = [{"type": "image_url", "image_url": {"url": _data_url(img)}},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}]
    with pytest.raises(RequestRejectedError, match="more than 1 images"):
        llm.chat([{"role": "user", "content": parts}])


def test_images_given_as_embeddings(llava, llm):
    """A LLaVA image given as its embeddings (``[1, 16, hidden]`` from transformers' ``get_image_features``) runs as
    the image does; embeddings of the wrong count of positions or width are refused."""
    _, model, processor, _ = llava
    img = _picture(23)
    with torch.no_grad():
        features = model.get_image_features(pixel_values=processor(images=[img], return_tensors="pt")["pixel_values"])
    embeds = features.pooler_output if hasattr(features, "pooler_output") else features
    embeds = torch.cat(list(embeds)) if isinstance(embeds, list | tuple) else embeds
    by_pixels = llm.generate({"prompt": "The <image> fox", "multi_modal_data": {"image": img}}, _greedy())[0]
    by_embeds = llm.generate({"prompt": "The <image> fox", "multi_modal_data": {"image": embeds.reshape(1, 16, -1)}},
                             _greedy())[0]
    assert by_embeds.outputs[0].token_ids == by_pixels.outputs[0].token_ids
    for x, y in zip(by_embeds.outputs[0].logprobs, by_pixels.outputs[0].logprobs, strict=True):
        for tid, lp in x.items():
            assert abs(lp.logprob - y[tid].logprob) < 1e-4
    engine = llm.llm_engine
    flat = embeds.reshape(16, -1)
    for data, words in [(flat[:8], "this model's images fill 16"), (flat[:, :8], "takes"),
                        ({"image_embeds": flat, "image_grid_thw": [1, 4, 4]}, "for Qwen2-VL models")]:
        with pytest.raises(RequestRejectedError, match=words):
            engine.add_request("bad", "The <image> fox", SamplingParams(max_tokens=2), multi_modal_data={"image": data})


def test_a_bfloat16_model_keeps_pixels_in_bfloat16(llava):
    """A bfloat16 model's processed pixels are kept in bfloat16 (half the memory while queued, half the bytes to the
    device): the values its encoder casts them to first, so the image embeddings are the same bit for bit."""
    path, _, processor, _ = llava
    llm = LLM(str(path), dtype="bfloat16", platform="cpu", block_size=4, selection="off")
    img = _picture(21)
    prepared = llm.llm_engine.images.prepare({"image": img})
    full = processor(images=[img], return_tensors="pt")["pixel_values"]
    assert prepared.pixels[0].dtype == torch.bfloat16 and torch.equal(prepared.pixels[0], full.to(torch.bfloat16))
    encoder = llm.llm_engine.runner.images.encoder
    with torch.no_grad():
        assert torch.equal(encoder(prepared.pixels[0]), encoder(full))
    out, = llm.generate({"prompt": "The quick <image> brown fox", "multi_modal_data": {"image": img}}, _greedy())
    assert len(out.outputs[0].token_ids) == 6
