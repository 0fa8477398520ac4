"""bitsandbytes checkpoints on an accelerator: plinth's reader widens the quantized weights on the device it loads
to; this checks that the tokens and log-probabilities there equal the CPU's.

Two steps, because the machine with the accelerator may lack bitsandbytes:

    python benchmarks/bnb_device_check.py make DIR    # CPU, with transformers + bitsandbytes: writes NF4 (nested),
                                                      # FP4 and 8-bit checkpoints of a small random Llama into DIR,
                                                      # and plinth's float32 greedy tokens and logprobs on the CPU
    python benchmarks/bnb_device_check.py check DIR   # the device: the same runs, compared (float32: every token
                                                      # equal and logprobs within 1e-3; bfloat16: printed)

Exit status 1 when a float32 run differs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

KINDS = {"nf4-double": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
         "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
         "int8": dict(load_in_8bit=True)}
PROMPTS = ["hello world the", "a b c d e f", "once upon a time there", "the quick brown fox"]
MAX_TOKENS = 24


def _run(path: Path, dtype: str, platform: str) -> list[dict]:
    from plinth import LLM, SamplingParams

    with LLM(str(path), dtype=dtype, platform=platform) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=1, ignore_eos=True),
                            use_tqdm=False)
    return [dict(ids=list(o.outputs[0].token_ids),
                 logprobs=[pos[t].logprob for pos, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids,
                                                         strict=True)])
            for o in outs]


def make(root: Path) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import torch
    import transformers
    from conftest import save_tiny_model

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    base = save_tiny_model(root / "base", hidden_size=256, intermediate_size=512)
    refs = {}
    for kind, options in KINDS.items():
        config = transformers.BitsAndBytesConfig(bnb_4bit_compute_dtype=torch.float32, **options)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(base), quantization_config=config,
                                                                  device_map="cpu", dtype=torch.float32)
        model.save_pretrained(str(root / kind))
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (base / name).exists():
                shutil.copy(base / name, root / kind / name)
        refs[kind] = _run(root / kind, "float32", "cpu")
    (root / "cpu_reference.json").write_text(json.dumps(refs))
    print(f"wrote {', '.join(KINDS)} checkpoints and the CPU reference into {root}")


def check(root: Path, platform: str | None) -> int:
    refs = json.loads((root / "cpu_reference.json").read_text())
    bad = 0
    for kind, ref in refs.items():
        for dtype in ("float32", "bfloat16"):
            got = _run(root / kind, dtype, platform)
            same = total = 0
            err = 0.0
            for g, r in zip(got, ref, strict=True):
                k = next((i for i, (a, b) in enumerate(zip(g["ids"], r["ids"], strict=True)) if a != b), len(g["ids"]))
                same, total = same + k, total + len(g["ids"])
                err = max([err, *(abs(a - b) for a, b in zip(g["logprobs"][:k], r["logprobs"][:k], strict=True))])
            print(f"{kind} {dtype}: tokens equal up to each prompt's first difference {same}/{total}, "
                  f"max |logprob difference| before it {err:.2e}")
            bad += dtype == "float32" and (same != total or err > 1e-3)
    print("float32 equal to the CPU:", "no" if bad else "yes")
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=["make", "check"])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--platform", default=None, help="check: the platform to run on (default: the best there)")
    args = parser.parse_args()
    if args.step == "make":
        make(args.dir)
        return 0
    return check(args.dir, args.platform)


if __name__ == "__main__":
    sys.exit(main())
