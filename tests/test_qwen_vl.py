"""Image inputs for Qwen2-VL and Qwen2.5-VL: tiny random checkpoints written by transformers, run by plinth and by
transformers' ``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration`` on the same pixels
(images of any size as patches, the multimodal RoPE's three-component positions)."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch
import transformers
from conftest import decisive_weights, generate_on_tp_workers, make_tokenizer, random_picture
from safetensors.torch import load_file, save_file

from plinth import LLM, SamplingParams
from plinth.core.scheduler import RequestRejectedError
from plinth.multimodal.mrope import image_positions, layout

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

SPECIAL = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
        "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
        "{% elif p['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>{% else %}{{ p['text'] }}{% endif %}"
        "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
#: the tests' video processor settings (as transformers' Qwen2VLVideoProcessor saves them): frames of 4 to 80 merged
#: 8-pixel squares
VIDEO_PROCESSOR = {"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": 4, "temporal_patch_size": 2,
                   "merge_size": 2, "size": {"shortest_edge": 8 * 8 * 4, "longest_edge": 8 * 8 * 80}}


def _picture(seed: int, size: tuple[int, int] = (40, 52)) -> Image.Image:
    return random_picture(seed, size)


def _save_qwen_vl(path, version: str = "2", seed: int = 0, tie: bool = False):
    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    start, pad, end, video = tok.convert_tokens_to_ids(SPECIAL)
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, eos_token_id=tok.eos_token_id,
                bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    common = dict(depth=2, num_heads=2, patch_size=4, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    if version == "2":
        vision = dict(common, embed_dim=32, hidden_size=64, mlp_ratio=2)
        cfg = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=pad,
                                         video_token_id=video, vision_start_token_id=start,
                                         vision_end_token_id=end, tie_word_embeddings=tie)
        cls = transformers.Qwen2VLForConditionalGeneration
    else:   # windows of 2x2 merged patches; the second block attends over the whole image
        vision = dict(common, hidden_size=32, intermediate_size=64, out_hidden_size=64, window_size=16,
                      fullatt_block_indexes=[1])
        cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=pad,
                                            video_token_id=video, vision_start_token_id=start,
                                            vision_end_token_id=end, tie_word_embeddings=tie)
        cls = transformers.Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(seed)
    model = decisive_weights(cls(cfg).eval())
    model.save_pretrained(path)
    tok.chat_template = CHAT
    tok.save_pretrained(path)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                         size={"shortest_edge": 8 * 8 * 4, "longest_edge": 8 * 8 * 80})
    processor.save_pretrained(path)
    (path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PROCESSOR))
    return model, processor, tok


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2vl")
    return (path, *_save_qwen_vl(path, "2"))


@pytest.fixture(scope="module")
def qwen25(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen25vl")
    return (path, *_save_qwen_vl(path, "2.5", seed=1))


def _reference(model, processor, ids, images, steps=6, videos=()):
    """transformers' greedy tokens and each step's log-probabilities for an expanded prompt and its images and videos
    (``(frames, fps or None)``; their patches as plinth makes them, which equal transformers' video processor's:
    see ``test_video_patches_equal_transformers_video_processor``)."""
    input_ids = torch.tensor([ids])
    extra: dict = {}
    if images:
        out = processor(images=images, return_tensors="pt")
        extra = dict(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
    if videos:
        from plinth.multimodal import video as v

        size = VIDEO_PROCESSOR["size"]
        cfg = v.video_settings(model.config, None, {"video_min_pixels": size["shortest_edge"],
                                                    "video_max_pixels": size["longest_edge"]})
        made = [v.patches(cfg, v.Video(frames, fps)) for frames, fps in videos]
        extra.update(pixel_values_videos=torch.cat([p for p, _ in made]),
                     video_grid_thw=torch.tensor([g for _, g in made]))
        if model.config.model_type == "qwen2_5_vl":   # (the processor's float32 seconds a frame group)
            extra["second_per_grid_ts"] = torch.tensor([cfg.temporal / (fps or v.DEFAULT_FPS) for _, fps in videos],
                                                       dtype=torch.float32)
    if images or videos:
        extra["mm_token_type_ids"] = ((input_ids == model.config.image_token_id).int()
                                      + 2 * (input_ids == model.config.video_token_id).int())
    with torch.no_grad():
        gen = model.generate(input_ids=input_ids, max_new_tokens=steps, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, **extra)
    return gen.sequences[0, len(ids):].tolist(), [torch.log_softmax(s[0].float(), -1) for s in gen.scores]


def _greedy(steps=6, logprobs=5):
    return SamplingParams(max_tokens=steps, temperature=0.0, logprobs=logprobs, ignore_eos=True)


def _check(out, model, processor, images, steps=6, videos=()):
    tokens, logprobs = _reference(model, processor, out.prompt_token_ids, images, steps, videos)
    assert out.outputs[0].token_ids == tokens
    for step, ref in zip(out.outputs[0].logprobs, logprobs, strict=True):
        for tid, lp in step.items():
            assert abs(lp.logprob - ref[tid].item()) < 1e-4, (tid, lp.logprob, ref[tid].item())


def test_layout_matches_transformers_rope_index(qwen2):
    """The engine's rotary layout (text shifted after each image, image rows at three-component positions) equals
    transformers' ``get_rope_index`` for a prompt with two images of different grids."""
    model = qwen2[1]
    grids = [(1, 10, 14), (1, 6, 4)]
    lengths = [t * h * w // 4 for t, h, w in grids]
    pad = model.config.image_token_id
    ids = [5, 6, 7] + [pad] * lengths[0] + [8, 9] + [pad] * lengths[1] + [10]
    spans = [(3, lengths[0], grids[0]), (3 + lengths[0] + 2, lengths[1], grids[1])]
    rope, rows = layout(spans, 2)
    input_ids = torch.tensor([ids])
    ref, delta = model.model.get_rope_index(input_ids, mm_token_type_ids=(input_ids == pad).int(),
                                             image_grid_thw=torch.tensor(grids))
    ref = ref[:, 0].T.numpy()                                                          # [T, 3]
    text = np.array([i for i, t in enumerate(ids) if t != pad])
    np.testing.assert_array_equal(ref[text, 0], text + rope.shifts(0, len(ids))[text])
    for (offset, length, _), r in zip(spans, rows, strict=True):
        np.testing.assert_array_equal(ref[offset:offset + length], r)
    assert rope.shifts(len(ids), 1)[0] == int(delta)   # generated tokens: transformers' rope delta
    assert image_positions(4, (1, 4, 6), 2).tolist() == [[4, 4, 4], [4, 4, 5], [4, 4, 6], [4, 5, 4], [4, 5, 5],
                                                        [4, 5, 6]]


def test_qwen2_vl_tokens_and_logprobs_equal_transformers(qwen2):
    """One image in the middle of a prompt: its placeholder widened to the image's merged patches; greedy tokens and
    every step's top log-probabilities equal transformers' on the same pixels (decode steps take the last shift)."""
    path, model, processor, _ = qwen2
    llm = LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off")
    img = _picture(1)
    out = llm.generate({"prompt": f"The quick {IMAGE} brown fox", "multi_modal_data": {"image": img}},
                       _greedy())[0]
    assert out.prompt_token_ids.count(model.config.image_token_id) == 30   # 40x52 -> 40x48 pixels, 5x6 merged
    _check(out, model, processor, [img])
    # text alone on the same model: plain positions
    plain = llm.generate("The quick brown fox", _greedy())[0]
    _check(plain, model, processor, [])


def test_qwen25_vl_two_images_chunked_mixed_batch(qwen25):
    """Qwen2.5-VL (windowed vision attention, gated MLP, RMSNorm): two images of different sizes with text between,
    the prompt prefilled in chunks of 16 tokens, batched with a text-only prompt and a second image prompt; every
    output equals transformers' run alone."""
    path, model, processor, _ = qwen25
    llm = LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off",
              max_num_batched_tokens=16, enable_chunked_prefill=True, max_model_len=256)
    a, b, c = _picture(2, (48, 40)), _picture(3, (24, 72)), _picture(4, (33, 33))
    prompts = [{"prompt": f"A {IMAGE} then {IMAGE} end", "multi_modal_data": {"image": [a, b]}},
               "just some text here",
               {"prompt": f"{IMAGE} first", "multi_modal_data": {"image": c}}]
    outs = llm.generate(prompts, _greedy())
    _check(outs[0], model, processor, [a, b])
    _check(outs[1], model, processor, [])
    _check(outs[2], model, processor, [c])


