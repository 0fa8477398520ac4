"""Mistral 3 (``Mistral3ForConditionalGeneration``: Mistral Small 3.1 / 3.2) with images: a tiny random checkpoint
written by transformers, run by plinth (the Pixtral vision tower and Mistral 3's projector, the prompt's rows of image
tokens with breaks) and by transformers on the same pixels."""

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

SPECIAL = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]


def _save(path):
    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    img, brk, end = tok.convert_tokens_to_ids(SPECIAL)
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, eos_token_id=tok.eos_token_id,
                bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, patch_size=4,
                  image_size=64, head_dim=16)
    cfg = transformers.Mistral3Config(text_config=text, vision_config=vision, image_token_id=img,
                                      spatial_merge_size=2, multimodal_projector_bias=True)
    torch.manual_seed(0)
    model = decisive_weights(transformers.Mistral3ForConditionalGeneration(cfg).eval())
    model.save_pretrained(path)
    tok.save_pretrained(path)
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    processor = PixtralImageProcessorPil(patch_size={"height": 8, "width": 8}, size={"longest_edge": 64})
    processor.save_pretrained(path)
    return model, processor, tok


def _picture(seed: int, size: tuple[int, int] = (40, 52)) -> Image.Image:
    return random_picture(seed, size)


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral3")
    return (path, *_save(path))


def test_images_equal_transformers(mistral3):
    """Two images of different sizes (one resized down to the 64-pixel longest side) in one prompt, prefilled in chunks
    of 16 tokens beside a text prompt: the prompt's image rows (image tokens, a break after each row, the end token
    last) equal transformers' ``PixtralProcessor``'s, and greedy tokens and each step's log-probabilities equal
    transformers' ``Mistral3ForConditionalGeneration`` on the same pixels."""
    path, model, processor, tok = mistral3
    llm = plinth.LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off",
                     max_num_batched_tokens=16, enable_chunked_prefill=True, max_model_len=512)
    a, b = _picture(1), _picture(2, (30, 120))
    prompt = "A [IMG] then [IMG] end"
    params = plinth.SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    outs = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": [a, b]}}, "plain text here"], params)
    pixels = processor(images=[a, b], patch_size={"height": 8, "width": 8}, return_tensors="pt")
    assert outs[0].prompt_token_ids == tok(_rule(prompt, pixels["image_sizes"].tolist()))["input_ids"]
    sizes = pixels["image_sizes"].tolist()
    assert sizes == [[40, 56], [16, 64]]   # within 64 pixels a side, whole 8-pixel merged patches
    assert outs[0].prompt_token_ids.count(tok.convert_tokens_to_ids("[IMG_BREAK]")) == (5 - 1) + (2 - 1)
    output_matches_transformers(outs[0], model, pixel_values=pixels["pixel_values"], image_sizes=pixels["image_sizes"])
    output_matches_transformers(outs[1], model)
    llm.close()


def test_chat_and_tokenize(mistral3):
    """``LLM.chat`` with an image part and the server's ``/tokenize`` lay the image out as ``generate`` does: the
    same prompt tokens (rows, breaks, end), and the same reply."""
    pytest.importorskip("fastapi")
    path, _, _, tok = mistral3
    tok.chat_template = ("{% for m in messages %}[INST]{% for p in m['content'] %}{% if p['type'] == 'image' %}"
                         "[IMG]{% else %}{{ p['text'] }}{% endif %}{% endfor %}[/INST]{% endfor %}")
    tok.save_pretrained(path)
    img = _picture(7, (48, 24))
    llm = plinth.LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off")
    params = plinth.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    chat = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": img},
                                                  {"type": "text", "text": "Paris"}]}], params)[0]
    plain = llm.generate({"prompt": "[INST][IMG]Paris[/INST]", "multi_modal_data": {"image": img}}, params)[0]
    # (the template writes no BOS; generate's prompt string gets the tokenizer's)
    chat_ids = chat.prompt_token_ids
    assert [t for t in plain.prompt_token_ids if t != tok.bos_token_id] == chat_ids
    assert tok.convert_tokens_to_ids("[IMG_END]") in chat_ids
    llm.close()
    assert server_tokens_of_image_chat(path, img, "Paris") == chat_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_images_equal_transformers(tmp_path):
    """On a GPU: float32 tokens of an image prompt beside a text prompt equal transformers' on the CPU."""
    model, processor, _ = _save(tmp_path)
    llm = plinth.LLM(str(tmp_path), dtype="float32", platform="cuda", block_size=16, gpu_memory_utilization=0.3)
    img = _picture(11, (56, 40))
    outs = llm.generate([{"prompt": "See [IMG] now", "multi_modal_data": {"image": img}}, "Large language models"],
                        plinth.SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True))
    pixels = processor(images=[img], patch_size={"height": 8, "width": 8}, return_tensors="pt")
    output_matches_transformers(outs[0], model, steps=8, tol=1e-3, pixel_values=pixels["pixel_values"],
                                image_sizes=pixels["image_sizes"])
    output_matches_transformers(outs[1], model, steps=8, tol=1e-3)


