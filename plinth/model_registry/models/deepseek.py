"""DeepSeek-V2 and DeepSeek-V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``; also the models built on
them, e.g. DeepSeek-V2-Lite, Moonlight, Kimi K2): multi-head latent attention and a mixture of experts with
shared experts.

- Multi-head latent attention (MLA): each token's keys and values come from one compressed latent ``c``
  (``kv_lora_rank`` features, after ``kv_a_layernorm``) and one shared rotary key ``k_pe`` (``qk_rope_head_dim``);
  ``kv_b_proj`` expands ``c`` into each head's key (``qk_nope_head_dim``) and value (``v_head_dim``) parts. The
  paged cache holds only ``[c, k_pe]`` per token (one key/value head of ``kv_lora_rank + qk_rope_head_dim``
  features, for every head): the key expansion is folded into the query (``q_nope @ W_UK`` per head) and the
  value expansion applied to the attention output (``@ W_UV``), so attention runs as multi-query attention over
  the latents. Queries come from ``q_proj`` or, with ``q_lora_rank``, from ``q_b_proj(q_a_layernorm(q_a_proj(x)))``.
  The rotary parts are interleaved pairs in the checkpoint (V2 always, V3 with ``rope_interleave``); the
  softmax scale is ``(qk_nope + qk_rope) ** -0.5``, times YaRN's ``mscale_all_dim`` correction squared.
- Experts: the first ``first_k_dense_replace`` layers are dense; the rest route each token to
  ``num_experts_per_tok`` of ``n_routed_experts`` and add ``n_shared_experts`` shared ones every token runs.
  V2: softmax scores, top-k over all experts (``topk_method = "greedy"``) or within the ``topk_group`` groups
  whose best expert scores highest (``"group_limited_greedy"``), never renormalised (as transformers' V2 router;
  DeepSeek's own code renormalised instead of scaling when ``norm_topk_prob`` was set, which no released V2 config
  does: such a config gets a warning). V3: sigmoid scores; the choice adds the
  learned ``e_score_correction_bias`` and keeps the ``topk_group`` groups whose two best experts sum highest,
  the weights are the uncorrected scores, renormalised with ``norm_topk_prob``. Both scale the weights by
  ``routed_scaling_factor``.
- Checkpoints: per-expert tensors; the V3 multi-token-prediction layers (indices from ``num_hidden_layers`` on)
  are not part of the model and are skipped. ``kv_b_proj`` stays in the model's dtype (its halves are folded
  into the attention at every step) when the rest of the model is quantized.
"""

from __future__ import annotations

import logging
import re
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from plinth.attention_backends.interface import AttentionMetadata
from plinth.errors import ModelLoadError, UnsupportedModelError
from plinth.model_registry.interface import ModelContext
from plinth.model_registry.layers.attention import Attention
from plinth.model_registry.layers.layernorm import RMSNorm
from plinth.model_registry.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    divide,
)
from plinth.model_registry.layers.moe import FusedMoE, check_expert_activation
from plinth.model_registry.layers.rotary import apply_rotary, deinterleave_pairs, rope_parameters, yarn_mscale
from plinth.model_registry.models.decoder import AttentionOptions, DecoderForCausalLM, DenseMLP
from plinth.model_registry.models.qwen2_moe import _ExpertWeights

#: the model types whose paged cache holds the compressed latents (see :func:`latent_cache_shape`)
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
#: the norms inside the attention block use DeepSeek's default epsilon, not the config's ``rms_norm_eps``
_LATENT_NORM_EPS = 1e-6
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
logger = logging.getLogger(__name__)


def latent_cache_shape(cfg: Any) -> tuple[int, int]:
    """``(key/value heads, head size)`` of the paged cache of a multi-head latent attention layer: one head of the
    latent and the shared rotary key."""
    return 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim


def mla_softmax_scale(cfg: Any) -> float:
    """``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times ``yarn_mscale(factor, mscale_all_dim) ** 2`` under
    YaRN (DeepSeek scales the whole query-key product, not only its rotary part)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    params = rope_parameters(cfg)
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        m = yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale *= m * m
    return scale


def _mlp_bias(cfg: Any) -> bool:
    """The MLPs' biases: V2's ``mlp_bias`` (transformers' V3 MLPs have none whatever the config says)."""
    return cfg.model_type == "deepseek_v2" and bool(getattr(cfg, "mlp_bias", False))


class LatentExpansion(nn.Module):
    """``kv_b_proj``: the latent's expansion into each head's key and value parts, ``weight`` ``[heads * (nope +
    v), L]`` (this rank's heads). Not a linear layer: the attention reads the weight itself at every step (its key
    half folds into the query, its value half into the output), so no GEMM method may repack or quantize it."""

    def __init__(self, latent: int, rows: int, tp_rank: int, tp_size: int, quant_method: Any = None):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = nn.Parameter(torch.empty(divide(rows, tp_size, "kv_b_proj rows"), latent), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]
        # an FP8 checkpoint's kv_b_proj is widened once loaded (plinth.quantization.fp8.WidenedFP8Weight)
        self.weight_method = (quant_method.widened_weight(self) if hasattr(quant_method, "widened_weight")
                              else None)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rows = param.shape[0]
        if tuple(loaded.shape) != (rows * self.tp_size, param.shape[1]):
            raise ModelLoadError(f"shape mismatch: expected {(rows * self.tp_size, param.shape[1])}, checkpoint has "
                                 f"{tuple(loaded.shape)}")
        mine = loaded.narrow(0, self.tp_rank * rows, rows)
        if self.weight_method is not None and self.weight_method.takes(mine):
            return
        param.data.copy_(mine)


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek's attention block over a cache of compressed latents (see the module docstring). Under tensor
    parallelism each rank holds its share of the heads (``q_b_proj``/``q_proj``, ``kv_b_proj``, ``o_proj``); the
    latent projections are replicated."""

    def __init__(self, ctx: ModelContext, layer_idx: int, options: AttentionOptions, norm: type[RMSNorm] = RMSNorm):
        super().__init__()
        cfg = ctx.hf_config
        tp = {"tp_rank": ctx.tp_rank, "tp_size": ctx.tp_size, "quant_method": ctx.quant_method}
        heads = cfg.num_attention_heads
        self.num_heads = divide(heads, ctx.tp_size, "attention heads")
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.latent = cfg.kv_lora_rank
        qk = self.nope + self.rope
        bias = bool(getattr(cfg, "attention_bias", False))
        replicated = {"quant_method": ctx.quant_method}
        self.q_lora_rank = getattr(cfg, "q_lora_rank", None)
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(cfg.hidden_size, self.q_lora_rank, bias=bias, **replicated)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=_LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * qk, bias=False, **tp)
        else:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, heads * qk, bias=False, **tp)
        self.kv_a_proj_with_mqa = ReplicatedLinear(cfg.hidden_size, self.latent + self.rope, bias=bias, **replicated)
        self.kv_a_layernorm = RMSNorm(self.latent, eps=_LATENT_NORM_EPS)
        self.kv_b_proj = LatentExpansion(self.latent, heads * (self.nope + self.v_dim), ctx.tp_rank, ctx.tp_size,
                                         ctx.quant_method)
        self.o_proj = RowParallelLinear(heads * self.v_dim, cfg.hidden_size, bias=bias, **tp)
        kv_heads, head_size = latent_cache_shape(cfg)
        self.attn = Attention(self.num_heads, head_size, mla_softmax_scale(cfg), kv_heads, ctx.attention_backend,
                              None, layer_idx, values_are_keys=True)
        self.interleaved = cfg.model_type == "deepseek_v2" or bool(getattr(cfg, "rope_interleave", True))

    def input_quant(self) -> Any:
        """``None``: the latent and query projections read plain rows (the norm before them writes no quantized
        copy)."""
        return None

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                metadata: AttentionMetadata, reduce: bool = True) -> torch.Tensor:
        t, h = hidden.shape[0], self.num_heads
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        q_nope, q_pe = q.view(t, h, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.latent, self.rope], dim=-1)
        c = self.kv_a_layernorm(c.contiguous())                                 # [T, L]
        k_pe = k_pe.reshape(t, 1, self.rope)
        if self.interleaved:
            q_pe, k_pe = deinterleave_pairs(q_pe), deinterleave_pairs(k_pe)
        q_pe, k_pe = apply_rotary(q_pe, cos, sin), apply_rotary(k_pe, cos, sin)
        w = self.kv_b_proj.weight.view(h, self.nope + self.v_dim, self.latent)   # [H, nope + v, L]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w[:, :self.nope]).transpose(0, 1)   # [T, H, L]
        query = torch.cat((q_latent, q_pe), dim=-1)                              # [T, H, L + R]
        key = torch.cat((c[:, None, :], k_pe), dim=-1)                           # [T, 1, L + R]
        out = self.attn(query, key, key, metadata)[..., :self.latent]           # [T, H, L]
        out = torch.bmm(out.transpose(0, 1), w[:, self.nope:].transpose(1, 2))   # [H, T, v]
        return self.o_proj(out.transpose(0, 1).reshape(t, h * self.v_dim), reduce=reduce)


class DeepseekExperts(FusedMoE):
    """The routed experts with DeepSeek's routing (V2's softmax, V3's corrected sigmoid; see the module
    docstring). V3's ``e_score_correction_bias`` (the checkpoint's ``mlp.gate.e_score_correction_bias``) lives
    here."""

    def __init__(self, ctx: ModelContext, v3: bool):
        cfg = ctx.hf_config
        # V2: transformers' router never renormalises (the released V2 configs say norm_topk_prob false)
        renormalize = v3 and bool(getattr(cfg, "norm_topk_prob", False))
        if not v3 and getattr(cfg, "norm_topk_prob", False):
            logger.warning("DeepSeek-V2 config sets norm_topk_prob: the experts' weights are scaled by "
                           "routed_scaling_factor and not renormalised, as transformers' DeepseekV2 does")
        super().__init__(cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                         renormalize=renormalize, tp_rank=ctx.tp_rank, tp_size=ctx.tp_size)
        self.v3 = v3
        self.scaling = float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0)
        topk_method = getattr(cfg, "topk_method", None) or "greedy"
        if not v3 and topk_method not in ("greedy", "group_limited_greedy"):
            raise UnsupportedModelError(f"DeepSeek-V2 routing {topk_method!r} is not supported "
                                        "(greedy, group_limited_greedy)")
        grouped = v3 or topk_method == "group_limited_greedy"
        self.n_group = int(getattr(cfg, "n_group", None) or 1) if grouped else 1
        self.topk_group = int(getattr(cfg, "topk_group", None) or self.n_group) if grouped else 1
        if self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise UnsupportedModelError(f"{self.num_experts} experts in n_group={self.n_group} groups with "
                                        f"topk_group={self.topk_group}")
        if v3 and self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise UnsupportedModelError("DeepSeek-V3 routing scores each group by its two best experts: "
                                        f"{self.num_experts} experts in {self.n_group} groups leave fewer")
        self.e_score_correction_bias = (nn.Parameter(torch.empty(self.num_experts, dtype=torch.float32),
                                                     requires_grad=False) if v3 else None)

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grouped_route(router_logits, self.top_k, v3=self.v3, correction=self.e_score_correction_bias,
                             n_group=self.n_group, topk_group=self.topk_group, renormalize=self.renormalize,
                             scaling=self.scaling)


def grouped_route(router_logits: torch.Tensor, top_k: int, *, v3: bool, correction: torch.Tensor | None,
                  n_group: int, topk_group: int, renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routing: top-k expert weights ``[T, K]`` (float32) and ids ``[T, K]`` from router logits
    ``[T, E]``. V3 (``v3``): sigmoid scores, the choice made on the scores plus ``correction``, within the
    ``topk_group`` groups of ``n_group`` whose two best experts score highest; V2: softmax scores, groups by their
    best expert, the other groups' scores zeroed. Weights renormalised if asked, then times ``scaling``."""
    logits = router_logits.to(torch.float32)
    scores = logits.sigmoid() if v3 else logits.softmax(dim=-1)
    choice = scores + correction if correction is not None else scores
    if n_group > 1:
        t = choice.shape[0]
        groups = choice.view(t, n_group, -1)
        group_score = groups.topk(2, dim=-1).values.sum(dim=-1) if v3 else groups.amax(dim=-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(topk_group, dim=-1).indices, True)
        keep = keep[:, :, None].expand_as(groups).reshape(t, -1)
        if v3:
            choice = choice.masked_fill(~keep, float("-inf"))
        else:   # V2 zeroes the other groups' scores (and takes the weights from them)
            choice = scores = scores.masked_fill(~keep, 0.0)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


