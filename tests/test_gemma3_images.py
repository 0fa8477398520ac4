"""Gemma 3 (``Gemma3ForConditionalGeneration``: gemma-3-4b/12b/27b) with images: a tiny random checkpoint written by
transformers, run by plinth (the SigLIP tower, Gemma 3's pooling projector, its prompt layout and the bidirectional
attention among an image's positions) and by transformers on the same pixels."""

from __future__ import annotations

import numpy as np
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

SPECIAL = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
#: positions an image fills (a 4x4 pool of the 8x8 patches)
TOKENS = 16
#: the sliding-window layers' window: shorter than an image, so that the window bounds its positions' view too
WINDOW = 12
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{% for p in m['content'] %}"
            "{% if p['type'] == 'image' %}<start_of_image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}"
            "<end_of_turn>\n{% endfor %}<start_of_turn>model\n")


def _save(path):
    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL.values())})
    tok.add_tokens(["\n" * k for k in range(1, 6)])   # line-break runs as one token each, as Gemma's vocabulary has
    tok.chat_template = TEMPLATE
    boi, eoi, img = tok.convert_tokens_to_ids(list(SPECIAL.values()))
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=WINDOW,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, patch_size=8,
                  image_size=64, vision_use_head=False)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS,
                                    boi_token_index=boi, eoi_token_index=eoi, image_token_index=img)
    torch.manual_seed(0)
    model = decisive_weights(transformers.Gemma3ForConditionalGeneration(cfg).eval())
    model.save_pretrained(path)
    tok.save_pretrained(path)
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    images = Gemma3ImageProcessorPil(size={"height": 64, "width": 64})
    images.save_pretrained(path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(path, extra_special_tokens=SPECIAL)
    processor = transformers.Gemma3Processor(images, hf_tok, image_seq_length=TOKENS)
    return model, processor


def _picture(seed: int, size: tuple[int, int] = (40, 52)) -> Image.Image:
    return random_picture(seed, size)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    return (path, *_save(path))


def _matches(out, model, processor, prompt: str, images: list) -> None:
    """``out``'s prompt tokens are Gemma 3's processor's for ``prompt`` and ``images``, and its tokens and log-probs
    are transformers' on the processor's pixels (with its token types: the image positions' bidirectional mask)."""
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    extra = {"pixel_values": inputs["pixel_values"], "token_type_ids": inputs["token_type_ids"]} if images else {}
    output_matches_transformers(out, model, **extra)


def test_images_equal_transformers(gemma3):
    """Two images in one prompt (the second past the sliding window's reach from the prompt's start) beside a text
    prompt, prefilled in chunks of at most 20 tokens (cut before an image, never inside one): the prompt is Gemma 3's
    processor's (line breaks around each image, joined with the prompt's own into one token) and greedy tokens and
    each step's log-probabilities equal transformers'; the same prompt again takes its blocks from the prefix
    cache, images included, and gives the same tokens."""
    path, model, processor = gemma3
    llm = plinth.LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off",
                     max_num_batched_tokens=20, enable_chunked_prefill=True, max_model_len=256)
    a, b = _picture(1), _picture(2, (30, 90))
    prompt = "Look:\n<start_of_image> and then a longer stretch of words <start_of_image>\nwhat are they"
    params = plinth.SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    outs = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": [a, b]}}, "plain text here"], params)
    ids = outs[0].prompt_token_ids
    second = [i for i, t in enumerate(ids) if t == model.config.image_token_id][TOKENS]
    assert second > WINDOW + TOKENS   # its positions' window starts past the prompt's start
    _matches(outs[0], model, processor, prompt, [a, b])
    _matches(outs[1], model, processor, "plain text here", [])
    hits = llm.llm_engine.block_manager.stats.hit_tokens
    again = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [a, b]}}, params)[0]
    assert llm.llm_engine.block_manager.stats.hit_tokens - hits >= second + TOKENS - 4
    assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids
    llm.close()


