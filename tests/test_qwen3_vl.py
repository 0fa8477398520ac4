"""Qwen3-VL and Qwen3-VL-MoE: tiny random checkpoints written by transformers, run by plinth (the language model as
Qwen3 / Qwen3-MoE, the vision tower with DeepStack) and by transformers' ``Qwen3VLForConditionalGeneration`` /
``Qwen3VLMoeForConditionalGeneration`` on the same prompts and images (a text prompt's multimodal RoPE positions are
plain ones, so the interleaved sections change nothing there)."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import decisive_weights, make_tokenizer, output_matches_transformers
from safetensors.torch import load_file, save_file

import plinth

TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                             "mrope_interleaved": True})
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              deepstack_visual_indexes=[0])


def _save(path, moe: bool, tie: bool = False):
    tok = make_tokenizer()
    text = dict(TEXT, vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    if moe:   # 2 x 24 gate/up rows != 64 wide: the stacked layouts tell apart
        cfg = transformers.Qwen3VLMoeConfig(text_config=dict(text, num_experts=4, num_experts_per_tok=2,
                                                             moe_intermediate_size=24, decoder_sparse_step=1),
                                            vision_config=VISION, tie_word_embeddings=tie)
        model = transformers.Qwen3VLMoeForConditionalGeneration(cfg)
    else:
        cfg = transformers.Qwen3VLConfig(text_config=text, vision_config=VISION, tie_word_embeddings=tie)
        model = transformers.Qwen3VLForConditionalGeneration(cfg)
    model = decisive_weights(model.eval())
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model


def _reference(model, prompt: list[int], steps: int = 8) -> tuple[list[int], list[torch.Tensor]]:
    with torch.no_grad():
        gen = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
    return gen.sequences[0, len(prompt):].tolist(), [torch.log_softmax(s[0].float(), -1) for s in gen.scores]


def _check(path, model) -> None:
    llm = plinth.LLM(str(path), dtype="float32", platform="cpu", block_size=4, selection="off", max_model_len=128)
    prompts = [[5, 9, 14, 3, 27, 40, 8], list(range(10, 31))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        plinth.SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True),
                        use_tqdm=False)
    for out, prompt in zip(outs, prompts, strict=True):
        tokens, logprobs = _reference(model, prompt)
        assert out.outputs[0].token_ids == tokens
        for step, ref in zip(out.outputs[0].logprobs, logprobs, strict=True):
            for tid, lp in step.items():
                assert abs(lp.logprob - ref[tid].item()) < 2e-4
    llm.close()


@pytest.mark.parametrize("moe,tie", [(False, False), (False, True), (True, False)], ids=["dense", "tied", "moe"])
def test_language_model_equals_transformers(moe, tie, tmp_path):
    """Greedy tokens and log-probabilities equal transformers' for text prompts; the vision tower's tensors are
    skipped; the MoE experts load from the stacked tensors transformers writes (``[E, 2I, H]``, ``[E, H, I]``)."""
    model = _save(tmp_path, moe, tie)
    _check(tmp_path, model)


def test_released_expert_layout(tmp_path):
    """Qwen3-VL-MoE as released: the stacked experts with their inputs first (``gate_up_proj`` ``[E, H, 2I]``,
    ``down_proj`` ``[E, I, H]``), told apart by the model width: the same tokens."""
    model = _save(tmp_path, moe=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    flipped = {k: (v.transpose(1, 2).contiguous() if ".mlp.experts." in k else v) for k, v in tensors.items()}
    assert flipped["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 48)
    save_file(flipped, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    _check(tmp_path, model)


IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def _save_with_images(path, moe: bool, num_position_embeddings: int = 16, corpus: list[str] | None = None):
    """A Qwen3-VL checkpoint whose image side runs: the vision tokens, 4-pixel patches in 2x2 merge groups, a 4x4
    position table, DeepStack mergers after vision blocks 0 and 1 (added after language layers 0 and 1), the
    interleaved multimodal RoPE (``corpus``: the tokenizer's training text)."""
    tok = make_tokenizer(corpus=corpus)
    special = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    tok.add_special_tokens({"additional_special_tokens": special})
    start, pad, end, video = tok.convert_tokens_to_ids(special)
    text = dict(TEXT, num_hidden_layers=3, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    vision = dict(VISION, depth=2, deepstack_visual_indexes=[0, 1], num_position_embeddings=num_position_embeddings)
    common = dict(vision_config=vision, image_token_id=pad, vision_start_token_id=start, vision_end_token_id=end,
                  video_token_id=video)
    torch.manual_seed(1)
    if moe:
        cfg = transformers.Qwen3VLMoeConfig(text_config=dict(text, num_experts=4, num_experts_per_tok=2,
                                                             moe_intermediate_size=24, decoder_sparse_step=1),
                                            **common)
        model = transformers.Qwen3VLMoeForConditionalGeneration(cfg)
    else:
        model = transformers.Qwen3VLForConditionalGeneration(transformers.Qwen3VLConfig(text_config=text, **common))
    model = decisive_weights(model.eval())
    model.save_pretrained(path)
    tok.save_pretrained(path)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                         image_std=[0.5] * 3,
                                         size={"shortest_edge": 8 * 8 * 4, "longest_edge": 8 * 8 * 80})
    processor.save_pretrained(path)
    return model, processor


def _picture(seed: int, size=(40, 52)):
    from conftest import random_picture

    return random_picture(seed, size)


def _matches(out, model, processor, images, **kw) -> None:
    """``out`` equals transformers' ``generate`` on its prompt and ``images`` (as the processor makes them)."""
    extra = {}
    if images:
        px = processor(images=images, return_tensors="pt")
        extra = dict(pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"],
                     mm_token_type_ids=(torch.tensor([out.prompt_token_ids]) == model.config.image_token_id).int())
    output_matches_transformers(out, model, **kw, **extra)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_images_equal_transformers(moe, tmp_path):
    """Qwen3-VL with images: the vision tower (biased patch embedding, the position table resampled to each grid,
    2D rotary attention within each image), the merger and the DeepStack mergers, whose embeddings join the image
    positions' hidden states after the first language layers, and the interleaved multimodal RoPE. Two images of
    different sizes (one wider than the position table) in one prompt, prefilled in chunks of 16 tokens, beside a
    text prompt: greedy tokens and each step's log-probabilities equal transformers'."""
    model, processor = _save_with_images(tmp_path, moe)
    llm = plinth.LLM(str(tmp_path), dtype="float32", platform="cpu", block_size=4, selection="off",
                     max_num_batched_tokens=16, enable_chunked_prefill=True, max_model_len=256)
    a, b = _picture(1), _picture(2, (24, 72))
    params = plinth.SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    outs = llm.generate([{"prompt": f"A {IMAGE} then {IMAGE} end", "multi_modal_data": {"image": [a, b]}},
                         "plain text here"], params)
    for out, images in zip(outs, [[a, b], []], strict=True):
        _matches(out, model, processor, images)
    assert outs[0].prompt_token_ids.count(model.config.image_token_id) == 5 * 6 + 3 * 9
    llm.close()


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tensor_parallel", "pipeline_stages"])
def test_images_on_worker_processes(tp, pp, tmp_path):
    """Two tensor-parallel ranks (each encodes the images and adds the DeepStack embeddings to its whole residual
    stream) or two pipeline stages (the first, holding the DeepStack layers, encodes them; the second takes the
    image rows' rotary positions): the one-process engine's tokens."""
    from conftest import generate_on_tp_workers

    model, _ = _save_with_images(tmp_path, moe=False)
    prompts = [{"prompt": f"A {IMAGE} then {IMAGE} end", "multi_modal_data": {"image": [_picture(3), _picture(4)]}},
               {"prompt": f"{IMAGE} alone", "multi_modal_data": {"image": _picture(5, (32, 32))}}]
    params = plinth.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = plinth.LLM(str(tmp_path), dtype="float32", platform="cpu", block_size=4, selection="off")
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.close()
    got = generate_on_tp_workers(tmp_path, prompts, params, size=tp, pp=pp)
    assert [o.outputs[0].token_ids for o in got] == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_images_equal_transformers(tmp_path):
    """On a GPU (the Triton attention kernels through the image rows, CUDA graphs for the decode steps): float32 tokens
    of two image prompts and a text prompt in one batch equal transformers' on the CPU."""
    model, processor = _save_with_images(tmp_path, moe=False)
    llm = plinth.LLM(str(tmp_path), dtype="float32", platform="cuda", block_size=16, gpu_memory_utilization=0.3)
    a, b = _picture(8), _picture(9, (64, 40))
    prompts = [{"prompt": f"{IMAGE} Paris {IMAGE}", "multi_modal_data": {"image": [a, b]}}, "Large language models",
               {"prompt": f"The quick {IMAGE} brown fox", "multi_modal_data": {"image": b}}]
    params = plinth.SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert llm.llm_engine.runner.graphs is not None
    for out, images in zip(outs, [[a, b], [], [b]], strict=True):
        _matches(out, model, processor, images, steps=8, tol=1e-3)


def test_encoder_profile_and_position_table(tmp_path):
    """Start-up's encoder pass is sized by the larger of an image and a video's frame group (Qwen3-VL's video budget
    bounds all the sampled frames together); a position table whose count is no square is read by its first side x side rows, as
    transformers reads it: the tokens equal transformers'."""
    import json

    from plinth.multimodal.images import max_patches

    model, processor = _save_with_images(tmp_path, moe=False)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"size": {"shortest_edge": 4096,
                                                                                   "longest_edge": 25165824}}))
    # (a frame group: a video has two frames or more, so at most half the frames' shared budget)
    assert max_patches(model.config, str(tmp_path), None) == 25165824 // 2 // 16
    model, processor = _save_with_images(tmp_path / "odd", moe=False, num_position_embeddings=20)
    llm = plinth.LLM(str(tmp_path / "odd"), dtype="float32", platform="cpu", block_size=4, selection="off")
    img = _picture(12)
    out = llm.generate({"prompt": f"See {IMAGE}", "multi_modal_data": {"image": img}},
                       plinth.SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True))[0]
    _matches(out, model, processor, [img])
    llm.close()


VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
#: the test checkpoint's video processor: 4-pixel patches, the pixel bounds over all sampled frames together
VIDEO_CONFIG = {"size": {"shortest_edge": 8 * 8 * 4, "longest_edge": 8 * 8 * 60 * 4}, "patch_size": 4,
                "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                "fps": 2, "min_frames": 4, "max_frames": 16}


def _clip(seed: int, frames: int = 10, size=(24, 40)):
    import numpy as np

    return (np.random.default_rng(seed).random((frames, *size, 3)) * 255).astype("uint8")


def _video_prompt(text: str, stamps: list[float], per_group: int) -> str:
    """Qwen3-VL's processor's rule: the video's wrapper becomes its frame groups, each after its time."""
    groups = "".join(f"<{t:.1f} seconds><|vision_start|>" + "<|video_pad|>" * per_group + "<|vision_end|>"
                     for t in stamps)
    return text.replace(VIDEO, groups)


def _video_reference(out, model, videos, settings) -> None:
    """``out`` equals transformers' ``generate`` on its prompt and the videos' patches (as plinth makes them; they
    equal transformers' video processor's, see test_video_patches_equal_transformers), ``video_grid_thw`` and the
    token types (video: 2)."""
    from plinth.multimodal import video as v

    ids = torch.tensor([out.prompt_token_ids])
    made = [v.patches(settings, clip) for clip in videos]
    # (5e-4: float32 sums in another order on machines of more threads; 2e-4 holds on two cores)
    output_matches_transformers(out, model, tol=5e-4, pixel_values_videos=torch.cat([p for p, _ in made]),
                                video_grid_thw=torch.tensor([g for _, g in made]),
                                mm_token_type_ids=(ids == model.config.video_token_id).int() * 2)


def test_videos_equal_transformers(tmp_path):
    """Qwen3-VL videos: frames sampled at 2 a second of the video's rate (at least 4), resized within the pixel budget
    of all the sampled frames, each frame group after its time as text (``<0.3 seconds>``, the mean of its frames'
    times), encoded and placed as an image: the prompt is Qwen3-VL's processor's rule and the greedy tokens and
    log-probabilities equal transformers' on the same patches, for a video beside an image in chunks of 16 tokens;
    a prompt already laid out is taken as it is, and chat and ``/tokenize`` lay the video out alike."""
    import json

    from plinth.multimodal import video as v

    model, processor = _save_with_images(tmp_path, moe=False)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIG))
    llm = plinth.LLM(str(tmp_path), dtype="float32", platform="cpu", block_size=4, selection="off",
                     max_num_batched_tokens=16, enable_chunked_prefill=True, max_model_len=256)
    settings = llm.llm_engine.images.video
    assert settings.qwen3 and settings.min_frames == 4
    clip = _clip(1)
    video = v.Video(clip, 5.0)
    assert v.sampled(settings, video).tolist() == [0, 3, 6, 9]   # 10 frames at 5 a second: 4 frames at 2 a second
    stamps = v.stamps(settings, video)
    assert stamps == pytest.approx([0.3, 1.5])
    t, h, w = v.grid_of(settings, video)
    assert (t, h, w) == (2, 6, 10)
    params = plinth.SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    text = f"A clip:{VIDEO} then"
    out = llm.generate({"prompt": text, "multi_modal_data": {"video": (clip, {"fps": 5.0})}}, params)[0]
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert out.prompt_token_ids == tok(_video_prompt(text, stamps, h * w // 4))["input_ids"]
    _video_reference(out, model, [video], settings)
    again = llm.generate({"prompt_token_ids": out.prompt_token_ids,
                          "multi_modal_data": {"video": (clip, {"fps": 5.0})}}, params)[0]
    assert again.prompt_token_ids == out.prompt_token_ids
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    # a video (without a rate: 24 a second, so its 10 frames sample down to 4) after an image
    img, short = _picture(3), v.Video(_clip(2, 6, (32, 24)), None)
    both = llm.generate({"prompt": f"{IMAGE} and {VIDEO}", "multi_modal_data": {"image": img, "video": short.frames}},
                        params)[0]
    px = processor(images=[img], return_tensors="pt")
    made = v.patches(settings, short)
    ids = torch.tensor([both.prompt_token_ids])
    types = (ids == model.config.image_token_id).int() + (ids == model.config.video_token_id).int() * 2
    output_matches_transformers(both, model, tol=5e-4, pixel_values=px["pixel_values"],
                                image_grid_thw=px["image_grid_thw"],
                                pixel_values_videos=made[0], video_grid_thw=torch.tensor([made[1]]),
                                mm_token_type_ids=types)
    chat = llm.chat([{"role": "user", "content": [{"type": "video", "video": (clip, {"fps": 5.0})},
                                                  {"type": "text", "text": "Go"}]}], params)[0]
    assert chat.prompt_token_ids.count(model.config.video_token_id) == 2 * h * w // 4
    # (a template that reads strings gets the parts' texts a line apart)
    rendered = tok.apply_chat_template([{"role": "user", "content": f"{VIDEO}\nGo"}], tokenize=False,
                                       add_generation_prompt=True)
    assert chat.prompt_token_ids == tok(_video_prompt(rendered, stamps, h * w // 4))["input_ids"]
    llm.close()


def test_video_file_in_server_chat_and_tokenize(tmp_path):
    """A video file (MPEG-4, 16 frames at 8 a second: read at 2 a second, 4 frames) as a ``video_url`` part: the
    server's reply equals ``LLM.chat``'s, its usage counts the laid-out prompt, and ``/tokenize`` gives the same
    tokens without making the video's pixels."""
    pytest.importorskip("fastapi")
    import base64
    import json

    from starlette.testclient import TestClient
    from test_qwen_vl import _mp4

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine

    _save_with_images(tmp_path, moe=False)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIG))
    url = "data:video/mp4;base64," + base64.b64encode(_mp4(_clip(6, 16, (32, 48)))).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                             {"type": "video_url", "video_url": {"url": url}}]}]
    llm = plinth.LLM(str(tmp_path), dtype="float32", platform="cpu", block_size=4, selection="off")
    out = llm.chat(messages, plinth.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    llm.close()
    assert out.prompt_token_ids.count(llm.llm_engine.images.mm_config.vision_start_token_id) == 2   # 2 groups
    from plinth.entrypoints.openai.api_server import build_app

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(tmp_path), dtype="float32", block_size=4, selection="off",
                                                platform="cpu", served_model_name="qwen3"))
    with TestClient(build_app(AsyncLLMEngine(engine))) as http:
        r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5, "temperature": 0,
                                                    "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == out.outputs[0].text
        assert r.json()["usage"]["prompt_tokens"] == len(out.prompt_token_ids)
        r = http.post("/tokenize", json={"messages": messages})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == out.prompt_token_ids


