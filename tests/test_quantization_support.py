"""Helpers shared by the quantization tests (this module holds no tests).

A quantized checkpoint is compared with transformers running the *dequantized* weights: every
linear weight of the original tiny model is replaced by what the quantized tensors decode to, and
both models see the same prompts. Logits must agree closely (the kernels compute the same product
in another order) and greedy continuations must agree at most positions.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from paged_driver import PagedDriver
from safetensors.torch import load_file, save_file

from plinth.attention_backends.torch_sdpa import TorchSDPABackend
from plinth.config import EngineConfig
from plinth.model_registry.interface import ModelContext
from plinth.model_registry.loader import load_model, resolve_model_source
from plinth.quantization.resolve import resolve_quantization

PROMPTS = [[5, 17, 42, 9, 100, 23, 7], [250, 3, 3, 61, 88], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
LINEAR = (".q_proj.", ".k_proj.", ".v_proj.", ".o_proj.", ".gate_proj.", ".up_proj.", ".down_proj.")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from a second thread, and lose much when the cores are busy."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def is_linear(name: str) -> bool:
    return name.endswith(".weight") and any(p in name for p in LINEAR)


def float_state(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def write_checkpoint(base_dir: Path, out_dir: Path, tensors: dict[str, torch.Tensor],
                     quantization_config: dict | None) -> Path:
    """A copy of ``base_dir`` (config, tokenizer) with ``tensors`` as its weights."""
    shutil.copytree(base_dir, out_dir)
    (out_dir / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"))
    config = json.loads((out_dir / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


def load_plinth(path: Path | str, quantization: str | None = None, *, gemm_kernel: str | None = None,
                dtype: str = "float32", tp: tuple[int, int] = (0, 1), quantize_lm_head: bool = False):
    """A plinth model (torch_sdpa attention, CPU) with the quantization the engine would resolve."""
    config = EngineConfig.from_kwargs(model=str(path), quantization=quantization, dtype=dtype,
                                      gemm_kernel=gemm_kernel, selection="off", quantize_lm_head=quantize_lm_head)
    source = resolve_model_source(config.model)
    torch_dtype = getattr(torch, dtype)
    device = torch.device("cpu")
    method = resolve_quantization(config, source, None, torch_dtype, device, tp_size=tp[1])
    backend = TorchSDPABackend()
    ctx = ModelContext(hf_config=source.hf_config, dtype=torch_dtype, device=device, attention_backend=backend,
                       block_size=4, quant_method=method, tp_rank=tp[0], tp_size=tp[1])
    return load_model(source, ctx), backend, method


def plinth_logits_and_greedy(model, backend, new_tokens: int = 16) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefill logits ``[len, vocab]`` per prompt (one sequence at a time) and batched greedy tokens."""
    logits = []
    for i, prompt in enumerate(PROMPTS):
        driver = PagedDriver(model, backend, block_size=4)
        driver.add(i, prompt)
        rows = [driver.step({i: 1})[i] for _ in prompt]  # token by token: every position's logits
        logits.append(torch.stack(rows).float())
    driver = PagedDriver(model, backend, block_size=4)
    generated, _ = driver.generate_greedy(PROMPTS, new_tokens)
    return logits, generated


def reference_model(base_dir: Path, dequantized: dict[str, torch.Tensor]) -> transformers.PreTrainedModel:
    """transformers on the original checkpoint with its linear weights replaced by ``dequantized``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    state = model.state_dict()
    missing = [n for n in state if is_linear(n) and n not in dequantized]
    assert not missing, missing
    with torch.no_grad():
        for name, value in dequantized.items():
            state[name].copy_(value)
    return model


@torch.no_grad()
def reference_logits_and_greedy(model, new_tokens: int = 16) -> tuple[list[torch.Tensor], list[list[int]]]:
    logits = [model(torch.tensor([p])).logits[0].float() for p in PROMPTS]
    generated = []
    for p in PROMPTS:
        ids = list(p)
        for _ in range(new_tokens):  # plain greedy, no stop token (the plinth driver has none either)
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        generated.append(ids[len(p):])
    return logits, generated


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of positions where two greedy continuations agree, up to the first divergence each."""
    same = total = 0
    for x, y in zip(a, b, strict=True):
        total += len(y)
        for u, v in zip(x, y, strict=False):
            if u != v:
                break
            same += 1
    return same / total


def compare(plinth_model, backend, ref_model, *, atol: float, min_agreement: float,
            new_tokens: int = 16) -> tuple[float, float]:
    """Assert logits within ``atol`` and greedy agreement; returns (max logit error, agreement)."""
    ours_logits, ours_tokens = plinth_logits_and_greedy(plinth_model, backend, new_tokens)
    ref_logits, ref_tokens = reference_logits_and_greedy(ref_model, new_tokens)
    err = max((a - b).abs().max().item() for a, b in zip(ours_logits, ref_logits, strict=True))
    scale = max(b.abs().max().item() for b in ref_logits)
    agree = agreement(ours_tokens, ref_tokens)
    assert err <= atol, f"max logit error {err:.3g} > {atol} (logits up to {scale:.3g})"
    assert agree >= min_agreement, f"greedy agreement {agree:.2f} < {min_agreement}: {ours_tokens} vs {ref_tokens}"
    return err, agree


def dequantized_linears(state: dict[str, torch.Tensor], fn: Callable[[str, torch.Tensor], torch.Tensor]
                        ) -> dict[str, torch.Tensor]:
    """``{name: fn(name, weight)}`` for every linear weight of a float state dict."""
    return {n: fn(n, w) for n, w in state.items() if is_linear(n)}