class Float32Router(nn.Module):
    """``mlp.gate``: router logits ``[T, E]`` in float32 (DeepSeek and ERNIE compute them in float32)."""

    def __init__(self, num_experts: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.float32), self.weight)


class SharedExpertsMoE(nn.Module):
    """A float32 router (``gate``), the routed ``experts`` (whose :meth:`~FusedMoE.route` picks them) and ``shared``
    shared experts every token runs (``shared_experts``, one MLP ``shared`` experts wide)."""

    def __init__(self, ctx: ModelContext, experts: FusedMoE, shared: int, bias: bool = False):
        super().__init__()
        cfg = ctx.hf_config
        self.gate = Float32Router(experts.num_experts, cfg.hidden_size)
        self.experts = experts
        self.shared_experts = (DenseMLP(ctx, cfg.moe_intermediate_size * shared, bias=bias,
                                        activation=getattr(cfg, "hidden_act", "silu")) if shared else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        out = self.experts(x, self.gate(x))
        return out if self.shared_experts is None else out + self.shared_experts(x)


class CorrectedExpertWeights(_ExpertWeights):
    """Checkpoint names of per-expert tensors, and of the routing correction (``e_score_correction_bias``) the
    checkpoint keeps under :attr:`correction_owner` (DeepSeek-V3's ``mlp.gate``, ERNIE's ``mlp.moe_statics``) and the
    experts hold; the tensors :meth:`not_in_the_model` names (multi-token-prediction layers) are skipped."""

    correction_owner: ClassVar[str] = ".mlp.gate."

    def not_in_the_model(self, name: str) -> bool:
        return False

    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        if self.not_in_the_model(name):
            return None
        if name.endswith(f"{self.correction_owner}e_score_correction_bias"):
            return name.replace(self.correction_owner, ".mlp.experts.", 1), None
        return super().map_weight_name(name)

    def checkpoint_name(self, param_name: str, shard_id: Any = None) -> str:
        if param_name.endswith(".mlp.experts.e_score_correction_bias"):
            return param_name.replace(".mlp.experts.", self.correction_owner, 1)
        return super().checkpoint_name(param_name, shard_id)


class DeepseekV2ForCausalLM(CorrectedExpertWeights, DecoderForCausalLM):
    """DeepSeek-V2: multi-head latent attention, softmax-routed experts with shared ones."""

    attention_class: ClassVar[type[nn.Module]] = MultiHeadLatentAttention
    #: no fused q/k/v projection: only the MLPs' gate and up are stacked
    packed_modules_mapping: ClassVar[dict[str, tuple[str, Any]]] = {
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }
    lora_modules: ClassVar[tuple[str, ...]] = ()
    v3: ClassVar[bool] = False

    def make_mlp(self, ctx: ModelContext, layer_idx: int) -> nn.Module:
        cfg = ctx.hf_config
        activation = self.block_options(cfg).activation
        if layer_idx < int(getattr(cfg, "first_k_dense_replace", 0) or 0) or not getattr(cfg, "n_routed_experts", 0):
            return DenseMLP(ctx, cfg.intermediate_size, bias=_mlp_bias(cfg),
                            activation=activation)
        check_expert_activation(activation)
        return SharedExpertsMoE(ctx, DeepseekExperts(ctx, self.v3), int(getattr(cfg, "n_shared_experts", None) or 0),
                                bias=_mlp_bias(cfg))

    def not_in_the_model(self, name: str) -> bool:
        """The multi-token-prediction layers (indices from ``num_hidden_layers`` on)."""
        m = _LAYER.match(name)
        return m is not None and int(m[1]) >= self.ctx.hf_config.num_hidden_layers


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3: V2's attention (queries always compressed in the released models), sigmoid routing with a
    learned correction over groups of experts."""

    v3: ClassVar[bool] = True