def test_image_given_expanded_and_as_embeddings(gemma3):
    """A prompt that already holds the processor's layout (its image tokens widened) is taken as it is, and an image
    given as its embeddings (the encoder's own) gives the same tokens as its pixels."""
    path, model, processor = gemma3
    llm = plinth.LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off", max_model_len=256)
    img = _picture(3, (64, 64))
    params = plinth.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    inputs = processor(text="Say <start_of_image> now", images=[img], return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    widened = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": img}}, params)[0]
    plain = llm.generate({"prompt": "Say <start_of_image> now", "multi_modal_data": {"image": img}}, params)[0]
    assert widened.prompt_token_ids == plain.prompt_token_ids == ids
    with torch.no_grad():
        embeds = model.model.get_image_features(inputs["pixel_values"]).pooler_output[0]
    given = llm.generate({"prompt": "Say <start_of_image> now", "multi_modal_data": {"image": embeds}}, params)[0]
    assert given.outputs[0].token_ids == plain.outputs[0].token_ids
    llm.close()


def test_chat_and_tokenize(gemma3):
    """``LLM.chat`` with an image part, and the server's ``/tokenize`` of the same messages, lay the image out as
    Gemma 3's processor does on the rendered template."""
    pytest.importorskip("fastapi")
    path, model, processor = gemma3
    img = _picture(7, (48, 24))
    llm = plinth.LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off")
    params = plinth.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    messages = [{"role": "user", "content": [{"type": "image", "image": None}, {"type": "text", "text": "Paris?"}]}]
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False)
    chat = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": img},
                                                  {"type": "text", "text": "Paris?"}]}], params)[0]
    inputs = processor(text=text, images=[img], return_tensors="pt", add_special_tokens=False)
    assert chat.prompt_token_ids == inputs["input_ids"][0].tolist()
    llm.close()
    assert server_tokens_of_image_chat(path, img, "Paris?") == chat.prompt_token_ids


def test_step_budget_and_images(gemma3):
    """A step budget smaller than one image (whose positions are prefilled in one step) is refused at start-up,
    unless images are turned off; plinth's own default budget is raised to an image beside a full batch of decodes;
    a budget the user gave that leaves less keeps new requests back while an image prompt waits for room."""
    from plinth.config import ConfigError

    path = gemma3[0]
    common = dict(dtype="float32", platform="cpu", block_size=4, selection="off", max_model_len=256)
    with pytest.raises(ConfigError, match="below the 16 positions of one image"):
        plinth.LLM(str(path), max_num_batched_tokens=12, **common)
    llm = plinth.LLM(str(path), max_num_batched_tokens=12, limit_mm_per_prompt={"image": 0}, **common)
    assert llm.llm_engine.scheduler.whole_images == 0
    out = llm.generate("plain text here", plinth.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3
    llm.close()
    llm = plinth.LLM(str(path), max_num_batched_tokens=12, budget_is_default=True, max_num_seqs=8, **common)
    assert llm.llm_engine.scheduler.config.max_num_batched_tokens == 16 + 8
    assert not llm.llm_engine.scheduler.hold_for_images
    llm.close()
    llm = plinth.LLM(str(path), max_num_batched_tokens=20, max_num_seqs=8, **common)
    assert llm.llm_engine.scheduler.config.max_num_batched_tokens == 20 and llm.llm_engine.scheduler.hold_for_images
    llm.close()


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tensor_parallel", "pipeline_stages"])
def test_images_on_worker_processes(gemma3, tp, pp):
    """Two tensor-parallel ranks or two pipeline stages give the one-process engine's tokens (each rank and stage
    attends within the images)."""
    from conftest import generate_on_tp_workers

    path = gemma3[0]
    prompts = [{"prompt": "A <start_of_image> then <start_of_image> end",
                "multi_modal_data": {"image": [_picture(3), _picture(4)]}},
               {"prompt": "<start_of_image> alone", "multi_modal_data": {"image": _picture(5, (32, 32))}}]
    params = plinth.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = plinth.LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off")
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.close()
    got = generate_on_tp_workers(path, prompts, params, size=tp, pp=pp)
    assert [o.outputs[0].token_ids for o in got] == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_images_equal_transformers(tmp_path):
    """On a GPU (the selected attention kernels, then the image rows attended again; CUDA graphs for the decode
    steps): float32 tokens of an image prompt beside a text prompt equal transformers' on the CPU."""
    model, processor = _save(tmp_path)
    llm = plinth.LLM(str(tmp_path), dtype="float32", platform="cuda", block_size=16, gpu_memory_utilization=0.3)
    a, b = _picture(11, (56, 40)), _picture(12)
    prompt = "See <start_of_image> and a few more words before <start_of_image> now"
    outs = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": [a, b]}}, "Large language models"],
                        plinth.SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True))
    inputs = processor(text=prompt, images=[a, b], return_tensors="pt")
    assert outs[0].prompt_token_ids == inputs["input_ids"][0].tolist()
    output_matches_transformers(outs[0], model, steps=8, tol=1e-3, pixel_values=inputs["pixel_values"],
                                token_type_ids=inputs["token_type_ids"])
    output_matches_transformers(outs[1], model, steps=8, tol=1e-3)
    llm.close()


