"""Sampler against float64 references of the vLLM / OpenAI definitions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from plinth.core.request import Request, SamplingParams
from plinth.core.sampler import (
    Sampler,
    SamplingBatch,
    compute_prompt_logprobs,
    counter_uniform,
)

V = 64


def make(params: SamplingParams, prompt=(1, 2, 3), output=(), eos=(0,)) -> Request:
    r = Request("r", list(prompt), params, eos_token_ids=eos)
    for t in output:
        r.append_output_token(t)
    return r


def batch_of(reqs, vocab=V) -> SamplingBatch:
    return SamplingBatch.from_requests(reqs, vocab, "cpu")


def softmax64(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x[np.isfinite(x)].max())
    e[~np.isfinite(x)] = 0.0
    return e / e.sum()


# ------------------------------------------------------------------ filters

def reference_kept(logits: np.ndarray, temp: float, min_p: float, top_k: int, top_p: float) -> np.ndarray:
    """Float64 kept-token mask: temperature, min-p, top-k, top-p (vLLM order)."""
    x = logits.astype(np.float64) / temp
    probs = softmax64(x)
    x = np.where(probs < min_p * probs.max(), -np.inf, x)
    if 0 < top_k < len(x):
        kth = np.sort(x)[::-1][top_k - 1]
        x = np.where(x < kth, -np.inf, x)
    if top_p < 1:
        probs = softmax64(x)
        order = np.argsort(-probs)
        before = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])   # mass of strictly better tokens
        drop = order[before >= top_p]
        x[drop] = -np.inf
    return np.isfinite(x)


def safe_top_p(logits: np.ndarray, temp: float, min_p: float, top_k: int, rng) -> float:
    """A top_p halfway between two cumulative masses, so float32 cannot flip the decision."""
    x = logits.astype(np.float64) / temp
    probs = softmax64(x)
    x = np.where(probs < min_p * probs.max(), -np.inf, x)
    if 0 < top_k < len(x):
        x = np.where(x < np.sort(x)[::-1][top_k - 1], -np.inf, x)
    p = np.sort(softmax64(x))[::-1]
    cum = np.cumsum(p)
    candidates = [j for j in range(len(p) - 1) if p[j + 1] > 1e-3]
    if not candidates:
        return 1.0
    j = int(rng.choice(candidates))
    return float((cum[j] + cum[j + 1]) / 2)


def safe_min_p(logits: np.ndarray, temp: float, rng) -> float:
    ratios = np.sort(softmax64(logits.astype(np.float64) / temp))[::-1]
    ratios = ratios / ratios[0]
    j = int(rng.integers(0, 12))
    return float((ratios[j] + ratios[j + 1]) / 2)


@pytest.mark.parametrize("seed", range(4))
def test_top_k_top_p_min_p_keep_exactly_the_reference_sets(seed):
    rng = np.random.default_rng(seed)
    B = 24
    logits = rng.normal(0, 2.0, size=(B, V)).astype(np.float32)
    reqs, expect = [], []
    for i in range(B):
        temp = float(rng.choice([0.5, 1.0, 1.7]))
        use = i % 8   # bit 0: min_p, bit 1: top_k, bit 2: top_p
        min_p = safe_min_p(logits[i], temp, rng) if use & 1 else 0.0
        top_k = int(rng.integers(1, 20)) if use & 2 else 0
        top_p = safe_top_p(logits[i], temp, min_p, top_k, rng) if use & 4 else 1.0
        reqs.append(make(SamplingParams(temperature=temp, min_p=min_p, top_k=top_k, top_p=top_p)))
        expect.append(reference_kept(logits[i], temp, min_p, top_k, top_p))
    _, filtered = Sampler().process_logits(torch.from_numpy(logits), batch_of(reqs))
    kept = torch.isfinite(filtered).numpy()
    for i in range(B):
        assert (kept[i] == expect[i]).all(), f"row {i}: {np.flatnonzero(kept[i])} vs {np.flatnonzero(expect[i])}"
    # the surviving logits are the tempered ones, untouched
    temps = np.array([r.sampling_params.temperature for r in reqs], dtype=np.float32)[:, None]
    np.testing.assert_allclose(filtered.numpy()[kept], (logits / temps)[kept], rtol=1e-6)


def test_top_k_only_path_keeps_ties_and_handles_mixed_rows():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 0.5], [1.0, 3.0, 3.0, 2.0, 0.5], [5, 4, 3, 2, 1.0]])
    reqs = [make(SamplingParams(top_k=2)), make(SamplingParams(top_k=0)), make(SamplingParams(top_k=1))]
    _, filtered = Sampler().process_logits(logits, batch_of(reqs, vocab=5))
    assert torch.isfinite(filtered).tolist() == [
        [False, True, True, False, False], [True] * 5, [True, False, False, False, False]]


def test_sampling_only_picks_kept_tokens():
    torch.manual_seed(0)
    logits = torch.randn(8, V)
    reqs = [make(SamplingParams(temperature=1.0, top_k=3, seed=s)) for s in range(4)] + \
           [make(SamplingParams(temperature=2.0, top_p=0.3)) for _ in range(4)]
    batch = batch_of(reqs)
    sampler = Sampler(seed=1)
    _, filtered = sampler.process_logits(logits, batch)
    for _ in range(20):
        tokens = sampler.sample(logits, batch).sampled_token_ids
        assert torch.isfinite(filtered[torch.arange(8), tokens]).all()


# ------------------------------------------------------------------ greedy and penalties

def test_greedy_is_argmax_and_ignores_other_rows():
    torch.manual_seed(1)
    logits = torch.randn(6, V)
    reqs = [make(SamplingParams(temperature=0.0 if i % 2 == 0 else 1.5, top_k=4)) for i in range(6)]
    tokens = Sampler().sample(logits, batch_of(reqs)).sampled_token_ids
    for i in range(0, 6, 2):
        assert tokens[i].item() == int(np.argmax(logits[i].double().numpy()))
    alone = Sampler().sample(logits[:1], batch_of(reqs[:1])).sampled_token_ids
    assert alone.item() == tokens[0].item()


def reference_penalised(logits, prompt, output, rep, freq, pres):
    x = logits.astype(np.float64).copy()
    counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=len(x)).astype(np.float64)
    seen = counts > 0
    seen[list(prompt)] = True
    x[seen] = np.where(x[seen] > 0, x[seen] / rep, x[seen] * rep)
    return x - freq * counts - pres * (counts > 0)


def test_penalties_follow_the_openai_and_ctrl_definitions():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 3, size=(5, V)).astype(np.float32)
    cases = [
        ((1, 2, 3), (4, 4, 5), 1.0, 0.0, 0.0),
        ((1, 2, 3), (4, 4, 5, 1), 1.5, 0.0, 0.0),
        ((7, 7, 9), (9, 10, 10, 10), 1.0, 0.7, 0.0),
        ((7,), (11, 11, 12), 1.0, 0.0, -1.2),
        ((3, 20, 21), (20, 20, 22, 3, 3, 3), 0.8, 0.5, 1.1),
    ]
    reqs = [make(SamplingParams(temperature=0.0, repetition_penalty=rep, frequency_penalty=freq,
                                presence_penalty=pres), prompt, output)
            for prompt, output, rep, freq, pres in cases]
    penalised, _ = Sampler().process_logits(torch.from_numpy(logits), batch_of(reqs))
    for i, (prompt, output, rep, freq, pres) in enumerate(cases):
        ref = reference_penalised(logits[i], prompt, output, rep, freq, pres)
        np.testing.assert_allclose(penalised[i].numpy(), ref, rtol=1e-6, atol=1e-6)
    # greedy follows the penalised logits
    tokens = Sampler().sample(torch.from_numpy(logits), batch_of(reqs)).sampled_token_ids
    for i, case in enumerate(cases):
        assert tokens[i].item() == int(np.argmax(reference_penalised(logits[i], *case)))


@pytest.mark.parametrize("temperature, repetition_penalty", [(1e39, 1.0), (1.0, 1e-50), (0.0, 1e-50), (1.0, 1e-40)])
def test_extreme_temperatures_and_repetition_penalties_keep_the_masks(temperature, repetition_penalty):
    """A temperature or repetition penalty that is finite but beyond float32 (or below its smallest normal
    number) still samples only allowed tokens: no factor of inf or 0 turns the masked logits into NaN."""
    logits = torch.from_numpy(np.random.default_rng(0).normal(0, 3, size=(1, V)).astype(np.float32))
    reqs = [make(SamplingParams(temperature=temperature, repetition_penalty=repetition_penalty, seed=i,
                                allowed_token_ids=[5, 6, 7]), prompt=(1, 2, 5, 9)) for i in range(40)]
    tokens = Sampler(seed=1).sample(logits.expand(len(reqs), -1).clone(), batch_of(reqs)).sampled_token_ids
    assert set(tokens.tolist()) <= {5, 6, 7}, tokens.tolist()
    if repetition_penalty < 1:
        assert set(tokens.tolist()) == {5}   # the one allowed token already seen, as the penalty's limit has it


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(4, V)
    logits[:, 0] = 10.0    # EOS
    logits[:, 5] = 9.0     # a stop id
    greedy = dict(temperature=0.0, stop_token_ids=[5])
    reqs = [
        make(SamplingParams(min_tokens=2, **greedy), output=(9,)),                    # 1 < 2: masked
        make(SamplingParams(min_tokens=2, **greedy), output=(9, 9)),                  # reached
        make(SamplingParams(min_tokens=2, ignore_eos=True, **greedy), output=(9,)),   # EOS not a stop
        make(SamplingParams(**greedy)),
    ]
    penalised, _ = Sampler().process_logits(logits, batch_of(reqs))
    assert math.isinf(penalised[0, 0]) and math.isinf(penalised[0, 5])
    assert not torch.isinf(penalised[1:, 0]).any()
    assert torch.isinf(penalised[:, 5]).tolist() == [True, False, True, False]
    assert Sampler().sample(logits, batch_of(reqs)).sampled_token_ids.tolist() == [1, 0, 0, 0]


def test_logit_bias_is_added_before_penalties_greedy_and_filters():
    """OpenAI's logit_bias: the value is added to the token's logit before the repetition (CTRL) penalty,
    so a biased seen token is divided/multiplied after the bias (vLLM's order); rows without a bias, and
    the raw logprobs, are untouched. Checked against a float64 computation of the same definition."""
    rng = np.random.default_rng(11)
    logits = rng.normal(0, 3, size=(4, V)).astype(np.float32)
    biases = [{5: 100.0, 6: -3.5}, None, {0: -100, 63: 2.25}, {7: 1.5}]
    reps = [1.0, 1.0, 1.0, 1.3]
    prompt, output = (1, 7), (7, 9)
    reqs = [make(SamplingParams(temperature=0.0, logit_bias=b, repetition_penalty=rep, logprobs=2), prompt, output)
            for b, rep in zip(biases, reps, strict=True)]
    out = Sampler().sample(torch.from_numpy(logits), batch_of(reqs))
    penalised, _ = Sampler().process_logits(torch.from_numpy(logits), batch_of(reqs))
    for i, (bias, rep) in enumerate(zip(biases, reps, strict=True)):
        x = logits[i].astype(np.float64).copy()
        for token, value in (bias or {}).items():
            x[token] += value
        ref = reference_penalised(x, prompt, output, rep, 0.0, 0.0)
        np.testing.assert_allclose(penalised[i].numpy(), ref, rtol=1e-6, atol=1e-5)
        assert out.sampled_token_ids[i].item() == int(np.argmax(ref))
    assert out.sampled_token_ids[0].item() == 5
    # logprobs stay those of the raw logits (vLLM's default)
    raw = torch.log_softmax(torch.from_numpy(logits).double(), dim=-1)
    assert torch.allclose(out.logprobs.logprobs[:, 0].double(), raw.gather(1, out.sampled_token_ids[:, None])[:, 0],
                          atol=1e-5)
    # random rows draw from softmax((logits + bias) / T): a -100 bias removes a token in practice
    n = 2000
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    hot = torch.from_numpy(np.log(probs)).float().expand(n, -1)
    reqs = [make(SamplingParams(temperature=1.0, seed=s, logit_bias={0: -100.0, 3: math.log(3.0)})) for s in range(n)]
    counts = np.bincount(Sampler().sample(hot, batch_of(reqs, vocab=4)).sampled_token_ids.numpy(), minlength=4)
    expected = np.array([0.0, 0.3, 0.2, 0.3]) / 0.8
    assert counts[0] == 0
    # 2 degrees of freedom: 13.8 is the 0.999 quantile
    assert chi_square(counts[1:], expected[1:]) < 13.8, counts


def test_uniform_noise_stays_strictly_inside_the_unit_interval():
    """The seeded rows' noise -log(u) must be positive: u == 1 would make a zero-probability token's
    p / noise NaN, and argmax picks NaN (a token the filters or a grammar had removed)."""
    from plinth.core.sampler import unit_interval

    bits = torch.tensor([0, 1, 511, 512, 2**31, 2**32 - 512, 2**32 - 1], dtype=torch.int64)
    u = unit_interval(bits)
    assert (u > 0).all() and (u < 1).all()
    assert u[-1].item() == (2**23 - 0.5) / 2**23 and u[0].item() == 0.5 / 2**23
    noise = -torch.log(u)
    probs = torch.tensor([0.0, 1.0]).expand(len(bits), 2)
    assert ((probs / noise[:, None]).argmax(dim=-1) == 1).all()


def test_logit_bias_validation_names_the_field():
    assert SamplingParams(logit_bias={"12": 3, 4: -100}).logit_bias == {12: 3.0, 4: -100.0}
    assert SamplingParams(logit_bias={}).logit_bias is None
    for bad in ({"x": 1}, {-1: 1}, {1: 100.5}, {1: float("nan")}, {1: "a"}, [1, 2], {True: 1}, {"\u00b2": 1},
                {"\u0663": 1}, {"9" * 5000: 1}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


# ------------------------------------------------------------------ seeds

def generate(sampler: Sampler, logits_fn, reqs, steps: int):
    """Run ``steps`` sampling steps over ``reqs``, appending the sampled tokens."""
    for _ in range(steps):
        logits = torch.stack([logits_fn(r.all_token_ids) for r in reqs])
        tokens = sampler.sample(logits, batch_of(reqs)).sampled_token_ids.tolist()
        for r, t in zip(reqs, tokens, strict=True):
            r.append_output_token(t)


def fake_logits(tokens: list[int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(tuple(tokens)) % (2**31))
    return torch.randn(V, generator=g) * 1.5


def test_seeded_sampling_is_independent_of_the_batch():
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone = make(params)
    generate(Sampler(seed=0), fake_logits, [alone], 12)
    others = [make(SamplingParams(temperature=0.9, seed=s)) for s in (1, 2)] + \
             [make(SamplingParams(temperature=1.3)), make(SamplingParams(temperature=0.0))]
    crowd = [others[0], others[1], make(params), others[2], others[3]]
    generate(Sampler(seed=99), fake_logits, crowd, 12)
    assert crowd[2].output_token_ids == alone.output_token_ids
    other_seed = make(params.clone(seed=4321))
    generate(Sampler(seed=0), fake_logits, [other_seed], 12)
    assert other_seed.output_token_ids != alone.output_token_ids


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("seeded", [True, False])
def test_samples_follow_the_distribution(seeded):
    probs = np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02])
    logits = torch.from_numpy(np.log(probs)).float()
    n = 4000
    reqs = [make(SamplingParams(temperature=1.0, seed=s if seeded else None)) for s in range(n)]
    tokens = Sampler(seed=5).sample(logits.expand(n, -1), batch_of(reqs, vocab=7)).sampled_token_ids
    counts = np.bincount(tokens.numpy(), minlength=7)
    # 6 degrees of freedom: 22.46 is the 0.999 quantile
    assert chi_square(counts, probs) < 22.46, counts


def test_counter_uniform_is_a_pure_function_of_the_key():
    keys = torch.tensor([[1, 2], [1, 2], [1, 3]], dtype=torch.int64)
    u = counter_uniform(keys, 5000)
    assert torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005


# ------------------------------------------------------------------ logprobs

def test_logprobs_are_of_the_raw_logits():
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 2, size=(3, V)).astype(np.float32)
    reqs = [
        make(SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.3, logprobs=3, seed=1), output=(4, 5)),
        make(SamplingParams(temperature=0.0, logprobs=0)),
        make(SamplingParams(temperature=1.0)),
    ]
    batch = batch_of(reqs)
    out = Sampler().sample(torch.from_numpy(logits), batch)
    assert out.logprobs is not None
    ref = logits.astype(np.float64)
    ref = ref - ref.max(axis=1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(axis=1, keepdims=True))
    tokens = out.sampled_token_ids.tolist()
    entries = out.logprobs.to_position_logprobs(batch.num_logprobs)
    for row, num in enumerate([3, 0]):
        entry = entries[row]
        t = tokens[row]
        assert entry[t].logprob == pytest.approx(ref[row, t], abs=1e-5)
        assert entry[t].rank == 1 + int((ref[row] > ref[row, t]).sum())
        top = np.argsort(-ref[row])[:num]
        assert set(entry) == set(top.tolist()) | {t}
        for rank, tok in enumerate(top, start=1):
            assert entry[int(tok)].logprob == pytest.approx(ref[row, tok], abs=1e-5)
            assert entry[int(tok)].rank == rank
    assert entries[2] is None


def test_prompt_logprobs_helper():
    rng = np.random.default_rng(8)
    logits = rng.normal(0, 2, size=(5, V)).astype(np.float32)
    prompt = [3, 9, 1, 44, 2, 7]
    lp = compute_prompt_logprobs(torch.from_numpy(logits), prompt[1:], 2)
    ref = logits.astype(np.float64)
    ref = ref - np.log(np.exp(ref).sum(axis=1, keepdims=True))
    entries = lp.to_position_logprobs([2] * 5)
    for i, target in enumerate(prompt[1:]):
        assert entries[i][target].logprob == pytest.approx(ref[i, target], abs=1e-5)
        assert entries[i][target].rank == 1 + int((ref[i] > ref[i, target]).sum())
        top2 = np.argsort(-ref[i])[:2].tolist()
        assert set(entries[i]) == set(top2) | {target}


def test_cpu_draws_never_pick_dropped_tokens_and_follow_the_rest():
    """The CPU's inverse-CDF draw: tokens of probability 0 (filtered: at either end and inside) are never
    picked, and the kept ones follow their probabilities."""
    probs = np.array([0.0, 0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    logits = torch.from_numpy(np.log(np.where(probs > 0, probs, 1.0))).float()
    logits[torch.from_numpy(probs == 0)] = float("-inf")
    n = 6000
    reqs = [make(SamplingParams(temperature=1.0)) for _ in range(n)]
    tokens = Sampler(seed=11).sample(logits.expand(n, -1), batch_of(reqs, vocab=7)).sampled_token_ids
    counts = np.bincount(tokens.numpy(), minlength=7)
    assert counts[probs == 0].sum() == 0, counts
    kept = probs > 0
    # 2 degrees of freedom: 13.82 is the 0.999 quantile
    assert chi_square(counts[kept], probs[kept]) < 13.82, counts


def test_logprobs_of_more_tokens_than_the_vocabulary_has():
    """A request may ask for more top logprobs than a small vocabulary holds: it gets them all."""
    from plinth.core.sampler import gather_logprobs

    lps = torch.log_softmax(torch.randn(2, 5, dtype=torch.float64), -1)
    out = gather_logprobs(lps, torch.tensor([0, 3]), 8).to_position_logprobs([8, 8])
    assert [sorted(row) for row in out] == [[0, 1, 2, 3, 4]] * 2
    assert out[1][3].logprob == pytest.approx(lps[1, 3].item())


def torch_inverse_cdf(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The sampler's torch draw on the CPU: float32 softmax of logits / T, float64 running sum, searchsorted."""
    probs = (logits.to(torch.float32) / temperature.unsqueeze(1)).softmax(dim=-1)
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    picks = torch.searchsorted(cdf, uniforms.reshape(-1, 1) * cdf[:, -1:], right=True)[:, 0]
    return picks.clamp(max=logits.shape[1] - 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [7, 1000, 49157])
def test_native_cpu_draw_is_the_inverse_cdf(dtype, vocab):
    """``cpu_native.sample_rows`` is the inverse CDF: against a float64 softmax, each pick's cumulative sum
    brackets ``u`` up to float32 rounding, and it is the torch path's pick for all but rounding-boundary rows;
    peaked and flat rows, temperatures from 0.3 to 2, tokens of probability 0 (-inf) inside and at both ends
    (never picked), uniforms at 0 and just below 1 (the first and the last token with a probability),
    vocabularies around the 16-lane and 1024-token chunks; a row of NaN logits gets the last token, as the
    clamped search gives."""
    from plinth.kernels import cpu_native

    if not cpu_native.sampling_enabled(torch.zeros(1, dtype=dtype)):
        pytest.skip("native CPU ops unavailable")
    gen = torch.Generator().manual_seed(vocab)
    rows = 24
    logits = torch.randn(rows, vocab, generator=gen) * torch.linspace(0.5, 8.0, rows).unsqueeze(1)
    logits[3, : vocab // 3] = float("-inf")
    logits[4, vocab // 2:] = float("-inf")
    logits[5, ::2] = float("-inf")
    logits = logits.to(dtype)
    temperature = torch.linspace(0.3, 2.0, rows)
    uniforms = torch.rand(rows, generator=gen, dtype=torch.float64)
    uniforms[0], uniforms[1], uniforms[4], uniforms[5] = 0.0, 1 - 2 ** -53, 0.0, 1 - 2 ** -53
    picks = cpu_native.sample_rows(logits, temperature, uniforms)
    cdf = (logits.double() / temperature.double().unsqueeze(1)).softmax(dim=-1).cumsum(dim=-1)
    at = cdf.gather(1, picks.unsqueeze(1))[:, 0]
    before = torch.where(picks > 0, cdf.gather(1, (picks - 1).clamp(min=0).unsqueeze(1))[:, 0], torch.zeros(rows).double())
    assert (at >= uniforms - 1e-6).all() and (before <= uniforms + 1e-6).all()
    assert (picks == torch_inverse_cdf(logits, temperature, uniforms)).sum() >= rows - 2
    finite = torch.isfinite(logits.float())
    assert finite.gather(1, picks.unsqueeze(1)).all()
    assert picks[4] == int(finite[4].nonzero()[0]) and picks[5] == int(finite[5].nonzero()[-1])
    nan_row = torch.full((1, vocab), float("nan"), dtype=dtype)
    assert cpu_native.sample_rows(nan_row, torch.ones(1), torch.full((1,), 0.5, dtype=torch.float64)).item() == vocab - 1


def test_native_cpu_draw_leaves_the_sampler_s_tokens_unchanged(monkeypatch):
    """A CPU batch with nothing but temperatures takes the native draw: the same tokens as the torch path from the
    same sampler seed (no uniform of this data lies within rounding of a boundary), with greedy and seeded rows in
    the batch; a batch with a filter keeps the torch path."""
    from plinth.core import sampler as sampler_module
    from plinth.kernels import cpu_native

    if not cpu_native.sampling_enabled(torch.zeros(1)):
        pytest.skip("native CPU ops unavailable")
    reqs = [make(SamplingParams(temperature=t, seed=s)) for t, s in
            [(1.0, None), (0.7, None), (0.0, None), (1.3, 42), (1.0, None), (0.5, 7)]]
    gen = torch.Generator().manual_seed(3)
    logits = [torch.randn(len(reqs), 3000, generator=gen) * 4 for _ in range(20)]
    calls = []
    native = cpu_native.sample_rows
    monkeypatch.setattr(cpu_native, "sample_rows", lambda *a: calls.append(1) or native(*a))

    def tokens(sampler: Sampler, batch: SamplingBatch) -> list[list[int]]:
        return [sampler.sample(x, batch).sampled_token_ids.tolist() for x in logits]

    fast = tokens(Sampler(seed=9), batch_of(reqs, vocab=3000))
    assert len(calls) == len(logits)
    enabled = cpu_native.sampling_enabled
    monkeypatch.setattr(sampler_module.cpu_native, "sampling_enabled", lambda x: False)
    assert tokens(Sampler(seed=9), batch_of(reqs, vocab=3000)) == fast
    assert len(calls) == len(logits)
    monkeypatch.setattr(sampler_module.cpu_native, "sampling_enabled", enabled)
    calls.clear()
    Sampler(seed=9).sample(logits[0], batch_of(reqs, vocab=3000))
    assert calls
    calls.clear()
    filtered = [make(SamplingParams(temperature=1.0, top_k=5))] + reqs[1:]
    for x in logits[:2]:
        Sampler(seed=9).sample(x, batch_of(filtered, vocab=3000))
    assert not calls