def test_chat_image_url_and_prefix_cache(qwen2):
    """``LLM.chat`` with an image given as a data URL renders the vision tokens around the image token; the same
    conversation again reads its blocks from the prefix cache and gives the same tokens; another image does not."""
    path, model, processor, _ = qwen2
    llm = LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off", enable_prefix_caching=True)
    img = _picture(5, (56, 40))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "look "},
                                             {"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": " what"}]}]
    first = llm.chat(messages, _greedy())[0]
    _check(first, model, processor, [img])
    again = llm.chat(messages, _greedy())[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens > 0
    other = _picture(6, (56, 40))
    buf = io.BytesIO()
    other.save(buf, format="PNG")
    messages[0]["content"][1]["image_url"]["url"] = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    third = llm.chat(messages, _greedy())[0]
    _check(third, model, processor, [other])


def test_original_layout_checkpoint_and_bad_input(qwen2, tmp_path):
    """A checkpoint in Qwen2-VL's original tensor layout (``model.layers.*``, ``visual.*``) runs the same; a prompt
    whose image tokens do not match its images is refused with a clear error."""
    path, model, processor, _ = qwen2
    import shutil

    for f in path.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    tensors = {}
    for f in path.glob("*.safetensors"):
        for name, t in load_file(f).items():
            name = name.replace("model.language_model.", "model.").replace("model.visual.", "visual.")
            tensors[name] = t
    assert any(n.startswith("visual.") for n in tensors) and any(n.startswith("model.layers.") for n in tensors)
    save_file(tensors, tmp_path / "model.safetensors")
    llm = LLM(str(tmp_path), dtype="float32", platform="cpu", block_size=4, selection="off")
    img = _picture(7)
    out = llm.generate({"prompt": f"x {IMAGE} y", "multi_modal_data": {"image": img}}, _greedy())[0]
    _check(out, model, processor, [img])
    with pytest.raises(RequestRejectedError, match="names 2 image"):
        llm.llm_engine.add_request("bad", f"x {IMAGE} {IMAGE}", _greedy(), multi_modal_data={"image": img})


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tensor_parallel", "pipeline_stages"])
def test_worker_processes_take_the_rope_shift(tp, pp, qwen2):
    """Two worker processes (tensor-parallel ranks, or two pipeline stages: the first encodes the images, the second
    takes their rows' positions): the batch carries each token's rotary shift and each image's positions to the
    workers; tokens equal transformers'."""
    path, model, processor, _ = qwen2
    a, b = _picture(8), _picture(9, (30, 60))
    prompts = [{"prompt": f"The {IMAGE} quick brown", "multi_modal_data": {"image": a}},
               {"prompt": f"{IMAGE} Paris {IMAGE}", "multi_modal_data": {"image": [b, a]}}]
    got = generate_on_tp_workers(path, prompts, _greedy(logprobs=None), size=tp, pp=pp)
    for out, images in zip(got, [[a], [b, a]], strict=True):
        assert out.outputs[0].token_ids == _reference(model, processor, out.prompt_token_ids, images)[0]


def test_compiled_cpu_decode_step_takes_the_shift():
    """The compiled CPU decode step's inputs: rotary positions shifted, slots and lengths from the cache's."""
    from plinth.worker.cpu_graphs import CompiledDecodeRunner

    runner = CompiledDecodeRunner.__new__(CompiledDecodeRunner)
    runner.block_size = 4
    pos = np.array([5, 9])
    tokens, rope, slots, tables, lens = runner.inputs(np.array([3, 4]), pos, [[7, 8], [1, 2, 3]], 4,
                                                      rope_shift=np.array([-3, 0]))
    assert rope.tolist()[:2] == [2, 9]
    assert slots.tolist()[:2] == [8 * 4 + 1, 3 * 4 + 1]
    assert lens.tolist()[:2] == [6, 10]
    plain = runner.inputs(np.array([3, 4]), pos, [[7, 8], [1, 2, 3]], 4)
    assert plain[1].tolist()[:2] == [5, 9]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("version", ["2", "2.5"])
def test_gpu_equals_transformers(version, tmp_path):
    """On a GPU (CUDA graphs for the decode steps, whose rotary positions take each sequence's shift): images of two
    shapes and a text-only prompt in one batch, float32 tokens equal transformers' on the CPU."""
    model, processor, _ = _save_qwen_vl(tmp_path, version, seed=3)
    llm = LLM(str(tmp_path), dtype="float32", platform="cuda", block_size=16, gpu_memory_utilization=0.3)
    wide, tall = _picture(18, (30, 70)), _picture(19, (64, 40))
    prompts = [{"prompt": f"{IMAGE} Paris {IMAGE}", "multi_modal_data": {"image": [tall, wide]}},
               "Large language models",
               {"prompt": f"The quick {IMAGE} brown fox", "multi_modal_data": {"image": wide}}]
    outs = llm.generate(prompts, _greedy(steps=8, logprobs=None))
    assert llm.llm_engine.runner.graphs is not None
    for out, images in zip(outs, [[tall, wide], [], [wide]], strict=True):
        assert out.outputs[0].token_ids == _reference(model, processor, out.prompt_token_ids, images, steps=8)[0]


def test_new_weights_reach_the_vision_tower(qwen2, tmp_path, monkeypatch):
    """update_weights with a transformers state dict (``model.language_model.*``, ``model.visual.*``): the vision
    tower takes its tensors, images encoded with the old weights are forgotten, and tokens equal the new model's."""
    monkeypatch.setenv("PLINTH_CPU_PACKED", "0")   # weights update_weights() can take (the CPU path's plain ones)
    path = qwen2[0]
    other, processor, _ = _save_qwen_vl(tmp_path, "2", seed=9)
    llm = LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off")
    img = _picture(10)
    prompt = {"prompt": f"The {IMAGE} fox", "multi_modal_data": {"image": img}}
    before = llm.generate(prompt, _greedy(logprobs=None))[0]
    state = other.state_dict()
    assert llm.update_weights(state) == len(state)
    after = llm.generate(prompt, _greedy(logprobs=None))[0]
    want = _reference(other, processor, after.prompt_token_ids, [img])[0]
    assert after.outputs[0].token_ids == want != before.outputs[0].token_ids
    from plinth.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="visual"):
        llm.update_weights({"model.visual.blocks.0.attn.qkv.weight": torch.ones(3, 3)})