def test_default_budget_makes_room_before_any_worker_starts(gemma3):
    """plinth's own budget is raised from the model directory's config before the executor is chosen (worker
    processes get it too), by an image beside a full batch of decodes and their speculative drafts."""
    from plinth.config import EngineConfig
    from plinth.worker.setup import _room_for_whole_images

    path = gemma3[0]
    base = EngineConfig.from_kwargs(model=str(path), max_num_seqs=8, max_num_batched_tokens=12, platform="cpu")
    assert _room_for_whole_images(base).scheduler.max_num_batched_tokens == 16 + 8
    drafting = EngineConfig.from_kwargs(model=str(path), max_num_seqs=8, max_num_batched_tokens=12, platform="cpu",
                                        speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert _room_for_whole_images(drafting).scheduler.max_num_batched_tokens == 16 + 8 * 4
    off = EngineConfig.from_kwargs(model=str(path), max_num_seqs=8, max_num_batched_tokens=12, platform="cpu",
                                   limit_mm_per_prompt={"image": 0})
    assert _room_for_whole_images(off).scheduler.max_num_batched_tokens == 12


PAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16}


def test_crop_count_equals_the_processors_pan_and_scan():
    """How many crops an image gets, from its size and the settings alone, equals the crops transformers' processor
    cuts, over sizes and settings around every threshold."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from plinth.multimodal.gemma3 import PAN_AND_SCAN_DEFAULTS, crop_count

    hf = Gemma3ImageProcessorPil(size={"height": 64, "width": 64})
    checked = 0
    for min_size, most, ratio in [(256, 4, 1.2), (16, 4, 1.2), (16, 2, 1.5), (40, 6, 1.0), (7, 1, 2.0)]:
        settings = type("S", (), {**PAN_AND_SCAN_DEFAULTS, "do_pan_and_scan": True,
                                  "pan_and_scan_min_crop_size": min_size, "pan_and_scan_max_num_crops": most,
                                  "pan_and_scan_min_ratio_to_activate": ratio})()
        for h in (12, 30, 40, 64, 100, 257, 600):
            for w in (12, 33, 40, 48, 130, 512, 1100):
                crops = hf.pan_and_scan(np.zeros((3, h, w), dtype=np.uint8), min_size, most, ratio)
                assert crop_count(h, w, settings) == len(crops), (h, w, min_size, most, ratio)
                checked += bool(crops)
    assert checked > 40   # (crops were cut in many of the cases)


def test_pan_and_scan_crops_equal_transformers(gemma3):
    """With pan-and-scan on (the engine's mm_processor_kwargs), a wide and a tall image get crops and a square one
    none: the prompt is Gemma 3's processor's (its sentence around the image and the crops, tokenized with the text
    beside it), and greedy tokens and log-probabilities equal transformers' on the processor's pixels."""
    path, model, processor = gemma3
    llm = plinth.LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off", max_model_len=512,
                     mm_processor_kwargs=PAN)
    images = [_picture(8, (40, 130)), _picture(9, (100, 30)), _picture(10, (40, 44))]
    prompt = "Look at this <start_of_image> and<start_of_image>\nthen <start_of_image>what"
    params = plinth.SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, params)[0]
    inputs = processor(text=prompt, images=images, return_tensors="pt", **PAN)
    assert inputs["pixel_values"].shape[0] == (1 + 3) + (1 + 3) + 1   # (3 crops each for the first two, none after)
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    output_matches_transformers(out, model, pixel_values=inputs["pixel_values"],
                                token_type_ids=inputs["token_type_ids"])
    # the same through /tokenize's layout (sizes only, no pixels)
    ids = llm.llm_engine.tokenize(prompt)
    assert llm.llm_engine.images.laid_out(ids, images) == out.prompt_token_ids
    llm.close()


def test_pan_and_scan_per_request_and_refused_settings(gemma3):
    """A request's own mm_processor_kwargs turn the crops on for its images alone; settings out of range are
    refused with the field named."""
    from plinth.core.scheduler import RequestRejectedError

    path, model, processor = gemma3
    llm = plinth.LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off", max_model_len=512)
    img = _picture(11, (30, 90))
    params = plinth.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    plain, cropped = llm.generate([{"prompt": "See <start_of_image>", "multi_modal_data": {"image": img}},
                                   {"prompt": "See <start_of_image>", "multi_modal_data": {"image": img},
                                    "mm_processor_kwargs": PAN}], params)
    assert plain.prompt_token_ids == processor(text="See <start_of_image>", images=[img])["input_ids"][0]
    assert cropped.prompt_token_ids == processor(text="See <start_of_image>", images=[img], **PAN)["input_ids"][0]
    assert cropped.prompt_token_ids.count(model.config.image_token_id) == 4 * TOKENS
    for bad, message in [({"pan_and_scan_max_num_crops": 0}, "from 1 to"),
                         ({"pan_and_scan_min_crop_size": -4}, "above 0"),
                         ({"do_pan_and_scan": "yes"}, "takes a bool")]:
        with pytest.raises(RequestRejectedError, match=message) as err:
            llm.generate({"prompt": "See <start_of_image>", "multi_modal_data": {"image": img},
                          "mm_processor_kwargs": bad}, params)
        assert err.value.param == "mm_processor_kwargs"
    llm.close()


def test_pan_and_scan_only_when_asked_and_partial_layouts(gemma3, tmp_path):
    """An image processor config that turns pan-and-scan on is not what turns it on (transformers' Gemma3Processor
    passes its own defaults over it): only mm_processor_kwargs do. With crops on, a token prompt that lays out some
    images itself and leaves others bare is refused with a clear message."""
    import json
    import shutil

    from plinth.core.scheduler import RequestRejectedError

    path, model, processor = gemma3
    copy = tmp_path / "configured"
    shutil.copytree(path, copy)
    config = json.loads((copy / "preprocessor_config.json").read_text())
    (copy / "preprocessor_config.json").write_text(json.dumps({**config, **PAN}))
    img = _picture(12, (40, 130))
    params = plinth.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm = plinth.LLM(str(copy), dtype="float32", platform="cpu", block_size=4, selection="off", max_model_len=512)
    out = llm.generate({"prompt": "See <start_of_image>", "multi_modal_data": {"image": img}}, params)[0]
    assert out.prompt_token_ids == processor(text="See <start_of_image>", images=[img])["input_ids"][0]
    assert out.prompt_token_ids.count(model.config.image_token_id) == TOKENS
    llm.close()
    llm = plinth.LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off", max_model_len=512,
                     mm_processor_kwargs=PAN)
    square = _picture(13, (40, 40))
    laid = processor(text="a <start_of_image>", images=[square], **PAN)["input_ids"][0]
    bare = llm.llm_engine.tokenize(" b <start_of_image> c")
    with pytest.raises(RequestRejectedError, match="lays out all of its images or none"):
        llm.generate({"prompt_token_ids": laid + bare, "multi_modal_data": {"image": [square, img]}}, params)
    with pytest.raises(RequestRejectedError, match="each crop counts as an image"):
        llm.generate({"prompt_token_ids": processor(text="a <start_of_image>", images=[img])["input_ids"][0],
                      "multi_modal_data": {"image": [img]}}, params)
    llm.close()
