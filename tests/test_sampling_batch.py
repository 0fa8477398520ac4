"""SamplingBatchBuilder: the batch it keeps between steps equals one built afresh from the requests,
step after step (penalty counts updated in place, seeds, min_tokens), through composition changes,
steps where a row gains no token (preemption) and devices; the sampler draws the same tokens."""

from __future__ import annotations

import dataclasses
import random

import torch

from plinth.core.request import Request, SamplingParams
from plinth.core.sampler import Sampler, SamplingBatch, SamplingBatchBuilder

V = 97


def _requests() -> list[Request]:
    variants = [
        SamplingParams(temperature=0.0, max_tokens=64),
        SamplingParams(temperature=0.8, top_k=5, seed=11, max_tokens=64),
        SamplingParams(temperature=1.1, top_p=0.9, repetition_penalty=1.3, max_tokens=64),
        SamplingParams(temperature=0.7, frequency_penalty=0.5, presence_penalty=-0.4, min_p=0.05, max_tokens=64),
        SamplingParams(temperature=0.9, min_tokens=3, stop_token_ids=[4, 5], seed=3, logprobs=2, max_tokens=64),
        SamplingParams(temperature=0.0, repetition_penalty=0.8, min_tokens=2, max_tokens=64),
    ]
    rng = random.Random(0)
    return [Request(f"r{i}", [rng.randrange(V) for _ in range(rng.randint(1, 9))], p, eos_token_ids=(2,))
            for i, p in enumerate(variants)]


def _assert_equal(got: SamplingBatch, want: SamplingBatch) -> None:
    for field in dataclasses.fields(SamplingBatch):
        a, b = getattr(got, field.name), getattr(want, field.name)
        if isinstance(b, tuple):
            assert a is not None and all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), field.name
        elif isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), field.name
        else:
            assert a == b, field.name


def test_kept_batch_equals_a_fresh_one_every_step():
    reqs = _requests()
    builder = SamplingBatchBuilder(V)
    fresh_sampler, kept_sampler = Sampler(seed=5), Sampler(seed=5)
    gen = torch.Generator().manual_seed(0)
    batch = list(reqs)
    for step in range(14):
        if step == 5:
            batch = batch[1:]                  # a request left: a new composition
        if step == 8:
            batch = batch[::-1]                # same requests, another order: a new composition
        kept = builder.build(batch, "cpu")
        fresh = SamplingBatch.from_requests(batch, V, "cpu")
        _assert_equal(kept, fresh)
        logits = torch.randn(len(batch), V, generator=gen)
        a = kept_sampler.sample(logits, kept)
        b = fresh_sampler.sample(logits, fresh)
        assert torch.equal(a.sampled_token_ids, b.sampled_token_ids)
        for i, r in enumerate(batch):
            if step == 10 and i == 1:
                continue                       # this row gains no token (as after a preemption)
            r.append_output_token(int(a.sampled_token_ids[i]))
    assert builder.num_rebuilds == 3


def test_unchanged_plain_greedy_batches_are_reused():
    reqs = [Request(f"g{i}", [1, 2], SamplingParams(temperature=0.0, max_tokens=8)) for i in range(4)]
    builder = SamplingBatchBuilder(V)
    first = builder.build(reqs, "cpu")
    reqs[0].append_output_token(3)
    assert builder.build(reqs, "cpu") is first and first.all_greedy and first.batch_size == 4
    assert builder.build(reqs[:3], "cpu").batch_size == 3 and builder.num_rebuilds == 2


def test_counts_follow_the_tokens_on_each_device_separately():
    reqs = _requests()[2:4]                    # the penalty rows
    builder = SamplingBatchBuilder(V)
    for step in range(4):
        for device in ("cpu", "meta"):
            kept = builder.build(reqs, device)
            assert kept.output_counts is not None and kept.output_counts.device.type == device
        want = torch.zeros(len(reqs), V)
        for i, r in enumerate(reqs):
            for t in r.output_token_ids:
                want[i, t] += 1
        assert torch.equal(builder.build(reqs, "cpu").output_counts, want)
        for r in reqs:
            r.append_output_token(step * 7 % V)