def test_images_encoded_together_equal_alone(qwen25, monkeypatch):
    """The runner encodes a step's new images in passes of at most MAX_PATCHES patches (several images a pass); the
    embeddings equal each image encoded alone."""
    import plinth.multimodal.runner as runner_mod

    path = qwen25[0]
    llm = LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off")
    support, features = llm.llm_engine.images, llm.llm_engine.runner.images
    pics = [_picture(20 + i, size) for i, size in enumerate([(48, 40), (24, 72), (33, 33), (64, 64)])]
    _, items = support.items([support.token_id] * 4, {"image": pics})
    together = [e.clone() for e in features.embeddings(items)]
    features.clear()
    monkeypatch.setattr(runner_mod, "MAX_PATCHES", 1)   # every image alone
    pieces = [piece for item in items for piece in runner_mod._pieces(item)]
    assert [len(g) for g in runner_mod._patch_groups(pieces)] == [1, 1, 1, 1]
    alone = features.embeddings(items)
    for a, b in zip(together, alone, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(runner_mod, "MAX_PATCHES", len(items[0].pixel_values) + len(items[1].pixel_values))
    assert [len(g) for g in runner_mod._patch_groups(pieces)][0] == 2


@pytest.mark.parametrize("version", ["2", "2.5"])
def test_tied_embeddings_checkpoint(version, tmp_path):
    """Qwen2-VL-2B and Qwen2.5-VL-3B tie their LM head to the embeddings (the top-level config says so, the text
    config does not repeat it, the checkpoint has no ``lm_head.weight``): it loads and equals transformers."""
    model, processor, _ = _save_qwen_vl(tmp_path, version, seed=4, tie=True)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    llm = LLM(str(tmp_path), dtype="float32", platform="cpu", block_size=4, selection="off")
    img = _picture(30)
    out = llm.generate({"prompt": f"a {IMAGE} b", "multi_modal_data": {"image": img}}, _greedy())[0]
    _check(out, model, processor, [img])


def test_positions_counted_from_the_size_alone(qwen2):
    """The server counts an image's positions on its event loop from the image's size (no patches made): the count
    equals the processor's for small, thin and large images."""
    support = LLM(str(qwen2[0]), dtype="float32", platform="cpu", block_size=4, selection="off").llm_engine.images
    sizes = [(1, 1), (2, 3), (8, 400), (400, 8), (40, 52), (300, 200), (97, 131)]
    want = [support.prepare({"image": _picture(31, size)}).lengths[0] for size in sizes]
    import types

    proc = support.processor   # a stand-in with the processor's settings and no way to run it
    # a processor that does not resize takes only images of whole merged patches
    proc.do_resize = False
    assert support.length_of(_picture(31, (48, 64))) == support.prepare({"image": _picture(31, (48, 64))}).lengths[0]
    for size in [(40, 52), (97, 131)]:
        with pytest.raises(RequestRejectedError, match="whole 8-pixel squares"):
            support.length_of(_picture(31, size))
        with pytest.raises(RequestRejectedError):
            support.prepare({"image": _picture(31, size)})
    proc.do_resize = True
    support.processor = types.SimpleNamespace(patch_size=proc.patch_size, merge_size=proc.merge_size,
                                              size=proc.size, do_resize=proc.do_resize)
    assert [support.length_of(_picture(31, size)) for size in sizes] == want


def test_peft_adapter_on_the_language_model(qwen2, tmp_path):
    """A PEFT LoRA adapter trained on transformers' Qwen2-VL (its tensors named ``...model.language_model.layers...``)
    applies to plinth's language model: tokens and log-probabilities equal transformers' merged model."""
    peft = pytest.importorskip("peft")
    from plinth.lora.request import LoRARequest

    path = qwen2[0]
    base, processor, _ = _save_qwen_vl(tmp_path / "base", "2")
    # (rank and alpha overrides name modules as the adapter does: under language_model)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj)",
                             alpha_pattern={r"language_model\.layers\.0\.self_attn\.q_proj": 32},
                             rank_pattern={r"language_model\.layers\.1\.self_attn\.v_proj": 8})
    peft_model = peft.get_peft_model(base, config)
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    peft_model.save_pretrained(tmp_path / "adapter")
    merged = peft_model.merge_and_unload().eval()
    llm = LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off", enable_lora=True,
              max_lora_rank=8)
    img = _picture(32)
    out = llm.generate({"prompt": f"The quick {IMAGE} brown fox", "multi_modal_data": {"image": img}}, _greedy(),
                       lora_request=LoRARequest("a", 1, str(tmp_path / "adapter")))[0]
    _check(out, merged, processor, [img])


