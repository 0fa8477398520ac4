"""Structured outputs (JSON schema, any JSON object, regex, choice, grammar) on a small random Llama.

References: every token of a constrained greedy output is checked against the float32 logits of the same
weights run by transformers, restricted to the tokens an independent llguidance matcher allows after the
tokens before it; the finished texts are checked against the constraint itself (``json.loads`` and the
schema's fields, ``re.fullmatch``, the list of choices).
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from plinth import LLM, SamplingParams
from plinth.core.request import Request
from plinth.core.sampler import Sampler, SamplingBatch
from plinth.core.scheduler import RequestRejectedError

PROMPT = "The quick brown fox"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", block_size=4)


def generate(llm: LLM, spec: dict, **kw) -> list:
    kw.setdefault("max_tokens", 48)
    return llm.generate([PROMPT], SamplingParams(structured_outputs=spec, **kw), use_tqdm=False)[0].outputs


def check_schema(text: str) -> bool:
    value = json.loads(text)
    assert set(value) == {"name", "age"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 6
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool) and value["age"] >= 0
    return True


def test_greedy_json_follows_the_grammar_and_the_reference_logits(llm, tiny_llama_dir):
    import llguidance
    import llguidance.hf
    import transformers

    out = generate(llm, {"json": SCHEMA}, temperature=0.0, max_tokens=40)[0]
    tokenizer = llm.get_tokenizer()
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    model = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    ll_tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=tokenizer.eos_token_id)
    matcher = llguidance.LLMatcher(ll_tok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA), log_level=0)
    ids = list(prompt_ids)
    with torch.no_grad():
        for token in out.token_ids:
            bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            allowed = torch.from_numpy(bits[:vocab].astype(bool))
            logits = model(torch.tensor([ids])).logits[0, -1]
            assert allowed[token], f"token {token} is outside the grammar after {ids[len(prompt_ids):]}"
            best = logits.masked_fill(~allowed, float("-inf")).max().item()
            assert logits[token].item() >= best - 1e-4, (token, logits[token].item(), best)
            assert matcher.consume_token(token)
            ids.append(token)
    if out.finish_reason == "stop":
        assert matcher.is_stopped() or matcher.is_accepting()
        check_schema(out.text)
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == 40


# SCHEMA with bounded values and compact JSON (llguidance's option): with free whitespace and an unbounded integer a
# random model can pad or count until it runs out of tokens, so whether it finishes depends on the draw
BOUNDED = {**SCHEMA, "properties": {**SCHEMA["properties"], "age": {"type": "integer", "minimum": 0, "maximum": 120}},
           "x-guidance": {"whitespace_flexible": False}}


@pytest.mark.parametrize("spec, check", [
    ({"json": BOUNDED}, check_schema),
    ({"json": json.dumps(BOUNDED)}, check_schema),
    ({"json_object": True}, lambda text: isinstance(json.loads(text), dict)),
    ({"regex": r"[0-9]{3}-[a-z]{2,4}"}, lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text)),
    ({"choice": ["yes", "no", "maybe not"]}, lambda text: text in ("yes", "no", "maybe not")),
    ({"grammar": 'start: "A" ("B" | "C")+ "D"'}, lambda text: re.fullmatch(r"A[BC]+D", text)),
    ({"grammar": 'root ::= "x" [0-9]+ "y"'}, lambda text: re.fullmatch(r"x[0-9]+y", text)),   # GBNF
])
def test_sampled_outputs_satisfy_each_kind_of_constraint(llm, spec, check):
    outs = generate(llm, spec, temperature=1.0, seed=7, n=4, max_tokens=64)
    assert len(outs) == 4
    finished = [o for o in outs if o.finish_reason == "stop"]
    kind = next(iter(spec))
    if kind != "json_object":   # bounded languages: a random model finishes them in 64 tokens
        assert len(finished) == 4, [(o.text, o.finish_reason) for o in outs]
    for o in outs:              # any JSON object may run out of tokens: then it was cut at the limit, inside an object
        assert o.finish_reason == "stop" or (o.finish_reason == "length" and len(o.token_ids) == 64
                                             and o.text.lstrip().startswith("{")), (o.text, o.finish_reason)
    eos = llm.get_tokenizer().eos_token_id
    for o in finished:
        assert check(o.text), o.text
        assert eos not in o.token_ids[:-1]   # EOS only ever ends the text


def test_constrained_and_free_requests_share_a_batch(llm):
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([PROMPT], free, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate([PROMPT, "Hello there"], [SamplingParams(temperature=0.0, max_tokens=12,
                                                                  structured_outputs={"choice": ["left", "right"]}),
                                                   free.clone()], use_tqdm=False)
    assert mixed[0].outputs[0].text in ("left", "right")
    assert mixed[1].outputs[0].token_ids == llm.generate(["Hello there"], free, use_tqdm=False)[0].outputs[0].token_ids
    assert len(alone) == 12


@pytest.mark.parametrize("spec, needle", [
    ({"regex": "("}, "regex"),
    ({"regex": "ab\\"}, "regex"),
    ({"regex": "\\"}, "regex"),
    ({"json": {"type": "nonsense"}}, "json"),
    ({"json": "{not json"}, "json"),
    ({"grammar": "start: undefined_rule"}, "grammar"),
])
def test_constraints_that_do_not_compile_are_rejected(llm, spec, needle):
    with pytest.raises(RequestRejectedError, match=f"structured_outputs: invalid {needle}"):
        generate(llm, spec)
    assert not llm.engine.has_unfinished_requests()


def test_vllm_class_forms(llm):
    """vLLM's ``StructuredOutputsParams`` (and its earlier name ``GuidedDecodingParams``) are the dict of the field
    set, and ``TokensPrompt`` / ``TextPrompt`` are the dict prompts; options of vLLM's own grammar backends are
    refused by name."""
    from plinth import GuidedDecodingParams, StructuredOutputsParams, TextPrompt, TokensPrompt

    spec = StructuredOutputsParams(choice=["yes", "no"])
    assert SamplingParams(structured_outputs=spec).structured_outputs == {"choice": ["yes", "no"]}
    assert GuidedDecodingParams is StructuredOutputsParams
    # vLLM's earlier keyword for the field
    assert SamplingParams(guided_decoding=GuidedDecodingParams(regex="a+")).structured_outputs == {"regex": "a+"}
    with pytest.raises(ValueError, match="guided_decoding: give structured_outputs or guided_decoding"):
        SamplingParams(guided_decoding={"regex": "a+"}, structured_outputs={"regex": "b"})
    ids = llm.get_tokenizer()(PROMPT)["input_ids"]
    params = SamplingParams(structured_outputs=spec, temperature=0, max_tokens=8)
    outs = llm.generate([TextPrompt(prompt=PROMPT), TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == [generate(llm, {"choice": ["yes", "no"]}, temperature=0,
                                                          max_tokens=8)[0].text] * 2
    assert outs[0].outputs[0].text in ("yes", "no")
    with pytest.raises(ValueError, match="disable_any_whitespace not supported"):
        SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True))
    with pytest.raises(ValueError, match="give exactly one of"):
        SamplingParams(structured_outputs=StructuredOutputsParams())


def test_malformed_specs_name_the_parameter():
    for bad in ({"json": 1}, {"regex": ""}, {"choice": []}, {"choice": ["a", 3]}, {"xml": "a"},
                {"regex": "a", "choice": ["b"]}, "json", {"json_object": "yes"},
                {"json": {"type": "number", "maximum": math.inf}}, {"json": {"enum": [math.nan]}}):
        with pytest.raises(ValueError, match="structured_outputs"):
            SamplingParams(structured_outputs=bad)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(structured_outputs={"regex": "a+"}, min_tokens=3)


def test_the_min_tokens_conflict_names_the_field_the_constraint_was_given_in():
    """``min_tokens`` with a constraint is refused naming the field the user gave it in, not always
    ``structured_outputs``."""
    from plinth.core.request import SamplingParamsError
    from plinth.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    def refusal(make, *args, **kwargs):
        with pytest.raises(SamplingParamsError) as info:
            make(*args, **kwargs)
        assert info.value.param == "min_tokens"
        return str(info.value)

    assert "combined with structured_outputs" in refusal(SamplingParams, structured_outputs={"regex": "a+"},
                                                         min_tokens=3)
    assert "combined with guided_decoding" in refusal(SamplingParams, guided_decoding={"regex": "a+"}, min_tokens=3)
    chat = [{"role": "user", "content": "hi"}]
    for field, value in (("response_format", {"type": "json_object"}), ("guided_regex", "a+"),
                         ("guided_choice", ["a", "b"]), ("structured_outputs", {"regex": "a+"})):
        for req in (CompletionRequest(prompt="x", min_tokens=2, **{field: value}),
                    ChatCompletionRequest(messages=chat, min_tokens=2, **{field: value})):
            assert f"min_tokens: cannot be combined with {field} " in refusal(req.sampling_params, 8, None)


def test_sampler_draws_only_allowed_tokens_in_proportion():
    """The mask sets disallowed logits to -inf before sampling: the draws follow the renormalised
    distribution over the allowed tokens (chi-square against the float64 probabilities)."""
    probs = np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.05])
    n = 3000
    reqs = [Request(f"r{i}", [1], SamplingParams(temperature=1.0, seed=i)) for i in range(n)]
    batch = SamplingBatch.from_requests(reqs, 6, "cpu")
    allowed = torch.tensor([False, True, True, False, True, False])
    batch.allowed = (torch.arange(n), allowed.expand(n, -1))
    logits = torch.from_numpy(np.log(probs)).float().expand(n, -1)
    counts = np.bincount(Sampler(seed=1).sample(logits, batch).sampled_token_ids.numpy(), minlength=6)
    assert counts[~allowed.numpy()].sum() == 0
    kept = probs[allowed.numpy()] / probs[allowed.numpy()].sum()
    observed = counts[allowed.numpy()]
    chi2 = float(((observed - kept * n) ** 2 / (kept * n)).sum())
    assert chi2 < 13.8, observed   # 2 degrees of freedom, the 0.999 quantile
    # greedy rows take the best allowed token
    greedy = SamplingBatch.from_requests([Request("g", [1], SamplingParams(temperature=0.0))], 6, "cpu")
    greedy.allowed = (torch.tensor([0]), allowed[None])
    assert Sampler().sample(logits[:1], greedy).sampled_token_ids.item() == 1
    assert math.isfinite(float(torch.log_softmax(logits[:1], -1)[0, 1]))


def test_long_choice_lists_and_stop_strings(llm):
    """A choice of thousands of strings compiles as one pattern (a grammar rule of that many alternatives
    exceeds llguidance's row limit); a stop string completed by the grammar's last token is still reported."""
    cities = [f"city{i}" for i in range(2500)]
    out = generate(llm, {"choice": cities}, temperature=1.0, seed=3, max_tokens=16)[0]
    assert out.text in cities and out.finish_reason == "stop"
    out = generate(llm, {"choice": ["yes"]}, temperature=0.0, max_tokens=8, stop=["es"])[0]
    assert out.text == "y" and out.finish_reason == "stop" and out.stop_reason == "es"


def test_a_matcher_failure_aborts_the_sequence_instead_of_passing_as_complete():
    from plinth.core.engine import LLMEngine
    from plinth.core.request import FinishReason

    class Failing:
        def consume_token(self, token):
            return False

        def is_error(self):
            return True

        def get_error(self):
            return "limit exceeded"

    class Done(Failing):
        def consume_token(self, token):
            return True

        def is_error(self):
            return False

        def is_stopped(self):
            return True

    req = Request("r", [1], SamplingParams())
    req.matcher = Failing()
    assert LLMEngine._grammar_state(req, 5) == FinishReason.ABORT
    req.matcher = Done()
    assert LLMEngine._grammar_state(req, 5) == FinishReason.STOP


def test_oversized_specs_are_refused():
    from plinth.core.structured import MAX_CHOICES, MAX_SPEC_CHARS

    for bad in ({"choice": ["a"] * (MAX_CHOICES + 1)}, {"regex": "a" * (MAX_SPEC_CHARS + 1)},
                {"json": {"enum": ["x" * MAX_SPEC_CHARS]}}):
        with pytest.raises(ValueError, match="more than"):
            SamplingParams(structured_outputs=bad)


def test_allowed_token_ids_restrict_every_step_to_the_reference_argmax(llm, tiny_llama_dir):
    """vLLM's allowed_token_ids: each greedy token is the best of the allowed ids under transformers'
    float32 logits; with a grammar too, only tokens both allow are drawn."""
    import transformers

    allowed = [5, 17, 40, 41, 42, 299]
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                allowed_token_ids=allowed), use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids) <= set(allowed)
    model = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    ids = llm.get_tokenizer()(PROMPT)["input_ids"]
    with torch.no_grad():
        for token in out.token_ids:
            logits = model(torch.tensor([ids])).logits[0, -1]
            assert logits[token].item() >= logits[allowed].max().item() - 1e-4
            ids.append(token)
    tok = llm.get_tokenizer()
    digits = [tok.convert_tokens_to_ids(c) for c in "0123456789"]
    digits = [t for t in digits if t is not None and t >= 0 and tok.decode([t]) in "0123456789"]
    keep = digits[:3]
    both = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=4, max_tokens=12, allowed_token_ids=keep,
                                                 structured_outputs={"regex": "[0-9]{3}"}), use_tqdm=False)[0]
    text = both.outputs[0].text
    assert re.fullmatch("[0-9]{3}", text) and set(text) <= {tok.decode([t]) for t in keep}, text
    with pytest.raises(RequestRejectedError, match="allowed_token_ids"):
        llm.generate([PROMPT], SamplingParams(allowed_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    # masks that leave no token at all are refused, not drawn from outside the allowed ids
    word = tok.decode([keep[0]]).strip()
    with pytest.raises(RequestRejectedError, match="every allowed token is banned by bad_words"):
        llm.generate([PROMPT], SamplingParams(allowed_token_ids=[keep[0]], bad_words=[word]), use_tqdm=False)
    eos = llm.engine.eos_token_ids[0]
    with pytest.raises(RequestRejectedError, match="every allowed token ends the sequence"):
        llm.generate([PROMPT], SamplingParams(allowed_token_ids=[eos], min_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_matchers_of_one_grammar_are_independent_copies(llm):
    """The engine keeps a prepared matcher per grammar and hands out copies: advancing one request's
    matcher leaves the next request's at the start."""
    first = llm.engine.grammar_matcher({"choice": ["alpha", "beta"]})
    second = llm.engine.grammar_matcher({"choice": ["alpha", "beta"]})
    assert first is not second
    tok = llm.get_tokenizer()
    assert first.consume_tokens(tok("alpha", add_special_tokens=False)["input_ids"])
    assert first.is_stopped() or first.is_accepting()
    assert not second.is_stopped() and not second.is_accepting()


def test_masks_that_leave_the_grammar_no_first_token_are_refused(llm):
    """allowed_token_ids or one-token bad_words that exclude every token the constraint accepts first: a
    RequestRejectedError naming the field (they ended "abort" with a token outside every set)."""
    tok = llm.get_tokenizer()
    digits = [tok.convert_tokens_to_ids(c) for c in "0123"]
    letters = [tok.convert_tokens_to_ids(c) for c in "abc"]
    cases = [(dict(allowed_token_ids=digits, structured_outputs={"regex": "[a-z]+"}), "allowed_token_ids"),
             (dict(bad_words=["x", "y"], structured_outputs={"choice": ["x", "y"]}), "bad_words")]
    for kw, field in cases:
        with pytest.raises(RequestRejectedError, match=f"^{field}: no token the structured output accepts first"):
            llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0, **kw), use_tqdm=False)
    # a set that leaves some first token runs, and only draws from it
    out = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0.0, allowed_token_ids=digits + letters,
                                                structured_outputs={"regex": "[a-z]+"}), use_tqdm=False)[0].outputs[0]
    assert out.token_ids and set(out.token_ids) <= set(letters) and out.finish_reason == "length"
    with pytest.raises(ValueError, match="json must hold JSON values only"):
        SamplingParams(structured_outputs={"json": {"enum": [{1, 2}]}})