def test_the_checkpoints_own_head(tmp_path):
    """A checkpoint that stores its LM head uses it, whatever the configs' tie flags say: Mistral 3's top-level flag
    defaults to true, so a config written without it (as transformers 4.x wrote Mistral Small 3.1's) would tie the
    head to the embeddings; transformers keeps the stored head, and so does plinth."""
    import json

    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    cfg = transformers.Mistral3Config(text_config=text, vision_config=dict(hidden_size=32, intermediate_size=48,
                                                                           num_hidden_layers=1, num_attention_heads=2,
                                                                           patch_size=4, image_size=64, head_dim=16),
                                      image_token_id=tok.convert_tokens_to_ids("[IMG]"), tie_word_embeddings=False)
    torch.manual_seed(0)
    model = decisive_weights(transformers.Mistral3ForConditionalGeneration(cfg).eval())
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    written.pop("tie_word_embeddings", None)
    written["text_config"].pop("tie_word_embeddings", None)
    (tmp_path / "config.json").write_text(json.dumps(written))
    llm = plinth.LLM(str(tmp_path), dtype="float32", platform="cpu", selection="off", max_model_len=64)
    out = llm.generate({"prompt_token_ids": [5, 9, 14, 3, 27]},
                       plinth.SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True))[0]
    output_matches_transformers(out, model)
    llm.close()


def _rule(prompt: str, sizes, unit: int = 8) -> str:
    """PixtralProcessor's prompt rule: each ``[IMG]`` becomes its image's rows of ``[IMG]``, an ``[IMG_BREAK]`` after
    each row, the last an ``[IMG_END]`` (the class itself needs torchvision)."""
    pieces = prompt.split("[IMG]")
    text = pieces[0]
    for (h, w), after in zip(sizes, pieces[1:], strict=True):
        rows = (["[IMG]"] * (w // unit) + ["[IMG_BREAK]"]) * (h // unit)
        rows[-1] = "[IMG_END]"
        text += "".join(rows) + after
    return text


def test_adjacent_images_and_layouts(mistral3):
    """Adjacent placeholders name one image each, however small the first (an 8-pixel image is one merged patch:
    two positions, as many as the two placeholders); the tokens equal transformers'. A prompt that carries the row
    tokens itself (a widened one) is refused clearly; an image's layout from its size alone (the server's count and
    /tokenize) equals the processed one's, thin images included."""
    from plinth.core.scheduler import RequestRejectedError

    path, model, processor, tok = mistral3
    llm = plinth.LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off", max_model_len=512)
    small, big = _picture(20, (8, 8)), _picture(21)
    out = llm.generate({"prompt": "A [IMG][IMG] b", "multi_modal_data": {"image": [small, big]}},
                       plinth.SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True))[0]
    pixels = processor(images=[small, big], patch_size={"height": 8, "width": 8}, return_tensors="pt")
    assert out.prompt_token_ids == tok(_rule("A [IMG][IMG] b", pixels["image_sizes"].tolist()))["input_ids"]
    output_matches_transformers(out, model, pixel_values=pixels["pixel_values"], image_sizes=pixels["image_sizes"])
    with pytest.raises(RequestRejectedError, match=r"row-break or end tokens"):
        llm.generate({"prompt": "A [IMG][IMG_END] b", "multi_modal_data": {"image": small}})
    support = llm.llm_engine.images
    for size in ((3, 60), (1, 60), (60, 3), (40, 52), (200, 30)):
        img = _picture(22, size)
        assert support.pattern_of(img) == support.prepare({"image": img}).patterns[0], size
    llm.close()


def test_images_of_one_size_encode_together(mistral3):
    """Images of one size are encoded in one batch (each attending to itself), at most as many patches a pass as
    start-up's pass took: their embeddings equal each image encoded alone."""
    path = mistral3[0]
    llm = plinth.LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off", max_model_len=512)
    support, features = llm.llm_engine.images, llm.llm_engine.runner.images
    pics = [_picture(30, (16, 24)), _picture(31, (16, 24)), _picture(32, (24, 64)), _picture(33, (16, 24))]
    _, items = support.items([support.token_id] * 4, {"image": pics})
    calls = []
    encode = features.encoder.forward
    features.encoder.forward = lambda pixels: calls.append(len(pixels)) or encode(pixels)
    together = [e.clone() for e in features.embeddings(items)]
    assert sorted(calls) == [1, 3]   # the three 16x24 images in one pass
    for item, want in zip(items, together, strict=True):
        features.clear()
        torch.testing.assert_close(features.embeddings([item])[0], want, atol=1e-5, rtol=1e-5)
    features.clear()
    features.pass_patches, calls[:] = 1, []   # one image a pass
    for item, want in zip(items, features.embeddings(items), strict=True):
        torch.testing.assert_close(want, together[items.index(item)], atol=1e-5, rtol=1e-5)
    assert calls == [1, 1, 1, 1]
    llm.close()