def test_mm_processor_kwargs_bound_the_pixels(qwen2):
    """``mm_processor_kwargs={"max_pixels": ...}`` resizes images smaller (fewer positions), as transformers'
    processor with the same setting does, and tokens equal transformers'; bad settings are refused at start."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from plinth.config import ConfigError

    path, model, _, _ = qwen2
    llm = LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off",
              mm_processor_kwargs='{"max_pixels": 1024}')
    img = _picture(33, (80, 120))
    out = llm.generate({"prompt": f"a {IMAGE} b", "multi_modal_data": {"image": img}}, _greedy())[0]
    small = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                     size={"shortest_edge": 256, "longest_edge": 1024})
    grid = small(images=[img], return_tensors="pt")["image_grid_thw"][0].tolist()
    assert out.prompt_token_ids.count(model.config.image_token_id) == grid[1] * grid[2] // 4 <= 1024 // 64
    _check(out, model, small, [img])
    for bad, words in [({"max_pixel": 5}, "'max_pixel' cannot be set"),
                       ({"min_pixels": 4096, "max_pixels": 1024}, "more than max_pixels"),
                       ({"max_pixels": "big"}, "positive integer"), ('["x"]', "JSON object"),
                       ({"merge_size": 1}, "'merge_size' cannot be set"), ({"patch_size": 8}, "cannot be set"),
                       ({"do_normalize": 1}, "takes a bool")]:
        with pytest.raises(ConfigError, match=words):
            LLM(str(path), dtype="float32", platform="cpu", selection="off", mm_processor_kwargs=bad)
    import argparse

    from plinth.entrypoints.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser, "serve")
    args = parser.parse_args([str(path), "--mm-processor-kwargs", '{"max_pixels": 2048, "min_pixels": 64}'])
    assert engine_config_from_args(args).model.mm_processor_kwargs == {"max_pixels": 2048, "min_pixels": 64}


@pytest.mark.parametrize("fixture", ["qwen2", "qwen25"])
def test_encoder_profile_pass(fixture, request):
    """Start-up's memory profile runs the encoder's largest pass (on a GPU): one image of as many patches as a pass
    takes, or as a prompt of max_model_len positions holds; here on the CPU, that it runs at all."""
    import plinth.multimodal.runner as runner_mod

    path = request.getfixturevalue(fixture)[0]
    llm = LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off", max_model_len=64)
    features = llm.llm_engine.runner.images
    seen = []
    real = features.encoder.forward
    features.encoder.forward = lambda pixels, grid: seen.append(tuple(grid[0].tolist())) or real(pixels, grid)
    old = runner_mod.MAX_PATCHES
    runner_mod.MAX_PATCHES = 16
    try:
        features.profile(64)   # 64 positions: 256 patches, a 16x16 grid
        features.profile(64, image_patches=64)   # the processor's largest image: 64 patches
    finally:
        runner_mod.MAX_PATCHES = old
    assert seen == [(1, 16, 16), (1, 8, 8)]
    from plinth.multimodal.images import max_patches

    assert max_patches(llm.llm_engine.images.mm_config, str(path), None) == 8 * 8 * 80 // 16
    # (a video's frame group counts too: the video processor's bound is the larger here)
    assert max_patches(llm.llm_engine.images.mm_config, str(path), {"max_pixels": 1024}) == 8 * 8 * 80 // 16
    assert max_patches(llm.llm_engine.images.mm_config, str(path), {"max_pixels": 1024,
                                                                    "video_max_pixels": 512}) == 1024 // 16


def test_server_chat_and_tokenize(qwen2):
    """POST /v1/chat/completions with an image_url part on a Qwen2-VL model: the reply equals transformers' on the
    rendered prompt, usage counts the image's positions, and /tokenize counts the same."""
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    path, model, processor, _ = qwen2
    img = _picture(34, (60, 44))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(path), dtype="float32", block_size=4, selection="off",
                                                platform="cpu", served_model_name="qwen"))
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "Paris is"}]}]
    with TestClient(build_app(AsyncLLMEngine(engine))) as http:
        r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0,
                                                    "ignore_eos": True})
        assert r.status_code == 200, r.text
        ids = engine.tokenize(f"<|im_start|>user\n{IMAGE}Paris is<|im_end|>\n<|im_start|>assistant\n",
                              add_special_tokens=False)
        expanded, _ = engine.images.expand(ids, [engine.images.length_of(img)])
        want = _reference(model, processor, expanded, [img])[0]
        assert r.json()["choices"][0]["message"]["content"] == engine.tokenizer.decode(want, skip_special_tokens=True)
        assert r.json()["usage"]["prompt_tokens"] == len(expanded)
        r = http.post("/tokenize", json={"messages": messages})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == expanded