def test_a_later_conflict_ends_without_the_refused_token(llm):
    """A mask that leaves the constraint no token only after the first one (choice "Hello" with allowed_token_ids
    holding just its first token): the sequence ends "abort" with the tokens the constraint accepted; the token
    it refused is neither returned nor counted, and the logprobs match the tokens."""
    tok = llm.get_tokenizer()
    ids = tok("Hello", add_special_tokens=False)["input_ids"]
    assert len(ids) >= 2
    for stream_params in ({}, {"logprobs": 1}):
        out = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0, allowed_token_ids=ids[:1],
                                                    structured_outputs={"choice": ["Hello"]}, **stream_params),
                           use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "abort"
        assert out.token_ids == ids[:1] and out.text == tok.decode(ids[:1])
        if stream_params:
            assert len(out.logprobs) == 1 and ids[0] in out.logprobs[0]


def test_bad_words_that_are_not_unicode_text_are_refused(llm):
    """A lone surrogate in bad_words (valid JSON escapes reach the server this way): a RequestRejectedError
    naming the field, not a tokenizer TypeError."""
    with pytest.raises(RequestRejectedError, match="^bad_words: a word is not valid Unicode text"):
        llm.generate([PROMPT], SamplingParams(max_tokens=2, bad_words=["\ud800"]), use_tqdm=False)


def test_a_text_completed_by_the_last_token_allowed_ends_with_stop(llm):
    """The constrained text completed by exactly the ``max_tokens``-th token ends with ``stop`` (the text ended it),
    not ``length``, as it does with room to spare; one token fewer is a prefix cut by the limit."""
    spec = {"choice": ["The quick brown fox jumps"]}
    free = generate(llm, spec, max_tokens=50, temperature=0.0)[0]
    assert free.text == "The quick brown fox jumps" and str(free.finish_reason) == "stop"
    n = len(free.token_ids)
    exact = generate(llm, spec, max_tokens=n, temperature=0.0)[0]
    assert (exact.text, str(exact.finish_reason)) == (free.text, "stop")
    short = generate(llm, spec, max_tokens=n - 1, temperature=0.0)[0]
    assert free.text.startswith(short.text) and str(short.finish_reason) == "length"
