"""Which digits of the arithmetic task's answers a model gets right: for each model directory (a
family member, a run's checkpoint `.../checkpoints/step_N/hf`), --samples answers at temperature
1 to each of the first --problems held-out problems, and per model:

- exact: the share of answers equal to the reference;
- length: the share with the reference's number of characters;
- first digit / last digit: the share whose first (last) character is the reference's;
- agreement: the share of problems whose samples are all the same answer (1.0: the policy is
  deterministic on every problem, whether right or wrong).

What it is for: telling a model that has not learnt a part of the task (a digit at chance, 0.1)
from one that is unsure of it, and seeing whether RL made a policy right or only certain.

    python scripts/answer_digits.py MODEL_DIR [MODEL_DIR ...] [--labels A,B,...] [--problems 200]
        [--samples 4] [--data .cache/arithmetic] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))


def digit_report(answers: list[list[str]], references: list[str]) -> dict:
    """The shares above, from each problem's sampled `answers` and its reference answer."""
    if len(answers) != len(references) or not references:
        raise ValueError(f"{len(answers)} problems' answers against {len(references)} references")
    flat = [(a, ref) for samples, ref in zip(answers, references, strict=True) for a in samples]
    n = len(flat)
    return {
        "exact": sum(a == ref for a, ref in flat) / n,
        "length": sum(len(a) == len(ref) for a, ref in flat) / n,
        "first_digit": sum(a[:1] == ref[:1] for a, ref in flat) / n,
        "last_digit": sum(a[-1:] == ref[-1:] for a, ref in flat) / n,
        "agreement": sum(len(set(samples)) == 1 for samples in answers) / len(answers),
    }


def sample_answers(model_dir: Path, problems: list[dict], samples: int, seed: int) -> list[list[str]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir).eval()  # its generate() is untyped
    torch.manual_seed(seed)
    answers = []
    with torch.no_grad():
        for problem in problems:
            ids = tokenizer(problem["prompt"], return_tensors="pt", add_special_tokens=False).input_ids
            out = model.generate(
                ids,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=8,
                num_return_sequences=samples,
                pad_token_id=tokenizer.pad_token_id,
            )
            answers.append([tokenizer.decode(o[ids.shape[1] :], skip_special_tokens=True) for o in out])
    return answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--labels", help="comma-separated names of the models in the rows (default: their paths)")
    parser.add_argument("--problems", type=int, default=200)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--data", type=Path, default=Path(os.environ.get("PIPELINE_RL_CACHE", ROOT / ".cache")) / "arithmetic"
    )
    parser.add_argument("--json", type=Path, help="also keep the rows in this JSON (a model's row replaced)")
    args = parser.parse_args()
    test = args.data / "test.jsonl"
    if not test.exists():
        parser.error(f"--data: {test} does not exist (build a family member or the tiny model first)")
    labels = args.labels.split(",") if args.labels else [str(m) for m in args.models]
    if len(labels) != len(args.models):
        parser.error(f"--labels: {len(labels)} labels for {len(args.models)} models")
    problems = [json.loads(line) for line in test.read_text().splitlines() if line.strip()][: args.problems]
    rows = []
    print("| model | exact | length | first digit | last digit | agreement |")
    print("| --- | --- | --- | --- | --- | --- |")
    for model_dir, label in zip(args.models, labels, strict=True):
        if not (model_dir / "config.json").exists():
            parser.error(f"{model_dir}: no config.json (a model directory, e.g. .cache/MEMBER or a checkpoint's hf/)")
        answers = sample_answers(model_dir, problems, args.samples, args.seed)
        report = digit_report(answers, [p["answer"] for p in problems])
        rows.append({"name": label, **report, "problems": len(problems), "samples": args.samples})
        print(f"| {label} | " + " | ".join(f"{report[k]:.3f}" for k in report) + " |", flush=True)
    if args.json:
        from bench_tables import keep

        keep(args.json, rows)
        print(f"kept in {args.json}")


if __name__ == "__main__":
    main()