def test_images_given_as_embeddings(qwen2):
    """An image given as its embeddings (``{"image_embeds", "image_grid_thw"}``, as transformers' vision tower makes
    them) runs as the image itself does, alone and beside a picture; bad embeddings are refused clearly."""
    path, model, processor, _ = qwen2
    llm = LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off")
    a, b = _picture(40), _picture(41, (30, 64))
    px = processor(images=[a], return_tensors="pt")
    with torch.no_grad():
        embeds = model.model.visual(px["pixel_values"], grid_thw=px["image_grid_thw"]).pooler_output
    given = {"image_embeds": embeds, "image_grid_thw": px["image_grid_thw"]}
    prompt = f"x {IMAGE} y {IMAGE}"
    by_pixels = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [a, b]}}, _greedy())[0]
    by_embeds = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [given, b]}}, _greedy())[0]
    assert by_embeds.prompt_token_ids == by_pixels.prompt_token_ids
    assert by_embeds.outputs[0].token_ids == by_pixels.outputs[0].token_ids
    for x, y in zip(by_embeds.outputs[0].logprobs, by_pixels.outputs[0].logprobs, strict=True):
        for tid, lp in x.items():
            assert abs(lp.logprob - y[tid].logprob) < 1e-4
    _check(by_embeds, model, processor, [a, b])
    engine = llm.llm_engine
    grid = px["image_grid_thw"]
    cases = [({"image_embeds": embeds[:, :32], "image_grid_thw": grid}, r"\[positions, 64\]"),
             ({"image_embeds": embeds[:-1], "image_grid_thw": grid}, "the embeddings have"),
             ({"image_embeds": embeds}, "need 'image_grid_thw'"),
             ({"image_embeds": embeds, "image_grid_thw": grid, "extra": 1}, "got keys"),
             ({"image_embeds": embeds.long(), "image_grid_thw": grid}, "dense float32"),
             ({"image_embeds": embeds.to_sparse(), "image_grid_thw": grid}, "dense float32"),
             ({"image_embeds": embeds * float("nan"), "image_grid_thw": grid}, "not finite"),
             ({"image_embeds": embeds.double() * 1e300, "image_grid_thw": grid}, "not finite in the model's float32")]
    for data, words in cases:
        with pytest.raises(RequestRejectedError, match=words):
            engine.add_request("bad", f"x {IMAGE}", _greedy(), multi_modal_data={"image": data})
    assert not engine.has_unfinished_requests()


