"""A custom architecture registered from an installed plugin package is found and run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

FIXTURE = Path(__file__).parent / "fixtures" / "plugin_packages" / "custom_model"

SCRIPT = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM
from plinth import LLM, SamplingParams
model_dir = sys.argv[1]
llm = LLM(model_dir, dtype="float32", block_size=4)
model = llm.engine.runner.model
ids = llm.get_tokenizer()("The quick brown fox").input_ids
out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, logprobs=1), use_tqdm=False)[0]
ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
with torch.no_grad():
    logits = ref(torch.tensor([ids])).logits[0, -1]
print(json.dumps({"cls": f"{type(model).__module__}.{type(model).__name__}",
                  "token": out.outputs[0].token_ids[0], "argmin": int(logits.argmin()),
                  "argmax": int(logits.argmax())}))
"""


def test_model_from_plugin_package(tmp_path):
    from conftest import save_tiny_model

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--no-index", "--disable-pip-version-check", "--target", str(site), str(FIXTURE)],
                   check=True, timeout=300)
    model_dir = save_tiny_model(tmp_path / "model")
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = ["NegatedLlamaForCausalLM"]
    cfg_path.write_text(json.dumps(cfg))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["cls"] == "plinth_test_custom_model.model.NegatedLlamaForCausalLM"
    assert result["token"] == result["argmin"] != result["argmax"]
