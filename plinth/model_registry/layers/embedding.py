"""Token embedding and LM head, split over the vocabulary for tensor parallelism.

Rank ``r`` holds rows ``[r * n, (r + 1) * n)`` with ``n = ceil(vocab / tp_size)`` (the last rank's
tail beyond the vocabulary is padding). The embedding masks ids outside its range and sums
across ranks; the LM head gathers every rank's logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from plinth.distributed.communication import tp_all_gather, tp_all_reduce
from plinth.errors import ModelLoadError


class VocabEmbedding(nn.Module):
    """Token embedding ``[vocab, hidden]`` (this rank's rows)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.rows_per_rank = -(-num_embeddings // tp_size)
        self.vocab_start = tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.dim() != 2 or loaded.shape[0] != self.num_embeddings or loaded.shape[1] != param.shape[1]:
            raise ModelLoadError(f"shape mismatch: expected {(self.num_embeddings, param.shape[1])}, "
                                 f"checkpoint has {tuple(loaded.shape)}")
        rows = self.vocab_end - self.vocab_start
        param.data[:rows].copy_(loaded[self.vocab_start:self.vocab_end])
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(in_range, input_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight) * in_range[:, None].to(self.weight.dtype)
        return tp_all_reduce(out)


class LMHead(VocabEmbedding):
    """The output projection ``[vocab, hidden]``; shares the embedding's parameter when tied."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tie_to: VocabEmbedding | None = None,
                 tp_rank: int = 0, tp_size: int = 1):
        super().__init__(num_embeddings, embedding_dim, tp_rank=tp_rank, tp_size=tp_size)
        if tie_to is not None:
            self.weight = tie_to.weight
        #: a device-specific GEMM installed after loading (e.g. plinth.worker.cpu_linear); None: F.linear
        self.gemm: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        logits = F.linear(hidden, self.weight) if self.gemm is None else self.gemm(hidden)
        if self.tp_size > 1:
            logits = tp_all_gather(logits, dim=-1)   # [N, tp_size * rows_per_rank]
        return logits[..., : self.num_embeddings]