def test_mm_processor_kwargs_per_prompt(qwen2):
    """A prompt's own ``mm_processor_kwargs`` (vLLM's per-prompt key) process its images alone: the same image is
    fewer positions in that prompt than in another of the same batch, and both equal transformers' with the matching
    processor; bad settings refuse the prompt clearly."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path, model, processor, _ = qwen2
    llm = LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off")
    img = _picture(35, (80, 120))
    small, default = llm.generate([
        {"prompt": f"a {IMAGE} b", "multi_modal_data": {"image": img}, "mm_processor_kwargs": {"max_pixels": 1024}},
        {"prompt": f"a {IMAGE} b", "multi_modal_data": {"image": img}}], _greedy())
    pad = model.config.image_token_id
    assert small.prompt_token_ids.count(pad) < default.prompt_token_ids.count(pad)
    smaller = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                       size={"shortest_edge": 256, "longest_edge": 1024})
    _check(small, model, smaller, [img])
    _check(default, model, processor, [img])
    with pytest.raises(RequestRejectedError, match="'merge_size' cannot be set"):
        llm.generate({"prompt": f"a {IMAGE}", "multi_modal_data": {"image": img}, "mm_processor_kwargs":
                      {"merge_size": 1}})
    with pytest.raises(ValueError, match="give them in 'multi_modal_data'"):
        llm.generate({"prompt": "a", "mm_processor_kwargs": {"max_pixels": 1024}})
    # bounds above the engine's (which start-up sized the encoder's memory for) are refused
    for key, bound in (("max_pixels", 8 * 8 * 80), ("video_max_pixels", 8 * 8 * 80)):
        with pytest.raises(RequestRejectedError, match=f"{key} {bound + 64} is more than the engine's {bound}"):
            llm.generate({"prompt": f"a {IMAGE}", "multi_modal_data": {"image": img},
                          "mm_processor_kwargs": {key: bound + 64}})


def _video(seed: int, frames: int = 5, size: tuple[int, int] = (40, 52)) -> np.ndarray:
    """``[frames, H, W, 3]`` uint8: a random first frame drifting a little each frame."""
    rng = np.random.default_rng(seed)
    first = rng.random((*size, 3)) * 200
    return np.stack([(first + 10 * i + rng.random((*size, 3)) * 30).clip(0, 255) for i in range(frames)]).astype(
        "uint8")


@pytest.mark.parametrize("fixture", ["qwen2", "qwen25"])
def test_video_tokens_and_logprobs_equal_transformers(fixture, request):
    """A video (5 frames: the last repeated to 3 groups of 2) beside an image in one prompt, a second prompt with two
    videos, one given as PIL frames with its frame rate, prefilled in chunks of 16 tokens: the video token widened to
    the merged patches of all its groups, the frame groups' rotary time positions (Qwen2-VL one a group; Qwen2.5-VL
    ``tokens_per_second`` a second, at 4 frames a second or, without a rate, 24), and greedy tokens and every step's
    log-probabilities equal transformers' on the same patches. (The videos' times stay within their rows and columns,
    where transformers 5.3+ and the reference place the text after a video alike: see
    ``test_text_after_a_video_resumes_past_its_times``.)"""
    path, model, processor, _ = request.getfixturevalue(fixture)
    llm = LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off", max_num_batched_tokens=16,
              enable_chunked_prefill=True, max_model_len=512)
    img, clip, other = _picture(30), _video(31), _video(32, frames=4, size=(24, 40))
    prompts = [{"prompt": f"A {IMAGE} then {VIDEO} end", "multi_modal_data": {"image": img, "video": clip}},
               {"prompt": f"{VIDEO} and {VIDEO}",
                "multi_modal_data": {"video": [([Image.fromarray(f) for f in other], {"fps": 4.0}), clip]}}]
    outs = llm.generate(prompts, _greedy())
    assert outs[0].prompt_token_ids.count(model.config.video_token_id) == 3 * 5 * 6   # 3 groups of 5x6 merged
    _check(outs[0], model, processor, [img], videos=[(clip, None)])
    _check(outs[1], model, processor, [], videos=[(other, 4.0), (clip, None)])


def test_video_patches_equal_transformers_video_processor():
    """plinth's frames-to-patches (resize, rescale, normalize, the last frame repeated, the patch layout) equals
    transformers' ``Qwen2VLVideoProcessor``, value for value (it needs torchvision, which plinth does not)."""
    pytest.importorskip("torchvision")
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    from plinth.multimodal import video as v

    for frames, size in [(3, (37, 53)), (4, (48, 40)), (6, (120, 90))]:
        clip = _video(frames, frames, size)
        proc = Qwen2VLVideoProcessor(**{k: val for k, val in VIDEO_PROCESSOR.items() if k != "video_processor_type"})
        out = proc(videos=[clip], return_tensors="pt", cap_pixels_per_frame=False)
        cfg = v.VideoSettings(patch=4, temporal=2, merge=2, min_pixels=8 * 8 * 4, max_pixels=8 * 8 * 80)
        patches, grid = v.patches(cfg, v.Video(clip))
        assert grid == tuple(out["video_grid_thw"][0].tolist())
        assert torch.equal(patches, out["pixel_values_videos"])


def test_video_patch_layout_equals_the_image_processors():
    """Without torchvision: a video of two equal frames that need no resizing is one frame group whose patches are
    the image processor's patches of that frame (the image processor repeats an image over the group); a third frame
    makes a second group of it repeated."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from plinth.multimodal import video as v

    frame = _video(40, 1, (32, 48))[0]
    proc = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                    size={"shortest_edge": 8 * 8 * 4, "longest_edge": 8 * 8 * 80})
    want = proc(images=[Image.fromarray(frame)], return_tensors="pt")["pixel_values"]
    cfg = v.VideoSettings(patch=4, temporal=2, merge=2, min_pixels=8 * 8 * 4, max_pixels=8 * 8 * 80)
    patches, grid = v.patches(cfg, v.Video(np.stack([frame, frame])))
    assert grid == (1, 8, 12)
    torch.testing.assert_close(patches, want, atol=1e-6, rtol=1e-6)
    patches, grid = v.patches(cfg, v.Video(np.stack([frame, frame, frame])))
    assert grid == (2, 8, 12)
    torch.testing.assert_close(patches, torch.cat([want, want]), atol=1e-6, rtol=1e-6)


def test_long_video_encodes_in_runs_of_frame_groups(qwen25, monkeypatch):
    """A video of more patches than a pass takes is encoded a few frame groups at a time (the vision tower attends
    within a group): the embeddings equal the whole video's."""
    import plinth.multimodal.runner as runner_mod

    llm = LLM(str(qwen25[0]), dtype="float32", platform="cpu", block_size=4, selection="off", max_model_len=512)
    support, features = llm.llm_engine.images, llm.llm_engine.runner.images
    _, items = support.items([support.video_token_id], {"video": _video(41, frames=8)})
    whole = features.embeddings(items)[0].clone()
    features.clear()
    monkeypatch.setattr(runner_mod, "MAX_PATCHES", 2 * 10 * 12)   # two of the four groups a pass
    assert [p[2] for p in runner_mod._pieces(items[0])] == [(2, 10, 12), (2, 10, 12)]
    torch.testing.assert_close(features.embeddings(items)[0], whole, atol=1e-5, rtol=1e-5)


