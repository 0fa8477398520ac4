"""Encoder-only models: BERT, RoBERTa and XLM-RoBERTa (embedding models such as all-MiniLM, bge, e5, gte and
multilingual-e5; cross-encoder rerankers such as ms-marco-MiniLM and bge-reranker).

Every position attends to every other position of its input (no causal mask), so an input's hidden states depend
on all of its tokens: each input runs whole in one step (the engine turns chunked prefill and the prefix cache off
for these models) and keeps no KV cache. The layers are post-norm: ``LayerNorm(x + attention(x))``, then
``LayerNorm(x + MLP(x))``; the embeddings are the token's, its absolute position's and its segment's (token type),
summed and normed.

Segments: a BERT cross-encoder reads a text pair as ``[CLS] a [SEP] b [SEP]`` with token type 1 for ``b [SEP]``, as its
tokenizer's ``token_type_ids`` say; the types come with the request (the engine's ``token_type_ids``, made where a pair
is tokenized) and reach the model as the step's ``metadata.token_types``. Any other input is one segment (type 0), as
the tokenizer types a single text, whatever ``[SEP]`` tokens it holds. RoBERTa and XLM-RoBERTa use one segment, and count positions
from ``pad_token_id + 1`` (a pad token inside an input takes the pad position and does not advance the count, as
transformers' ``create_position_ids_from_input_ids``).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from plinth.attention_backends.interface import AttentionMetadata
from plinth.errors import UnsupportedModelError
from plinth.model_registry.interface import CausalLM, ModelContext
from plinth.model_registry.layers.embedding import VocabEmbedding
from plinth.model_registry.layers.layernorm import LayerNorm
from plinth.model_registry.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    divide,
)

logger = logging.getLogger(__name__)

#: model types whose positions start after the pad token's (``pad_token_id + 1``) and that have one segment
ROBERTA_TYPES = ("roberta", "xlm-roberta", "camembert")

#: the prefixes of the encoder's tensors in the checkpoints transformers writes (the base model has none)
_PREFIXES = ("bert.", "roberta.", "model.")

#: checkpoint tensors that are not the encoder's: the pooler and classifier (read by the engine's classifier head,
#: :func:`plinth.model_registry.loader.load_classifier_head`), masked-LM heads
_NOT_ENCODER = ("pooler.", "classifier.", "cls.", "lm_head.", "embeddings.position_ids", "embeddings.token_type_ids")


def position_offset(cfg: Any) -> int:
    """Where an encoder's positions start in its position table: ``pad_token_id + 1`` for RoBERTa-style models,
    else 0."""
    if getattr(cfg, "model_type", None) in ROBERTA_TYPES:
        pad = getattr(cfg, "pad_token_id", None)
        return int(pad) + 1 if isinstance(pad, int) else 0
    return 0


@functools.cache
def _varlen_kernel() -> Any:
    """PyTorch's variable-length flash attention (``torch.nn.attention.varlen.varlen_attn``), or ``None`` where this
    PyTorch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _varlen_takes_windows(kernel: Any) -> bool:
    """Whether the variable-length kernel takes ``window_size`` (newer PyTorch)."""
    import inspect

    try:
        return "window_size" in inspect.signature(kernel).parameters
    except (TypeError, ValueError):
        return False


#: devices where the variable-length kernel failed once (an architecture it does not support): padded SDPA there
_NO_VARLEN: set[str] = set()