def test_video_times_tokenized_with_the_text_before(tmp_path):
    """The first frame group's time is tokenized with the text before the video, as the processor's text is: with a
    tokenizer that merges " <" into one token, the prompt still equals the tokenizer's on the processor's text."""
    from conftest import CORPUS

    _save_with_images(tmp_path, moe=False, corpus=CORPUS + ["Look at <0.3 seconds> and <1.5 seconds> now"] * 40)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert tok.encode("at <0.3 seconds>") != tok.encode("at ") + tok.encode("<0.3 seconds>")   # (it merges)
    llm = plinth.LLM(str(tmp_path), dtype="float32", platform="cpu", block_size=4, selection="off")
    clip = _clip(4, 10)
    from plinth.multimodal import video as v

    settings = llm.llm_engine.images.video
    t, h, w = v.grid_of(settings, v.Video(clip, 5.0))
    text = f"Look at {VIDEO} and"
    out = llm.generate({"prompt": text, "multi_modal_data": {"video": (clip, {"fps": 5.0})}},
                       plinth.SamplingParams(max_tokens=1))[0]
    stamps = v.stamps(settings, v.Video(clip, 5.0))
    assert out.prompt_token_ids == tok(_video_prompt(text, stamps, h * w // 4))["input_ids"]
    llm.close()


def test_video_patches_equal_transformers(tmp_path):
    """Where torchvision is installed: a video's sampled frames, patches, grid and frame-group times equal
    transformers' ``Qwen3VLVideoProcessor``'s (which needs torchvision), and its prompt its ``Qwen3VLProcessor``'s."""
    pytest.importorskip("torchvision")
    import json

    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    from plinth.multimodal import video as v

    model, processor = _save_with_images(tmp_path, moe=False)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIG))
    settings = v.video_settings(model.config, str(tmp_path))
    theirs = Qwen3VLVideoProcessor(**VIDEO_CONFIG)
    for frames, fps, size in ((10, 5.0, (24, 40)), (31, 12.0, (50, 70)), (3, None, (17, 33)), (40, 30.0, (64, 48))):
        clip = _clip(frames, frames, size)
        meta = VideoMetadata(total_num_frames=frames, fps=fps, frames_indices=list(range(frames)))
        ref = theirs(videos=[clip], video_metadata=[meta], return_metadata=True, return_tensors="pt",
                     cap_pixels_per_frame=False)
        patches, grid = v.patches(settings, v.Video(clip, fps))
        assert list(grid) == ref["video_grid_thw"][0].tolist()
        torch.testing.assert_close(patches, ref["pixel_values_videos"], atol=2e-2, rtol=0)
        got = ref["video_metadata"][0]
        assert v.sampled(settings, v.Video(clip, fps)).tolist() == list(got.frames_indices)
    # the prompt: Qwen3VLProcessor's on the same text and video
    clip = _clip(5, 10)
    proc = transformers.Qwen3VLProcessor(image_processor=processor, video_processor=theirs,
                                         tokenizer=transformers.AutoTokenizer.from_pretrained(tmp_path))
    text = f"A clip: {VIDEO} then"
    ref = proc(text=text, videos=[clip], return_tensors="pt", cap_pixels_per_frame=False,
               video_metadata=[VideoMetadata(total_num_frames=10, fps=5.0, frames_indices=list(range(10)))])
    llm = plinth.LLM(str(tmp_path), dtype="float32", platform="cpu", block_size=4, selection="off")
    out = llm.generate({"prompt": text, "multi_modal_data": {"video": (clip, {"fps": 5.0})}},
                       plinth.SamplingParams(max_tokens=1))[0]
    assert out.prompt_token_ids == ref["input_ids"][0].tolist()
    llm.close()