def test_bad_videos_are_refused(qwen2):
    """Frames of different sizes, a float array, an empty list, a bad frame rate, a video token without a video,
    more videos than placeholders or than the limit, and a video for a model that takes none: clear errors."""
    path = qwen2[0]
    llm = LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off",
              limit_mm_per_prompt={"image": 2, "video": 1})
    clip = _video(50)
    cases = [
        ({"video": [clip[0], clip[1][:20]]}, f"x {VIDEO}", "frames have one size"),
        ({"video": clip.astype("float32")}, f"x {VIDEO}", r"\[frames, H, W, 3\] uint8"),
        ({"video": []}, f"x {VIDEO}", "a video is a list of frames"),
        ({"video": (clip, {"fps": 0})}, f"x {VIDEO}", "fps must be a positive number"),
        ({"video": (clip, {"fps": 1e-30})}, f"x {VIDEO}", "fps must be a positive number"),
        ({"video": np.zeros((2000, 8, 8, 3), np.uint8)}, f"x {VIDEO}", "2000 frames, at most 1024"),
        ({"video": clip}, f"x {VIDEO} {VIDEO}", r"names 2 video\(s\)"),
        ({"video": [clip, clip]}, f"x {VIDEO} {VIDEO}", "2 videos, at most 1"),
        ({"audio": clip}, "x", "takes images and videos only"),
    ]
    for data, prompt, match in cases:
        with pytest.raises(RequestRejectedError, match=match):
            llm.generate({"prompt": prompt, "multi_modal_data": data}, _greedy())
    with pytest.raises(RequestRejectedError, match="video token .* but no video"):
        llm.generate(f"x {VIDEO}", _greedy())
    assert llm.generate({"prompt": f"x {VIDEO}", "multi_modal_data": {"video": clip}}, _greedy(2))[0].outputs


def _mp4(frames: np.ndarray, fps: int = 8) -> bytes:
    """``frames`` encoded as an MPEG-4 file (PyAV)."""
    av = pytest.importorskip("av")
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def test_video_files_in_chat_and_the_server(qwen25):
    """A video file (MPEG-4, 12 frames at 8 a second) as a ``video_url`` data URL: read 2 frames a second (3 frames,
    at 2 a second), in ``LLM.chat`` and in ``POST /v1/chat/completions`` alike, and a ``video`` part with frames in
    ``LLM.chat``. The replies equal transformers' on the frames read (its rotary time positions at 2 frames a
    second); the server's usage and ``/tokenize`` count the video's positions."""
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app
    from plinth.multimodal.video import decode_video

    path, model, processor, _ = qwen25
    data = _mp4(_video(60, frames=12, size=(32, 48)))
    read = decode_video(data)
    assert read.frames.shape == (3, 32, 48, 3) and read.fps == pytest.approx(2.0)
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                             {"type": "video_url", "video_url": {"url": url}},
                                             {"type": "text", "text": "Paris is"}]}]
    llm = LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off")
    out = llm.chat(messages, _greedy())[0]
    _check(out, model, processor, [], videos=[(read.frames, read.fps)])
    clip = _video(61)
    framed = llm.chat([{"role": "user", "content": [{"type": "video", "video": clip}]}], _greedy())[0]
    _check(framed, model, processor, [], videos=[(clip, None)])
    llm.close()
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(path), dtype="float32", block_size=4, selection="off",
                                                platform="cpu", served_model_name="qwen"))
    with TestClient(build_app(AsyncLLMEngine(engine))) as http:
        r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0,
                                                    "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == out.outputs[0].text
        assert r.json()["usage"]["prompt_tokens"] == len(out.prompt_token_ids)
        r = http.post("/tokenize", json={"messages": messages})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == out.prompt_token_ids
        bad = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}]
        r = http.post("/v1/chat/completions", json={"messages": bad, "max_tokens": 2})
        assert r.status_code == 400 and "cannot be read as a video" in r.text, r.text
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": "data:image/png;base64,AAAA"}}]}], "max_tokens": 2})
        assert r.status_code == 400 and "not a video" in r.text, r.text


def _reference_rope_index(ids: list[int], video_token: int, grid: tuple[int, int, int], seconds: float,
                          rate: float, merge: int = 2) -> torch.Tensor:
    """The Qwen2.5-VL reference code's positions of a prompt with one video (as its authors wrote ``get_rope_index``,
    transformers before 5.3 and vLLM keep it): frame group ``i`` at ``i * seconds * rate`` (float32, truncated), the
    text after the video at one past its largest position."""
    start = ids.index(video_token)
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    before = torch.arange(start).view(1, -1).expand(3, -1)
    times = (torch.arange(t).view(-1, 1).expand(-1, h * w) * torch.tensor(seconds, dtype=torch.float32)
             * rate).long().flatten()
    rows = torch.arange(h).view(1, -1, 1).expand(t, -1, w).flatten()
    cols = torch.arange(w).view(1, 1, -1).expand(t, h, -1).flatten()
    video = torch.stack([times, rows, cols]) + start
    after = torch.arange(len(ids) - start - t * h * w).view(1, -1).expand(3, -1) + video.max() + 1
    return torch.cat([before, video, after], dim=1)


def test_text_after_a_video_resumes_past_its_times():
    """A Qwen2.5-VL video whose time positions run past its rows and columns (3 groups at 2 positions a second of 1 s
    each: times 0, 2, 4 over a 2x2 grid): its positions, and the text after it at one past the largest (5), as the
    reference code computes them (transformers 5.3+ resumes at the rows' count, 2: its issue 45381)."""
    ids = [7, 8, 100] * 1 + [99] * 12 + [9, 10]
    spans = [(3, 12, (3, 4, 4), (1.0, 2.0))]
    rope, (rows,) = layout(spans, 2)
    want = _reference_rope_index(ids[:2] + [0] + [99] * 12 + [9, 10], 99, (3, 4, 4), 1.0, 2.0)
    got = np.stack([np.arange(len(ids)) + rope.shifts(0, len(ids))] * 3)
    got[:, 3:15] = rows.T
    assert got.tolist() == want.tolist()
    assert want[:, 15].tolist() == [5 + 3] * 3   # the video's largest position (4 + 3) plus one


