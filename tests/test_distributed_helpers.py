"""Helpers of the distributed tests (no tests here): small random checkpoints of each native family,
a greedy run through an engine."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import transformers

from plinth import SamplingParams
from plinth.hookspecs import hookimpl
from plinth.model_registry.models.llama import LlamaForCausalLM

COMMON = dict(vocab_size=307, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)

# family -> (config class, model class, overrides)
FAMILIES = {
    # GQA with one KV head: under TP=2 each rank holds a replica of it
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=1)),
    # q/k/v biases and tied embeddings (the last pipeline stage holds the tied matrix as its LM head)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    # per-head q/k RMSNorm, explicit head_dim
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24)),
    # mixture of experts (each rank holds half of every expert's intermediate features)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    # dense and MoE layers mixed: under TP a dense layer leaves its MLP's reduction to the next layer's norm,
    # an MoE layer reduces its own output
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2,
                                                                moe_intermediate_size=32, mlp_only_layers=[0, 2],
                                                                head_dim=16)),
    # norms on each block's output (the all-reduces stay in the projections), a sliding layer with its own RoPE
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, sliding_window=6, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # fused q/k/v and gate/up checkpoint tensors, split into the shards of each rank as they load
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # block outputs scaled before the residual add: under TP the partial sums are scaled, then reduced in the norm
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(embedding_multiplier=3.0, attention_multiplier=0.2,
                                                            residual_multiplier=0.6, logits_scaling=2.0)),
    # a shared expert (row-parallel, reduced in its projection) gated by a replicated sigmoid, beside the experts
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        mlp_only_layers=[1])),
    # stacked checkpoint experts split per expert and per rank, a shared MLP, Granite's multipliers
    "granite_moe_shared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48, residual_multiplier=0.6,
        embedding_multiplier=3.0)),
    # sinks split with the heads, biased experts split with their features (rank 0 adds the down bias), a
    # replicated biased router, sliding and full layers
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # latent attention: query and key/value expansions split with the heads, latent projections replicated, the
    # one-head latent cache on every rank; grouped sigmoid routing, shared experts, a dense first layer
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=4,
        topk_group=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=12)),
    # DeepSeek-V3's experts behind Llama-style attention with per-head q/k norms and half-rotary heads
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=4, topk_group=2,
        first_k_dense_replace=1, use_qk_norm=True, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    # RoPE over adjacent pairs (regrouped per head, so each rank's heads rotate alike), ERNIE's corrected routing
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", dict(
        head_dim=16, moe_num_experts=8, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1,
        moe_layer_start_index=1)),
    # Cohere's parallel block (attention and MLP partial sums reduced together), per-head q/k LayerNorm weights split
    # with the heads and, for the one key/value head, replicated with it
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(num_key_value_heads=1, use_qk_norm=True, logit_scale=0.5,
                                                         bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    # StableLM 2 12B's shape: the parallel block, per-head q/k LayerNorms loaded one head at a time into each rank's
    # rows (the one key/value head's norm replicated with it), LayerNorm biases, partial RoPE
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(num_key_value_heads=1, use_parallel_residual=True,
                                                               qk_layernorm=True, use_qkv_bias=True)),
    # Phi-2: the parallel block with biased output projections (each reduced on its own), an ungated MLP whose fc2 bias
    # rank 0 adds, an LM head bias over the gathered vocabulary
    "phi": ("PhiConfig", "PhiForCausalLM", dict(qk_layernorm=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)),
}

# token-id prompts: different lengths (chunked prefill over several steps), one repeated (prefix cache)
PROMPTS = [
    [5, 17, 33, 250, 8, 91, 13, 77, 120, 4, 66, 200, 19, 3, 150, 42, 11, 9, 301, 88, 27],
    [44, 2, 198, 71],
    [5, 17, 33, 250, 8, 91, 13, 77, 120, 4, 66, 200, 19, 3, 150, 42, 11, 9, 301, 88, 27],
    [9, 9, 100, 31, 7, 260, 55, 1, 14],
]
NEW_TOKENS = 10
# small batches: prompts are chunked and mixed with decodes, several sequences per step
ENGINE_KW = dict(dtype="float32", block_size=4, max_num_batched_tokens=16, attention_backend="torch_sdpa",
                 selection="off", cpu_kv_cache_bytes=16 << 20)


def save_family(family: str, path: Path, seed: int = 0) -> Path:
    """A random model of ``family`` with large weights, saved as safetensors: greedy choices are
    decisive (no near-ties) and vary from token to token (small random models repeat one token)."""
    config_cls, model_cls, overrides = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08 if "embed" in name else 0.2)
            elif name.endswith((".sinks", ".bias")):   # zero at init: values that a misplaced shard would change
                p.normal_(0.0, 1.0 if name.endswith(".sinks") else 0.2)
    model.save_pretrained(path)
    return path


def greedy(prompt_logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=prompt_logprobs)


Result = dict[str, tuple[list[int], list[dict[int, float]]]]


# a seeded random request: its tokens do not depend on the batch it runs in
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)


def run_greedy(engine, prompts=PROMPTS, max_steps: int = 200) -> Result:
    """Greedy tokens of each prompt (with the first prompt's prompt logprobs), plus the tokens and
    logprobs of a seeded random sample of the last prompt (``"seeded"``), from an LLMEngine."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(prompt_logprobs=1 if i == 0 else None))
    engine.add_request("seeded", prompts[-1], SEEDED)
    done: Result = {}
    for _ in range(max_steps):
        for out in engine.step():
            if out.finished:
                positions = out.prompt_logprobs if out.request_id != "seeded" else out.outputs[0].logprobs
                lps = [{t: lp.logprob for t, lp in pos.items()} for pos in positions or [] if pos]
                done[out.request_id] = (out.outputs[0].token_ids, lps)
        if not engine.has_unfinished_requests():
            return done
    raise AssertionError("the engine did not finish within the step bound")


def process_gone(pid: int) -> bool:
    """The process has exited (reaped, or a zombie waiting for a parent that is not us)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Wait up to ``timeout_s`` for ``pids`` to exit; returns those still running."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if not process_gone(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [p for p in pids if not process_gone(p)]


def children(pid: int, marker: str) -> list[int]:
    """Running processes whose parent is ``pid`` and whose command line contains ``marker``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and marker in cmdline and not process_gone(int(entry.name)):
            out.append(int(entry.name))
    return sorted(out)


def warm_up_rank(rank: int, port: int, fingerprints: list[list[list[int]]], out_dir: str) -> None:
    """One TP rank of a 2-rank gloo group (a spawned process): run ``tp_warm_up`` with each of its
    fingerprints in turn and write, one line per call, ``ok`` or the error."""
    import datetime
    import os

    import torch.distributed as dist

    from plinth.distributed.communication import tp_warm_up
    from plinth.distributed.parallel_state import ParallelLayout, destroy_parallel_state, init_parallel_state

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=datetime.timedelta(seconds=60))
    init_parallel_state(ParallelLayout(rank, 2, 1), "gloo", store, 60.0)
    lines = []
    try:
        for fingerprint in fingerprints[rank]:
            try:
                tp_warm_up(torch.device("cpu"), torch.bfloat16, fingerprint)
                lines.append("ok")
            except RuntimeError as exc:
                lines.append(str(exc))
    finally:
        destroy_parallel_state()
    (Path(out_dir) / f"rank{rank}").write_text("\n".join(lines))



class LastTokenLlama(LlamaForCausalLM):
    """Llama whose every logit row prefers the vocabulary's last token: a visibly different model, registered
    with ``ModelRegistry.register_model`` in the worker-process tests (a module-level class pickles by name)."""

    def compute_logits(self, hidden):
        logits = super().compute_logits(hidden)
        if logits is not None and logits.numel():
            logits[..., -1] = logits.max() + 100.0
        return logits


# The module is also a plugin, registered in-process (``register_module``) by a test: worker processes import it
# by name and register it too.
PLINTH_PLUGIN_API = "1.0"


@hookimpl
def plinth_models():
    return {"LlamaForCausalLM": "test_distributed_helpers:LastTokenLlama"}
