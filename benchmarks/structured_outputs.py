"""What a structured-output constraint costs: the same requests free and constrained, side by side.

    python benchmarks/structured_outputs.py --batch-sizes 1,8 --output-len 64

For each batch size, ``B`` chat requests (the default model unless ``--model``) run greedy to
``--output-len`` tokens (``ignore_eos``) three ways in one process, alternating: free text, a JSON
schema constraint and a regular expression; reported are output tokens per second, the share of each
constrained run's wall time spent computing the grammar masks (timed around
``plinth.core.structured.allowed_tokens``), and how many constrained outputs ended complete and valid.
The first constrained request of the process builds llguidance's tokenizer (about a second for a 49k
vocabulary); warm-up requests pay it, and the first call's costs, before timing.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from typing import Any

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"]}
REGEX = r"[A-Z][a-z]+( [a-z]+){3,12}\."


def run(llm: Any, batch: int, output_len: int, spec: dict | None, timer: dict[str, float]) -> dict[str, Any]:
    from plinth import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, structured_outputs=spec)
    conversations = [[{"role": "user", "content": f"Describe person number {i} in JSON with name, age and city."}]
                     for i in range(batch)]
    timer["mask_s"] = 0.0
    start = time.perf_counter()
    outs = llm.chat(conversations, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    valid = 0
    for o in outs:
        text = o.outputs[0].text
        if spec is None or o.outputs[0].finish_reason != "stop":
            continue
        if "json" in spec:
            try:
                valid += isinstance(json.loads(text), dict)
            except json.JSONDecodeError:
                pass
        else:
            valid += re.fullmatch(REGEX, text) is not None
    return {"tok_s": tokens / wall, "wall_s": wall, "tokens": tokens, "mask_share": timer["mask_s"] / wall,
            "complete_and_valid": valid}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model (default: plinth's default model)")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()

    from plinth import LLM, SamplingParams
    from plinth.core import sampling_batch, structured

    timer = {"mask_s": 0.0}
    original = structured.allowed_tokens

    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            timer["mask_s"] += time.perf_counter() - t

    sampling_batch.allowed_tokens = timed   # the name the sampling batch calls
    llm = LLM(a.model) if a.model else LLM()
    for spec in (None, {"json_object": True}):   # first-call costs (and llguidance's tokenizer) before timing
        llm.chat([[{"role": "user", "content": "warm up"}]] * 2, SamplingParams(max_tokens=4, structured_outputs=spec),
                 use_tqdm=False)
    results = []
    for batch in (int(b) for b in a.batch_sizes.split(",")):
        for r in range(a.rounds):
            for name, spec in (("free", None), ("json_schema", {"json": SCHEMA}), ("regex", {"regex": REGEX})):
                rec = {"batch": batch, "round": r, "constraint": name, **run(llm, batch, a.output_len, spec, timer)}
                print(json.dumps(rec), flush=True)
                results.append(rec)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