def test_video_keys_and_settings(qwen25):
    """The same frames at another frame rate sit at other rotary positions: another cache key, so the prefix cache
    does not reuse the first one's blocks (the second equals transformers'); a request's ``mm_processor_kwargs`` go
    on top of the engine's (an image setting keeps the engine's video bounds)."""
    path, model, processor, _ = qwen25
    llm = LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off", enable_prefix_caching=True,
              mm_processor_kwargs={"video_max_pixels": 256})
    clip = _video(70)
    prompt = f"Watch {VIDEO} now"
    llm.generate({"prompt": prompt, "multi_modal_data": {"video": (clip, {"fps": 4.0})}}, _greedy())
    again = llm.generate({"prompt": prompt, "multi_modal_data": {"video": clip}}, _greedy())[0]
    from plinth.multimodal import video as v

    support = llm.llm_engine.images
    small = v.video_settings(model.config, None, {"video_min_pixels": VIDEO_PROCESSOR["size"]["shortest_edge"],
                                                  "video_max_pixels": 256})
    length = v.length_of(small, v.Video(clip))
    assert support.video.max_pixels == 256 and length < v.length_of(support.video.__class__(
        **{**vars(small), "max_pixels": 8 * 8 * 80}), v.Video(clip))
    assert again.prompt_token_ids.count(model.config.video_token_id) == length
    _check_with(again, model, processor, clip, small)
    assert support.prepare({"video": clip}, {"do_normalize": True}).lengths == (length,)


def _check_with(out, model, processor, clip, cfg) -> None:
    """``_check`` for one video made with the video settings ``cfg``."""
    from plinth.multimodal import video as v

    patches, grid = v.patches(cfg, v.Video(clip))
    ids = torch.tensor([out.prompt_token_ids])
    with torch.no_grad():
        gen = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pixel_values_videos=patches,
                             video_grid_thw=torch.tensor([grid]),
                             second_per_grid_ts=torch.tensor([cfg.temporal / v.DEFAULT_FPS], dtype=torch.float32),
                             mm_token_type_ids=2 * (ids == model.config.video_token_id).int())
    assert out.outputs[0].token_ids == gen.sequences[0, ids.shape[1]:].tolist()


def _encoded(fmt: str, codec: str, size: tuple[int, int], frames: int = 12, fps: int = 8) -> bytes:
    """``frames`` plain frames of ``size`` (H, W) at ``fps`` a second, in ``fmt`` (PyAV)."""
    av = pytest.importorskip("av")
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[1], size[0], "yuv420p"
        for i in range(frames):
            frame = np.full((*size, 3), 20 * i % 256, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def test_video_file_decoding():
    """Files read at 2 frames a second: MP4, MPEG-TS and a raw H.264 stream (no timestamps: its frame rate counts);
    a stream whose frames change size mid-way, and bytes that are no video, are refused clearly."""
    from plinth.multimodal.video import decode_video

    for fmt, codec in (("mp4", "mpeg4"), ("mpegts", "mpeg2video"), ("h264", "libx264")):
        video = decode_video(_encoded(fmt, codec, (32, 48)))   # 1.5 s at 8 a second
        assert video.frames.shape == (3, 32, 48, 3) and video.fps == pytest.approx(2.0), fmt
    joined = _encoded("h264", "libx264", (32, 48)) + _encoded("h264", "libx264", (48, 64))
    with pytest.raises(RequestRejectedError, match="frames change size"):
        decode_video(joined)
    with pytest.raises(RequestRejectedError, match="cannot be read as a video"):
        decode_video(b"\x00" * 64)


def test_limit_mm_per_prompt_forms():
    """``limit_mm_per_prompt`` keeps the counts given (``null``: the default) and stays valid when the model config is
    copied again (a draft model's, bitsandbytes'); other kinds and counts are refused."""
    import dataclasses

    from plinth.config import ConfigError, EngineConfig

    for given, kept in (({"image": 2}, {"image": 2}), ('{"video": 1, "image": null}', {"video": 1}), (None, None)):
        model = EngineConfig.from_kwargs(model="x", limit_mm_per_prompt=given).model
        assert model.limit_mm_per_prompt == kept
        assert dataclasses.replace(model).limit_mm_per_prompt == kept
    for bad in ({"audio": 1}, {"video": -1}, {"image": True}, [1]):
        with pytest.raises(ConfigError, match="limit_mm_per_prompt"):
            EngineConfig.from_kwargs(model="x", limit_mm_per_prompt=bad)


def test_video_settings_files(tmp_path):
    """The video processor's settings come from where transformers looks, in its order: ``processor_config.json``'s
    ``video_processor``, ``video_preprocessor_config.json``, the image processor's ``preprocessor_config.json``
    (older checkpoints); none: the Qwen2-VL video processor's defaults. Patch sizes other than the tower's are
    refused."""
    from plinth.errors import ModelLoadError
    from plinth.multimodal import video as v

    cfg = transformers.Qwen2VLConfig(vision_config=dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2))
    assert (v.video_settings(cfg, str(tmp_path)).min_pixels, v.video_settings(cfg, str(tmp_path)).max_pixels) == (
        v.DEFAULT_MIN_PIXELS, v.DEFAULT_MAX_PIXELS)
    files = [("preprocessor_config.json", {"min_pixels": 3136, "max_pixels": 12845056}),
             ("video_preprocessor_config.json", {"size": {"shortest_edge": 1000, "longest_edge": 2000}}),
             ("processor_config.json", {"video_processor": {"min_pixels": 10, "max_pixels": 20}})]
    for (name, data), want in zip(files, [(3136, 12845056), (1000, 2000), (10, 20)], strict=True):
        (tmp_path / name).write_text(json.dumps(data))
        got = v.video_settings(cfg, str(tmp_path))
        assert (got.min_pixels, got.max_pixels) == want
    (tmp_path / "processor_config.json").write_text(json.dumps({"video_processor": {"patch_size": 16}}))
    with pytest.raises(ModelLoadError, match="not the vision tower's"):
        v.video_settings(cfg, str(tmp_path))
