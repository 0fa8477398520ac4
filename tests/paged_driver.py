"""A minimal paged-KV driver for model tests: allocates caches, block tables and metadata.

It stands in for the model runner: sequences get blocks from a free list (block 0 stays the
scratch block), each step feeds a flat batch of new tokens for several sequences, and the
logits of each sequence's last new token come back.
"""

from __future__ import annotations

import dataclasses

import torch

from plinth.attention_backends.interface import AttentionBackend, AttentionMetadata


def build_metadata(entries: list[tuple[list[int], int, list[int]]], block_size: int,
                   device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Flat-batch inputs for ``entries`` = ``[(new_token_ids, start_pos, block_ids), ...]``.

    Returns:
        ``input_ids`` ``[T]``, ``positions`` ``[T]`` and the attention metadata.
    """
    input_ids, positions, slots, qsl, seq_lens, ctx_lens = [], [], [], [0], [], []
    for tokens, start, blocks in entries:
        for i, tok in enumerate(tokens):
            pos = start + i
            input_ids.append(tok)
            positions.append(pos)
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        qsl.append(qsl[-1] + len(tokens))
        seq_lens.append(start + len(tokens))
        ctx_lens.append(start)
    width = max(len(b) for _, _, b in entries)
    tables = torch.zeros(len(entries), width, dtype=torch.int32)
    for s, (_, _, blocks) in enumerate(entries):
        tables[s, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    q_lens = [qsl[i + 1] - qsl[i] for i in range(len(entries))]
    md = AttentionMetadata(
        num_tokens=qsl[-1],
        num_seqs=len(entries),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=tables.to(device),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    ids = torch.tensor(input_ids, dtype=torch.int64, device=device)
    pos = torch.tensor(positions, dtype=torch.int64, device=device)
    return ids, pos, md


@dataclasses.dataclass
class _Seq:
    tokens: list[int]
    blocks: list[int]
    num_computed: int = 0


class PagedDriver:
    """Runs a plinth ``CausalLM`` over a paged KV cache.

    Args:
        model: a plinth CausalLM whose layers use ``backend``.
        backend: the attention backend instance.
        block_size: tokens per block.
        num_blocks: blocks per layer (block 0 is never handed out).
    """

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, block_size: int = 4,
                 num_blocks: int = 256, device: torch.device | str = "cpu", kv_dtype: torch.dtype | None = None):
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = torch.device(device)
        kv_dtype = kv_dtype or next(model.parameters()).dtype
        for layer in model.attention_layers():
            shape = backend.kv_cache_shape(num_blocks, block_size, layer.num_kv_heads, layer.head_size)
            layer.kv_cache = torch.zeros(shape, dtype=kv_dtype, device=self.device)
        # hand blocks out in a scrambled order so block tables are not trivially contiguous
        self.free = [b for b in range(num_blocks - 1, 0, -1)]
        self.free = self.free[::2] + self.free[1::2]
        self.seqs: dict[int, _Seq] = {}

    def add(self, seq_id: int, prompt: list[int]) -> None:
        self.seqs[seq_id] = _Seq(tokens=list(prompt), blocks=[])

    def _ensure_blocks(self, seq: _Seq, length: int) -> None:
        while len(seq.blocks) * self.block_size < length:
            seq.blocks.append(self.free.pop())

    @torch.inference_mode()
    def step(self, work: dict[int, int]) -> dict[int, torch.Tensor]:
        """Compute the next ``n`` uncomputed tokens of each sequence in ``work = {seq_id: n}``.

        Returns:
            ``{seq_id: logits [vocab]}`` of each sequence's last computed token.
        """
        entries, ids = [], list(work)
        for sid in ids:
            seq = self.seqs[sid]
            n = work[sid]
            new = seq.tokens[seq.num_computed: seq.num_computed + n]
            assert len(new) == n, "asked to compute more tokens than the sequence has"
            self._ensure_blocks(seq, seq.num_computed + n)
            entries.append((new, seq.num_computed, list(seq.blocks)))
        input_ids, positions, md = build_metadata(entries, self.block_size, self.device)
        self.backend.prepare(md)
        hidden = self.model(input_ids, positions, md)                       # [T, hidden]
        last_rows = torch.tensor(md.query_start_loc_cpu[1:], device=self.device) - 1
        logits = self.model.compute_logits(hidden[last_rows])               # [B, vocab]
        for sid in ids:
            self.seqs[sid].num_computed += work[sid]
        return {sid: logits[i] for i, sid in enumerate(ids)}

    def generate_greedy(self, prompts: list[list[int]], max_new_tokens: int,
                        prefill_chunks: int = 1) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
        """Greedy generation for a batch of prompts (prefill split into ``prefill_chunks`` rounds).

        Returns:
            (generated token ids per prompt, logits [vocab] that chose each generated token).
        """
        base = len(self.seqs)
        for i, p in enumerate(prompts):
            self.add(base + i, p)
        ids = [base + i for i in range(len(prompts))]
        last: dict[int, torch.Tensor] = {}
        for r in range(prefill_chunks):
            work = {}
            for sid, p in zip(ids, prompts, strict=True):
                chunk = -(-len(p) // prefill_chunks)
                n = min(chunk, len(p) - self.seqs[sid].num_computed) if r < prefill_chunks - 1 else \
                    len(p) - self.seqs[sid].num_computed
                if n > 0:
                    work[sid] = n
            last.update(self.step(work))
        generated: list[list[int]] = [[] for _ in prompts]
        step_logits: list[list[torch.Tensor]] = [[] for _ in prompts]
        for t in range(max_new_tokens):
            for i, sid in enumerate(ids):
                logits = last[sid]
                tok = int(torch.argmax(logits))
                generated[i].append(tok)
                step_logits[i].append(logits.clone())
                self.seqs[sid].tokens.append(tok)
            if t < max_new_tokens - 1:
                last = self.step({sid: 1 for sid in ids})
        return generated, step_logits