def test_video_prompts_refused_or_counted_as_laid_out(tmp_path):
    """Video tokens that are neither one for each video nor the processor's layout are refused, counted in videos (a
    video's placeholder typed twice would otherwise split its frame groups); a bare video token (no vision start and
    end around it) is laid out as the processor lays it out, and the layout without pixels (what the server counts)
    equals the engine's prompt; a video longer than the context is refused before its patches are made."""
    import json

    from plinth.core.scheduler import RequestRejectedError
    from plinth.multimodal import video as v

    _save_with_images(tmp_path, moe=False)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIG))
    llm = plinth.LLM(str(tmp_path), dtype="float32", platform="cpu", block_size=4, selection="off",
                     max_model_len=64)
    clip = (_clip(1), {"fps": 5.0})
    params = plinth.SamplingParams(max_tokens=1)
    with pytest.raises(RequestRejectedError, match=r"names 2 video\(s\) .* has 1"):
        llm.generate({"prompt": f"first {VIDEO} second {VIDEO}", "multi_modal_data": {"video": clip}}, params)
    with pytest.raises(RequestRejectedError, match=r"names 0 video\(s\) .* has 1"):
        llm.generate({"prompt": "no video here", "multi_modal_data": {"video": clip}}, params)
    support = llm.llm_engine.images
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    video = v.Video(clip[0], 5.0)
    t, h, w = v.grid_of(support.video, video)
    for text in (f"a {VIDEO} b", "a <|video_pad|> b"):
        out = llm.generate({"prompt": text, "multi_modal_data": {"video": clip}}, params)[0]
        groups = "".join(f"<{s:.1f} seconds><|vision_start|>" + "<|video_pad|>" * (h * w // 4) + "<|vision_end|>"
                         for s in v.stamps(support.video, video))
        assert out.prompt_token_ids == tok(text.replace(VIDEO, "<|video_pad|>").replace("<|video_pad|>", groups))[
            "input_ids"]
        assert support.laid_out(tok(text)["input_ids"], [video]) == out.prompt_token_ids
    long_clip = (_clip(2, 40, (64, 64)), {"fps": 2.0})
    with pytest.raises(RequestRejectedError, match="fills 72 positions, more than the 64 a prompt may"):
        llm.generate({"prompt": f"a {VIDEO}", "multi_modal_data": {"video": long_clip}}, params)
    start = support.mm_config.vision_start_token_id
    llm.close()
    llm = plinth.LLM(str(tmp_path), dtype="float32", platform="cpu", block_size=4, selection="off")
    two = llm.generate({"prompt": "<|video_pad|><|video_pad|> both", "multi_modal_data": {"video": [clip, clip]}},
                       params)[0]   # (adjacent video tokens: one video each)
    assert two.prompt_token_ids.count(start) == 4
    llm.close()


def test_video_file_frames_sampled_as_transformers_reads_them(tmp_path):
    """A video file for Qwen3-VL: its frames picked from every frame of the file at its stated count and rate, as
    transformers reads files for the processor (30 frames at 10 a second: 6 frames at 2 a second, frames 0, 6, 12, 17,
    23, 29), the frames those of the file, and the frame groups' times transformers' (its processor's rule on those
    frame numbers)."""
    import io
    import json

    import numpy as np
    from test_qwen_vl import _mp4

    av = pytest.importorskip("av")

    from plinth.multimodal import video as v

    model, _ = _save_with_images(tmp_path, moe=False)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIG))
    settings = v.video_settings(model.config, str(tmp_path))
    data = _mp4(_clip(8, 30, (32, 48)), fps=10)
    read = v.decode_video(data, sample=v.file_sampler(settings))
    assert read.indices == (0, 6, 12, 17, 23, 29) and read.fps == pytest.approx(10.0)
    with av.open(io.BytesIO(data)) as container:
        every = [f.to_ndarray(format="rgb24") for f in container.decode(container.streams.video[0])]
    assert len(every) == 30
    assert np.array_equal(read.frames, np.stack([every[i] for i in read.indices]))
    want = transformers.Qwen3VLProcessor._calculate_timestamps(None, list(read.indices), 10.0, 2)
    assert v.stamps(settings, read) == pytest.approx(want)
    assert v.sampled(settings, read).tolist() == list(range(6))   # (sampled already)
    plain = v.decode_video(data)   # (Qwen2-VL: 2 frames a second as the file is read)
    assert plain.indices is None and len(plain.frames) == 6
    import dataclasses

    every_frame = v.decode_video(data, sample=v.file_sampler(dataclasses.replace(settings, sample_frames=False)))
    assert every_frame.indices == tuple(range(30))   # (do_sample_frames off: all of them, as transformers reads it)


