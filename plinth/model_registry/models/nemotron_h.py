"""Models whose blocks are one pre-norm mixer each, under the checkpoint's ``backbone.`` prefix: Mamba
(``MambaForCausalLM``: every block a Mamba-1 mixer; ``FalconMambaForCausalLM``: the same with normalised time
steps and ``B``/``C``), Mamba-2 (``Mamba2ForCausalLM``: every block a Mamba-2 mixer) and NVIDIA Nemotron-H (``NemotronHForCausalLM``: Nemotron-H
8B/47B, Nemotron Nano 2; blocks of Mamba-2 mixers, attention without positional embeddings, or a squared-ReLU MLP,
as ``layers_block_type`` / ``hybrid_override_pattern`` lists them).

Each block is ``h = h + mixer(norm(h))``; the embeddings are ``backbone.embeddings``, the final norm
``backbone.norm_f``. The Mamba layers keep per-sequence state (:mod:`plinth.model_registry.layers.mamba`).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from plinth.attention_backends.interface import AttentionMetadata
from plinth.distributed.communication import tp_all_reduce
from plinth.distributed.parallel_state import pp_layer_range
from plinth.errors import ModelLoadError, UnsupportedModelError
from plinth.model_registry.interface import CausalLM, ModelContext
from plinth.model_registry.layers.embedding import LMHead, VocabEmbedding
from plinth.model_registry.layers.layernorm import RMSNorm
from plinth.model_registry.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    divide,
)
from plinth.model_registry.layers.mamba import Mamba1Mixer, Mamba2Mixer, MambaStateMixin
from plinth.model_registry.models.decoder import AttentionOptions, DecoderAttention, MissingLayer
from plinth.model_registry.models.deepseek import Float32Router, grouped_route

#: block kinds (``layers_block_type``; transformers 5 writes ``linear_attention`` and ``full_attention``)
_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention", "full_attention": "attention",
          "mlp": "mlp", "moe": "moe"}
#: per-expert checkpoint tensors of a Nemotron-H mixture-of-experts block
_BLOCK = re.compile(r"^backbone\.layers\.(?P<idx>\d+)\.")
_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.*\.mixer\.experts)\.(?P<expert>\d+)\.(?P<proj>up|down)_proj\.weight$")


class UngatedMLP(nn.Module):
    """``down_proj(act(up_proj(x)))`` (Nemotron-H's squared ReLU)."""

    def __init__(self, ctx: ModelContext, intermediate_size: int, activation: str, bias: bool = False):
        super().__init__()
        from transformers.activations import ACT2FN

        hidden = ctx.hf_config.hidden_size
        tp = {"tp_rank": ctx.tp_rank, "tp_size": ctx.tp_size, "quant_method": ctx.quant_method}
        self.up_proj = ColumnParallelLinear(hidden, intermediate_size, bias=bias, **tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden, bias=bias, **tp)
        if activation not in ACT2FN:
            raise UnsupportedModelError(f"activation {activation!r} is not one transformers knows")
        self.act = ACT2FN[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class UngatedExperts(nn.Module):
    """Routed experts of ``down(act(up(x)))`` each (Nemotron 3's squared ReLU), stacked: ``up_weight`` ``[E, I, D]``,
    ``down_weight`` ``[E, D, I]`` (``D``: the model width, or the latent width where the block projects into one).
    The tokens of each chosen expert run as two matmuls (a loop over the experts that have tokens). Under tensor
    parallelism each rank holds a slice of every expert's intermediate features and the outputs are all-reduced."""

    def __init__(self, num_experts: int, width: int, intermediate_size: int, activation: str, *, tp_rank: int = 0,
                 tp_size: int = 1):
        super().__init__()
        from transformers.activations import ACT2FN

        self.num_experts, self.tp_rank, self.tp_size = num_experts, tp_rank, tp_size
        i = self.intermediate_per_rank = divide(intermediate_size, tp_size, "expert intermediate size")
        self.up_weight = nn.Parameter(torch.empty(num_experts, i, width), requires_grad=False)
        self.down_weight = nn.Parameter(torch.empty(num_experts, width, i), requires_grad=False)
        for p in (self.up_weight, self.down_weight):
            p.weight_loader = self._load  # type: ignore[attr-defined]
            p.expected_shards = tuple(range(num_experts))  # type: ignore[attr-defined]
        if activation not in ACT2FN:
            raise UnsupportedModelError(f"activation {activation!r} is not one transformers knows")
        self.act = ACT2FN[activation]

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, expert: int) -> None:
        """Expert ``expert``'s ``up_proj`` ``[I, D]`` or ``down_proj`` ``[D, I]``: this rank's features."""
        if not 0 <= expert < self.num_experts:
            raise ModelLoadError(f"expert index {expert} out of range (the block has {self.num_experts} experts)")
        i = self.intermediate_per_rank
        dim = 0 if param is self.up_weight else 1
        want = list(param.shape[1:])
        want[dim] = i * self.tp_size
        if list(loaded.shape) != want:
            raise ModelLoadError(f"shape mismatch: expected {tuple(want)}, checkpoint has {tuple(loaded.shape)}")
        param.data[expert].copy_(loaded.narrow(dim, self.tp_rank * i, i))

    def graph_capturable(self, device: torch.device, dtype: torch.dtype) -> bool:
        """The loop reads the routing on the host."""
        return False

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:   # [T, D]
        top_k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = order // top_k
        slot_weights = weights.reshape(-1)[order]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for expert, n in enumerate(counts):
            if n:
                rows = token_of[start:start + n]
                y = F.linear(self.act(F.linear(x[rows], self.up_weight[expert])), self.down_weight[expert])
                out.index_add_(0, rows, y.to(torch.float32) * slot_weights[start:start + n, None])
                start += n
        if self.tp_size > 1:
            tp_all_reduce(out)
        return out.to(x.dtype)


class NemotronHMoE(nn.Module):
    """Nemotron 3's mixture-of-experts block: a float32 router (``gate``) with DeepSeek-V3's corrected sigmoid
    routing in groups (``e_score_correction_bias``, ``n_group``, ``topk_group``, ``norm_topk_prob``,
    ``routed_scaling_factor``), routed :class:`UngatedExperts` (inside the latent projections
    ``fc1_latent_proj`` / ``fc2_latent_proj`` where ``moe_latent_size`` is set) and a shared expert every token runs."""

    def __init__(self, ctx: ModelContext):
        super().__init__()
        cfg = ctx.hf_config
        num_experts = cfg.n_routed_experts
        self.top_k = cfg.num_experts_per_tok
        self.n_group, self.topk_group = int(cfg.n_group or 1), int(cfg.topk_group or 1)
        if num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group or (
                self.n_group > 1 and num_experts // self.n_group < 2):
            raise UnsupportedModelError(f"NemotronH: {num_experts} experts in n_group={self.n_group} groups with "
                                        f"topk_group={self.topk_group}")
        self.renormalize = bool(getattr(cfg, "norm_topk_prob", True))
        self.scaling = float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0)
        act = getattr(cfg, "mlp_hidden_act", "relu2") or "relu2"
        bias = bool(getattr(cfg, "mlp_bias", False))
        latent = getattr(cfg, "moe_latent_size", None)
        self.gate = Float32Router(num_experts, cfg.hidden_size)
        self.gate.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32),
                                                         requires_grad=False)
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if latent:
            self.fc1_latent_proj = ReplicatedLinear(cfg.hidden_size, latent, bias=bias)
            self.fc2_latent_proj = ReplicatedLinear(latent, cfg.hidden_size, bias=bias)
        self.experts = UngatedExperts(num_experts, latent or cfg.hidden_size, cfg.moe_intermediate_size, act,
                                      tp_rank=ctx.tp_rank, tp_size=ctx.tp_size)
        self.shared_experts = UngatedMLP(ctx, cfg.moe_shared_expert_intermediate_size, act, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [T, H] -> [T, H]
        weights, ids = grouped_route(self.gate(x), self.top_k, v3=True, correction=self.gate.e_score_correction_bias,
                                     n_group=self.n_group, topk_group=self.topk_group, renormalize=self.renormalize,
                                     scaling=self.scaling)
        h = self.fc1_latent_proj(x) if self.fc1_latent_proj is not None else x
        h = self.experts(h, weights.to(torch.float32), ids)
        if self.fc2_latent_proj is not None:
            h = self.fc2_latent_proj(h)
        return h + self.shared_experts(x)


class MixerBlock(nn.Module):
    """``norm`` then one mixer (``kind``: ``"mamba"``, ``"attention"`` or ``"mlp"``); returns ``(mixer output,
    residual stream)``, the next block's norm adding the two (one fused add-and-norm)."""

    def __init__(self, ctx: ModelContext, layer_idx: int, kind: str, mamba: dict[str, Any], eps: float,
                 mlp: tuple[int, str, bool] | None):
        super().__init__()
        cfg = ctx.hf_config
        self.kind = kind
        self.norm = RMSNorm(cfg.hidden_size, eps=eps)
        self.mixer: nn.Module
        if kind == "mamba":
            self.mixer = Mamba2Mixer(cfg.hidden_size, quant_method=ctx.quant_method, tp_rank=ctx.tp_rank,
                                     tp_size=ctx.tp_size, eps=eps,
                                     **mamba)
        elif kind == "mamba1":
            self.mixer = Mamba1Mixer(cfg.hidden_size, quant_method=ctx.quant_method, tp_rank=ctx.tp_rank,
                                     tp_size=ctx.tp_size, **mamba)
        elif kind == "attention":
            # no biases whatever attention_bias says, as transformers' Nemotron-H builds it
            self.mixer = DecoderAttention(ctx, layer_idx, AttentionOptions(rope=False))
        elif kind == "moe":
            self.mixer = NemotronHMoE(ctx)
        else:
            assert mlp is not None
            self.mixer = UngatedMLP(ctx, *mlp)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.norm(hidden)
        else:
            hidden, residual = self.norm(hidden, residual)
        if self.kind in ("mamba", "mamba1"):
            return self.mixer(hidden, metadata), residual
        if self.kind == "attention":
            return self.mixer(hidden, None, None, metadata), residual
        return self.mixer(hidden), residual


class Backbone(nn.Module):
    """The embeddings, blocks and final norm; under pipeline parallelism this stage's blocks only (the others
    :class:`~plinth.model_registry.models.decoder.MissingLayer`), the embeddings on the first stage, the final norm
    on the last."""

    def __init__(self, ctx: ModelContext, kinds: list[str], mamba: dict[str, Any], eps: float,
                 mlp: tuple[int, str, bool] | None):
        super().__init__()
        cfg = ctx.hf_config
        self.start_layer, self.end_layer = pp_layer_range(len(kinds), ctx.pp_rank, ctx.pp_size)
        self.is_last_stage = ctx.pp_rank == ctx.pp_size - 1
        self.embeddings = (VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp_rank=ctx.tp_rank, tp_size=ctx.tp_size)
                           if ctx.pp_rank == 0 else None)
        self.layers = nn.ModuleList(MixerBlock(ctx, i, kind, mamba, eps, mlp)
                                    if self.start_layer <= i < self.end_layer else MissingLayer()
                                    for i, kind in enumerate(kinds))
        self.norm_f = RMSNorm(cfg.hidden_size, eps=eps) if self.is_last_stage else None

    def run_stage(self, input_ids: torch.Tensor, metadata: AttentionMetadata, hidden: torch.Tensor | None,
                  residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This stage's blocks (see :meth:`~plinth.model_registry.models.decoder.DecoderModel.run_stage`)."""
        if self.embeddings is not None:
            hidden = self.embeddings(input_ids)
        assert hidden is not None, "a later pipeline stage needs the previous stage's hidden states"
        for i in range(self.start_layer, self.end_layer):
            hidden, residual = self.layers[i](hidden, residual, metadata)
        if self.norm_f is None:
            assert residual is not None
            return hidden, residual
        hidden, _ = self.norm_f(hidden, residual)
        return hidden, None


class MambaBackboneForCausalLM(MambaStateMixin, CausalLM):
    """The shared model: subclasses say each block's kind and the Mamba mixers' shapes from their config."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, Any]]] = {
        ".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"), ".v_proj.": (".qkv_proj.", "v")}
    #: stages are built and run one at a time (:meth:`forward_stage`)
    supports_pipeline_parallel: ClassVar[bool] = True
    lora_modules: ClassVar[tuple[str, ...]] = ()

    def __init__(self, ctx: ModelContext):
        super().__init__(ctx)
        cfg = ctx.hf_config
        self.backbone = Backbone(ctx, self.block_kinds(cfg), self.mamba_options(cfg), self.norm_eps(cfg),
                                 self.mlp_options(cfg))
        self.tie_word_embeddings = self.ties_embeddings(cfg)
        self.has_recurrent_state = self.config_has_recurrent_state(cfg)
        # a last stage without the embeddings reads the tied matrix into its own LM head
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size,
                              tie_to=self.backbone.embeddings if self.tie_word_embeddings else None,
                              tp_rank=ctx.tp_rank, tp_size=ctx.tp_size) if self.backbone.is_last_stage else None

    @classmethod
    def block_kinds(cls, cfg: Any) -> list[str]:
        raise NotImplementedError

    @classmethod
    def config_has_recurrent_state(cls, hf_config: Any) -> bool:
        return any(kind.startswith("mamba") for kind in cls.block_kinds(hf_config))

    def ties_embeddings(self, cfg: Any) -> bool:
        """Whether the LM head is the embedding matrix (the config's ``tie_word_embeddings``)."""
        return bool(getattr(cfg, "tie_word_embeddings", False))

    def mamba_options(self, cfg: Any) -> dict[str, Any]:
        raise NotImplementedError

    def norm_eps(self, cfg: Any) -> float:
        return float(getattr(cfg, "layer_norm_epsilon", 1e-5))

    def mlp_options(self, cfg: Any) -> tuple[int, str, bool] | None:
        return None

    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        if name.startswith("mtp."):   # multi-token-prediction layers (Nemotron 3): not run
            return None
        if name.startswith("model."):   # transformers' module names for the backbone
            name = "backbone." + name[len("model."):]
        if self.tie_word_embeddings and name == "lm_head.weight":
            return None
        if self.ctx.pp_size > 1:
            if self.tie_word_embeddings and self.backbone.embeddings is None and name == "backbone.embeddings.weight":
                return ("lm_head.weight", None) if self.lm_head is not None else None
            if not self._on_this_stage(name):
                return None
        m = _EXPERT_TENSOR.match(name)
        if m is not None:
            return f"{m['prefix']}.{m['proj']}_weight", int(m["expert"])
        return super().map_weight_name(name)

    def checkpoint_name(self, param_name: str, shard_id: Any = None) -> str:
        if param_name.endswith(("experts.up_weight", "experts.down_weight")) and isinstance(shard_id, int):
            proj = "up" if param_name.endswith("up_weight") else "down"
            return f"{param_name.rsplit('.', 1)[0]}.{shard_id}.{proj}_proj.weight"
        return super().checkpoint_name(param_name, shard_id)

    def _on_this_stage(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` (``backbone.`` names) belongs to this pipeline stage's modules (a block
        that no stage holds goes on, to be refused as unknown)."""
        b = self.backbone
        m = _BLOCK.match(name)
        if m is not None:
            idx = int(m["idx"])
            return b.start_layer <= idx < b.end_layer or idx >= len(b.layers)
        if name.startswith("backbone.embeddings."):
            return b.embeddings is not None
        if name.startswith("backbone.norm_f."):
            return b.norm_f is not None
        if name.startswith("lm_head."):
            return self.lm_head is not None
        return True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                image_embeds: Any = None) -> torch.Tensor:
        self.begin_step(metadata)
        hidden, _ = self.backbone.run_stage(input_ids, metadata, None, None)
        return hidden

    def forward_stage(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                      hidden: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One pipeline stage: the first embeds ``input_ids``, later ones go on from the previous stage's ``(hidden,
        residual)``; the last returns the normed final states (and ``None``). Each keeps its own blocks' state."""
        self.begin_step(metadata)
        return self.backbone.run_stage(input_ids, metadata, hidden, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "only the last pipeline stage computes logits"
        return self.lm_head(hidden).float()


def _limit(cfg: Any) -> tuple[float, float] | None:
    limit = getattr(cfg, "time_step_limit", None)
    return (float(limit[0]), float(limit[1])) if limit is not None else None


class MambaForCausalLM(MambaBackboneForCausalLM):
    """``MambaForCausalLM`` (state-spaces/mamba-130m to 2.8b and other Mamba-1 checkpoints): every block a Mamba-1
    mixer; the LM head tied to the embeddings unless the config says otherwise."""

    inner_norms: ClassVar[str | None] = None

    @classmethod
    def block_kinds(cls, cfg: Any) -> list[str]:
        return ["mamba1"] * cfg.num_hidden_layers

    def ties_embeddings(self, cfg: Any) -> bool:
        return bool(getattr(cfg, "tie_word_embeddings", True))

    def mamba_options(self, cfg: Any) -> dict[str, Any]:
        rank = cfg.time_step_rank
        if rank == "auto":   # a config transformers did not normalise
            rank = -(-cfg.hidden_size // 16)
        width = getattr(cfg, "intermediate_size", None) or int(cfg.expand * cfg.hidden_size)
        return dict(intermediate_size=int(width), state_size=cfg.state_size, conv_kernel=cfg.conv_kernel,
                    time_step_rank=int(rank), conv_bias=bool(cfg.use_conv_bias), proj_bias=bool(cfg.use_bias),
                    activation=getattr(cfg, "hidden_act", "silu") or "silu", inner_norms=self.inner_norms,
                    norm_eps=float(getattr(cfg, "mixer_rms_eps", 1e-6)))


class FalconMambaForCausalLM(MambaForCausalLM):
    """``FalconMambaForCausalLM`` (TII Falcon-Mamba 7B and its instruct model): Mamba-1 blocks whose time steps and
    ``B``, ``C`` are RMS-normalised without weights (``mixer_rms_eps``)."""

    inner_norms: ClassVar[str | None] = "weightless"


class Mamba2ForCausalLM(MambaBackboneForCausalLM):
    """``Mamba2ForCausalLM`` (Mamba-Codestral and other Mamba-2 checkpoints): every block a Mamba-2 mixer."""

    @classmethod
    def block_kinds(cls, cfg: Any) -> list[str]:
        return ["mamba"] * cfg.num_hidden_layers

    def mamba_options(self, cfg: Any) -> dict[str, Any]:
        if cfg.num_heads * cfg.head_dim != int(cfg.expand * cfg.hidden_size):
            raise ModelLoadError(f"Mamba2: num_heads x head_dim ({cfg.num_heads} x {cfg.head_dim}) must equal expand "
                                 f"x hidden_size ({cfg.expand} x {cfg.hidden_size})")
        return dict(num_heads=cfg.num_heads, head_dim=cfg.head_dim, state_size=cfg.state_size,
                    n_groups=cfg.n_groups, conv_kernel=cfg.conv_kernel, chunk_size=cfg.chunk_size,
                    conv_bias=bool(cfg.use_conv_bias), proj_bias=bool(cfg.use_bias),
                    activation=getattr(cfg, "hidden_act", "silu") or "silu", time_step_limit=_limit(cfg))


class NemotronHForCausalLM(MambaBackboneForCausalLM):
    """``NemotronHForCausalLM``: Mamba-2, attention (no RoPE), squared-ReLU MLP and (Nemotron 3) mixture-of-experts
    blocks."""

    def ties_embeddings(self, cfg: Any) -> bool:
        """Never: transformers' Nemotron-H keeps its own ``lm_head`` whatever ``tie_word_embeddings`` says."""
        return False

    @classmethod
    def block_kinds(cls, cfg: Any) -> list[str]:
        types = getattr(cfg, "layers_block_type", None) or getattr(cfg, "layer_types", None)
        if types is None:
            raise ModelLoadError("NemotronH: the config has no layers_block_type (or hybrid_override_pattern)")
        kinds = []
        for i, kind in enumerate(types):
            if kind not in _KINDS:
                raise UnsupportedModelError(f"NemotronH: block {i} is of kind {kind!r}; supported: "
                                            f"{', '.join(sorted(_KINDS))}")
            kinds.append(_KINDS[kind])
        return kinds

    def mamba_options(self, cfg: Any) -> dict[str, Any]:
        return dict(num_heads=cfg.mamba_num_heads, head_dim=cfg.mamba_head_dim, state_size=cfg.ssm_state_size,
                    n_groups=cfg.n_groups, conv_kernel=cfg.conv_kernel, chunk_size=cfg.chunk_size,
                    conv_bias=bool(cfg.use_conv_bias), proj_bias=bool(getattr(cfg, "use_bias", False)),
                    activation=getattr(cfg, "mamba_hidden_act", "silu") or "silu", time_step_limit=_limit(cfg))

    def mlp_options(self, cfg: Any) -> tuple[int, str, bool] | None:
        return (cfg.intermediate_size, getattr(cfg, "mlp_hidden_act", "relu2") or "relu2",
                bool(getattr(cfg, "mlp_bias", False)))
