"""Qwen3-VL and Qwen3-VL-MoE checkpoints run their language model alone (text prompts): tiny random checkpoints
written by transformers, run by plinth as Qwen3 / Qwen3-MoE and by transformers' ``Qwen3VLForConditionalGeneration``
/ ``Qwen3VLMoeForConditionalGeneration`` on the same prompts (a text prompt's multimodal RoPE positions are plain
ones, so the interleaved sections change nothing)."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import decisive_weights, make_tokenizer
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


def test_images_are_refused_clearly(tmp_path):
    """Its image side is not run: an image is refused with a clear error, not ignored."""
    from PIL import Image

    from plinth.core.scheduler import RequestRejectedError

    _save(tmp_path, moe=False)
    llm = plinth.LLM(str(tmp_path), dtype="float32", platform="cpu", selection="off", max_model_len=64)
    with pytest.raises(RequestRejectedError, match="takes no image inputs"):
        llm.generate({"prompt": "a picture", "multi_modal_data": {"image": Image.new("RGB", (8, 8))}})
    llm.close()
