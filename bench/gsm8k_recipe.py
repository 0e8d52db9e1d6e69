"""The GSM8K recipe (TRL on Arctic, one GPU) for a few steps at the Qwen3-1.7B shape: random bf16
weights, GSM8K-format questions generated here (no downloads), the recipe's own data preparation,
reward and H200 config. Prints each step's time and generated tokens per second; the last line is
a JSON object.

    STEPS=4 python3 bench/gsm8k_recipe.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recipes.gsm8k import prepare_data, train_trl
from shapes import QWEN3_1_7B, make_model
from trl_step import StepTimer


def gsm8k_release(folder: Path, count: int) -> Path:
    """GSM8K-format word problems with worked answers."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(count):
        a, b = 3 + i % 17, 5 + i % 23
        question = (f"Natalia sold clips to {a * 6} of her friends in April, and then she sold {b} more clips in May "
                    f"than in April. How many clips did Natalia sell altogether in April and May?")
        answer = f"In May she sold {a * 6} + {b} = {a * 6 + b} clips.\nAltogether {a * 12 + b}.\n#### {a * 12 + b}"
        lines.append(json.dumps({"question": question, "answer": answer}))
    for split in ("train", "test"):
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench/gsm8k_recipe.py measures a GPU; tests/recipe_tests runs the recipe on the CPU")
    work = Path(tempfile.mkdtemp(prefix="gsm8k-recipe-"))
    model = "/tmp/qwen3-1.7b-shape-arctic"
    make_model(model, QWEN3_1_7B)
    prepare_data.main(["--source", str(gsm8k_release(work / "gsm8k", 256)), "--out", str(work / "data")])
    timer = StepTimer()
    steps = int(os.environ.get("STEPS", 4))
    trainer = train_trl.main(["--model", model, "--data", str(work / "data"), "--out", str(work / "run"),
                              "--set", f"trl.max_steps={steps}", "--set", "trl.report_to=none",
                              "--set", "trl.save_strategy=no"], callbacks=[timer])
    logs = [h for h in trainer.state.log_history if "reward" in h]
    samples = 64
    lengths = [h.get("completions/mean_length", 0.0) for h in logs]
    steady = timer.steps[1:] or timer.steps
    print(json.dumps({"recipe": "gsm8k/trl_h200.yaml", "steps_s": [round(s, 2) for s in timer.steps],
                      "step_s_steady_mean": round(sum(steady) / len(steady), 2),
                      "completion_mean_tokens": [round(x, 1) for x in lengths],
                      "generated_tok_per_s_of_step": (round(samples * lengths[-1] / timer.steps[-1])
                                                      if lengths else None),
                      "reward": [round(h["reward"], 3) for h in logs]}), flush=True)


if __name__ == "__main__":
    main()