class EncoderStep:
    """One step's inputs: as flat sequences for the variable-length kernel (CUDA, 16-bit), else laid out as a padded
    batch ``[B, L]`` (made on first use, shared by every layer)."""

    def __init__(self, metadata: AttentionMetadata, device: torch.device, num_tokens: int, dtype: torch.dtype):
        starts = metadata.query_start_loc_cpu
        lens = [starts[i + 1] - starts[i] for i in range(metadata.num_seqs)]
        done = [metadata.seq_lens_cpu[i] - lens[i] for i in range(metadata.num_seqs)]
        if any(done):
            raise RuntimeError("an encoder-only model runs each input whole in one step; this step continues one "
                               "(chunked prefill or the prefix cache must be off)")
        self.num_seqs = len(lens)
        self.width = max(lens) if lens else 0
        self.lens = lens
        self.num_tokens = num_tokens
        self.device = device
        self.host_starts = starts
        self.starts = torch.tensor(starts[:-1], dtype=torch.int64).to(device, non_blocking=True)
        uniform = len(set(lens)) <= 1 and sum(lens) == num_tokens
        self.varlen = (_varlen_kernel() if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
                       and str(device) not in _NO_VARLEN and not uniform else None)
        self.cu = metadata.query_start_loc
        self.index: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None
        self._laid_out = uniform
        self._windows: dict[int, torch.Tensor] = {}

    def _lay_out(self) -> None:
        """The flat row of each padded slot (pads read row 0), and which slots are real."""
        offsets = torch.arange(self.width, dtype=torch.int64)
        lens = torch.tensor(self.lens, dtype=torch.int64)
        real = offsets[None, :] < lens[:, None]
        index = torch.tensor(self.host_starts[:-1], dtype=torch.int64)[:, None] + offsets[None, :]
        self.index = torch.where(real, index, 0).to(self.device, non_blocking=True)
        self.mask = real.to(self.device, non_blocking=True)[:, None, None, :]   # [B, 1, 1, L]: keys to attend to
        self.rows = torch.nonzero(real.flatten()).flatten().to(self.device, non_blocking=True)
        self._laid_out = True

    def attend(self, qkv: torch.Tensor, window: int | None = None) -> torch.Tensor:
        """Each input's bidirectional attention: ``qkv`` ``[T, 3, H, D]`` -> ``[T, H, D]``; with ``window`` a position
        sees only the positions at most ``window`` away (ModernBERT's local layers)."""
        if self.varlen is not None and (window is None or _varlen_takes_windows(self.varlen)):
            out = self._varlen(qkv, window)
            if out is not None:
                return out
        # [B, H, L, D] per input; the pad slots (and positions out of the window) are masked out as keys
        q, k, v = self.pad(qkv).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self._mask(window))
        return self.unpad(out.transpose(1, 2))

    def _varlen(self, qkv: torch.Tensor, window: int | None) -> torch.Tensor | None:
        """Each input's attention by the variable-length kernel over the flat rows (rows past the inputs, padding
        for graphs, are left as the kernel leaves them); ``None`` where the kernel refuses this device, which then
        runs padded SDPA from here on."""
        q, k, v = qkv.unbind(1)   # (rows strided over the fused projection: the kernel takes row strides)
        extra = {"window_size": (window, window)} if window is not None else {}
        try:
            return self.varlen(q, k, v, self.cu, self.cu, self.width, self.width, **extra)
        except RuntimeError as exc:
            _NO_VARLEN.add(str(self.device))
            logger.info("variable-length attention unavailable on %s (%s): encoder attention runs padded SDPA",
                        self.device, str(exc).splitlines()[0][:200])
            self.varlen = None
            return None

    def _mask(self, window: int | None) -> torch.Tensor | None:
        if not self._laid_out:
            self._lay_out()
        if window is None:
            return self.mask
        cached = self._windows.get(window)
        if cached is None:
            pos = torch.arange(self.width, device=self.device)
            near = (pos[:, None] - pos[None, :]).abs() <= window                 # [L, L]
            cached = near[None, None] if self.mask is None else near[None, None] & self.mask
            self._windows[window] = cached
        return cached

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, ...]`` -> ``[B, L, ...]``."""
        if not self._laid_out:
            self._lay_out()
        if self.index is None:
            return x[:self.num_seqs * self.width].view(self.num_seqs, self.width, *x.shape[1:])
        return x[self.index]

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """``[B, L, ...]`` -> ``[T, ...]`` (rows past the inputs, padding for graphs, are zero)."""
        flat = y.reshape(-1, *y.shape[2:])
        if self.index is not None:
            flat = flat[self.rows]
        if flat.shape[0] < self.num_tokens:
            flat = torch.cat([flat, flat.new_zeros(self.num_tokens - flat.shape[0], *flat.shape[1:])])
        return flat


class EncoderAttention(nn.Module):
    def __init__(self, ctx: ModelContext):
        super().__init__()
        cfg = ctx.hf_config
        tp = {"tp_rank": ctx.tp_rank, "tp_size": ctx.tp_size, "quant_method": ctx.quant_method}
        hidden = int(cfg.hidden_size)
        heads = int(cfg.num_attention_heads)
        self.head_size = divide(hidden, heads, "hidden size over the attention heads")
        self.num_heads = divide(heads, ctx.tp_size, "number of attention heads")
        self.qkv = QKVParallelLinear(hidden, self.head_size, heads, heads, bias=True, **tp)
        self.dense = RowParallelLinear(hidden, hidden, bias=True, **tp)
        self.norm = LayerNorm(hidden, float(cfg.layer_norm_eps), bias=True)

    def forward(self, x: torch.Tensor, step: EncoderStep) -> torch.Tensor:
        out = step.attend(self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_size))
        return self.norm(self.dense(out.reshape(x.shape[0], -1)), residual=x)[0]


class EncoderLayer(nn.Module):
    def __init__(self, ctx: ModelContext):
        super().__init__()
        from transformers.activations import ACT2FN

        cfg = ctx.hf_config
        tp = {"tp_rank": ctx.tp_rank, "tp_size": ctx.tp_size, "quant_method": ctx.quant_method}
        hidden, inter = int(cfg.hidden_size), int(cfg.intermediate_size)
        act = getattr(cfg, "hidden_act", "gelu")
        if not isinstance(act, str) or act not in ACT2FN:
            raise UnsupportedModelError(f"hidden_act {act!r} is not an activation transformers knows")
        self.attention = EncoderAttention(ctx)
        self.intermediate = ColumnParallelLinear(hidden, inter, bias=True, **tp)
        self.act = ACT2FN[act]
        self.output = RowParallelLinear(inter, hidden, bias=True, **tp)
        self.output_norm = LayerNorm(hidden, float(cfg.layer_norm_eps), bias=True)

    def forward(self, x: torch.Tensor, step: EncoderStep) -> torch.Tensor:
        x = self.attention(x, step)
        return self.output_norm(self.output(self.act(self.intermediate(x))), residual=x)[0]


class EncoderModel(CausalLM):
    """What every encoder-only model shares: no decode steps, no LM head."""

    #: every position attends to the whole input: inputs run whole, without the prefix cache or a KV cache
    is_encoder: ClassVar[bool] = True

    def graph_capturable(self, device: torch.device, dtype: torch.dtype) -> bool:
        """No decode steps to capture (worker processes ask this)."""
        return False

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """An encoder has no LM head: a pooling request's one sampled token is dropped, so it samples from one
        zero logit."""
        return hidden.new_zeros(hidden.shape[0], 1, dtype=torch.float32)


class BertModel(EncoderModel):
    """BERT (``BertModel``, ``BertForSequenceClassification``), RoBERTa and XLM-RoBERTa (``RobertaModel``,
    ``XLMRobertaModel`` and their ``*ForSequenceClassification``): embeddings and classifiers only, with the task
    ``embed`` or ``classify`` (the classifier's pooler and head run in the engine, on the first token's state)."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, Any]]] = {
        "attention.self.query": ("attention.qkv", "q"),
        "attention.self.key": ("attention.qkv", "k"),
        "attention.self.value": ("attention.qkv", "v"),
        "attention.output.dense": ("attention.dense", None),
        "attention.output.LayerNorm": ("attention.norm", None),
        "intermediate.dense": ("intermediate", None),
        "output.dense": ("output", None),
        "output.LayerNorm": ("output_norm", None),
    }

    def __init__(self, ctx: ModelContext):
        super().__init__(ctx)
        cfg = ctx.hf_config
        kind = getattr(cfg, "position_embedding_type", "absolute") or "absolute"
        if kind != "absolute":
            raise UnsupportedModelError(f"position_embedding_type {kind!r}: plinth runs encoders with absolute "
                                        "position embeddings")
        if getattr(cfg, "is_decoder", False) or getattr(cfg, "add_cross_attention", False):
            raise UnsupportedModelError("a BERT-style model configured as a decoder (is_decoder, "
                                        "add_cross_attention) is not supported; plinth runs these models as encoders")
        hidden = int(cfg.hidden_size)
        self.word_embeddings = VocabEmbedding(int(cfg.vocab_size), hidden, tp_rank=ctx.tp_rank, tp_size=ctx.tp_size)
        self.position_embeddings = nn.Parameter(torch.empty(int(cfg.max_position_embeddings), hidden),
                                                requires_grad=False)
        types = int(getattr(cfg, "type_vocab_size", 1) or 1)
        self.token_type_embeddings = nn.Parameter(torch.empty(types, hidden), requires_grad=False)
        self.embeddings_norm = LayerNorm(hidden, float(cfg.layer_norm_eps), bias=True)
        self.layers = nn.ModuleList(EncoderLayer(ctx) for _ in range(int(cfg.num_hidden_layers)))
        self.position_start = position_offset(cfg)
        self.pad_token_id = getattr(cfg, "pad_token_id", None) if self.position_start else None

    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        if name.startswith(_NOT_ENCODER):
            return None
        if name.startswith("embeddings."):
            rest = name[len("embeddings."):]
            if rest == "LayerNorm.weight" or rest == "LayerNorm.bias":
                return "embeddings_norm." + rest.split(".")[1], None
            if rest == "word_embeddings.weight":
                return name.removeprefix("embeddings."), None
            return rest.removesuffix(".weight"), None
        if name.startswith("encoder.layer."):
            name = "layers." + name[len("encoder.layer."):]
        return super().map_weight_name(name)

    def _positions(self, input_ids: torch.Tensor, positions: torch.Tensor, step: EncoderStep) -> torch.Tensor:
        if self.pad_token_id is None:
            return positions + self.position_start
        # transformers' rule: a non-pad token's position counts the non-pad tokens up to it, from pad + 1
        real = (input_ids != self.pad_token_id).to(torch.int64)
        counts = torch.cumsum(real, 0)
        before = torch.cat([counts.new_zeros(1), counts])[step.starts]   # non-pad tokens before each input
        seq = torch.repeat_interleave(torch.arange(step.num_seqs, device=input_ids.device),
                                      torch.tensor(step.lens, device=input_ids.device),
                                      output_size=sum(step.lens))
        mine = counts[:seq.shape[0]] - before[seq]
        out = torch.full_like(positions, self.pad_token_id)
        out[:seq.shape[0]] = torch.where(real[:seq.shape[0]].bool(), mine + self.pad_token_id, self.pad_token_id)
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        step = EncoderStep(metadata, input_ids.device, input_ids.shape[0], self.position_embeddings.dtype)
        pos = self._positions(input_ids, positions, step).clamp_(0, self.position_embeddings.shape[0] - 1)
        x = self.word_embeddings(input_ids) + self.position_embeddings[pos]
        types = metadata.token_types   # (the engine checked them against type_vocab_size)
        x = x + (self.token_type_embeddings[0] if types is None else self.token_type_embeddings[types])
        x = self.embeddings_norm(x)
        for layer in self.layers:
            x = layer(x, step)
        return x