def test_a_file_stating_billions_of_frames_is_refused_before_its_frame_list_is_made():
    """do_sample_frames off picks every frame the header states: a count of 10**12 is refused, not allocated."""
    import types

    from plinth.core.scheduler import RequestRejectedError
    from plinth.multimodal import video as v

    every = v.file_sampler(types.SimpleNamespace(qwen3=True, sample_frames=False))
    with pytest.raises(RequestRejectedError, match=f"1000000000000 frames, at most {v.MAX_FRAMES}"):
        v._picked(every(10**12, 30.0), "video")
    assert v._picked(every(3, 30.0), "video") == [0, 1, 2]


def test_video_file_stating_more_frames_than_it_has(monkeypatch):
    """A file whose frames end before the last one picked (it states more than it has) is picked again among the
    frames it has; the frames kept are bounded as they are decoded, before they are copied together."""
    import numpy as np
    from test_qwen_vl import _mp4

    from plinth.core.scheduler import RequestRejectedError
    from plinth.multimodal import video as v

    pytest.importorskip("av")
    data = _mp4(_clip(9, 30, (32, 48)), fps=10)
    counts = []

    def sample(total, fps):   # the first call as for a file stating four times its frames
        counts.append(total)
        n = total * 4 if len(counts) == 1 else total
        return np.linspace(0, n - 1, 6).round().astype(int)

    read = v.decode_video(data, sample=sample)
    assert counts == [30, 30] and read.indices == (0, 6, 12, 17, 23, 29)
    monkeypatch.setattr(v, "MAX_VIDEO_PIXELS", 3 * 32 * 48)
    with pytest.raises(RequestRejectedError, match="pixels in the frames kept"):
        v.decode_video(data, sample=lambda total, fps: np.arange(6))
