"""TRL's GRPOTrainer on a tiny task, for scripts/bench_learning.py: the same model, training and
held-out problems, reward (the domain's own `score`: arithmetic for `conf=tiny`, multistep for
`conf=tiny_long`), completion length and evaluation as the pipeline_rl run, with TRL's own
defaults for the rest (DAPO loss, 8 completions per prompt, 64 per step; no vLLM, no reference
model) except the learning rate (5e-5), bounded by wall time.

    python scripts/bench_trl.py --model DIR --data DIR --budget-s 600 --out RUN_DIR [--seed 0]
        [--domain arithmetic] [--max-new-tokens 8]

Needs the `bench` extra (`bash scripts/setup_cpu.sh --bench`); TRL is never a dependency of
pipeline_rl itself. Writes RUN_DIR/metrics/trl.jsonl in pipeline_rl's metrics format:
"eval/reward" (one sample at T=1 on each of the first 200 test problems, every 20 s of wall
time, timed in the run's wall clock, evaluation included; the budget counts from --started-at,
the moment bench_learning started the command) and per-step "reward_mean",
"rollouts_per_s", "version" (optimizer steps) and "compute_s".
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time
from pathlib import Path
from typing import Any

# Every core the process may use, as pipeline_rl's processes share them all: on 2 cores TRL made
# 1.43x (family_char_base) and 1.17x (family_byte_small) the steps/s of one thread.
os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

COMPLETIONS_PER_STEP = 64
GENERATIONS = 8
EVAL_PROBLEMS = 200
EVAL_EVERY_S = 20.0


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True, help="directory of train.jsonl and test.jsonl")
    parser.add_argument("--budget-s", type=float, default=600.0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--started-at", type=float, default=None, help="epoch seconds the budget counts from (default: now)"
    )
    parser.add_argument(
        "--domain", default="arithmetic", help="a built-in domain with a score(): arithmetic, multistep"
    )
    parser.add_argument("--max-new-tokens", type=int, default=8)
    opts = parser.parse_args()
    started = opts.started_at if opts.started_at is not None else time.time()

    import torch

    # The `bench` extra: not installed where only pipeline_rl's own checks run.
    from datasets import Dataset  # pyright: ignore[reportMissingImports]
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer  # pyright: ignore[reportMissingImports]

    from pipeline_rl.demo.tiny_model import sampled_reward

    score = importlib.import_module(f"pipeline_rl.rollouts.domains.{opts.domain}").score
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    tokenizer = AutoTokenizer.from_pretrained(opts.model)
    model: Any = AutoModelForCausalLM.from_pretrained(opts.model, dtype=torch.float32)
    eos = tokenizer.eos_token_id
    train = read_jsonl(opts.data / "train.jsonl")
    test = read_jsonl(opts.data / "test.jsonl")[:EVAL_PROBLEMS]
    metrics_dir = opts.out / "metrics"
    metrics_dir.mkdir(parents=True, exist_ok=True)
    sink = open(metrics_dir / "trl.jsonl", "w")

    def log(values: dict, step: int) -> None:
        record = {"process": "trl", "time": time.time(), "values": values, "step": step, "kind": "metrics"}
        sink.write(json.dumps(record) + "\n")
        sink.flush()

    def reward(ids: list[int], answer: str) -> float:
        # TRL cuts completion_ids after the first EOS and keeps it: EOS last means it stopped.
        stopped = bool(ids) and ids[-1] == eos
        text = tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=True)
        return score(text, "stop" if stopped else "length", answer)

    def reward_fn(prompts, completions, completion_ids, answer, **kwargs) -> list[float | None]:
        return [reward(ids, a) for ids, a in zip(completion_ids, answer)]

    def evaluate() -> float:
        was_training = model.training
        model.eval()
        reward_mean = sampled_reward(model, tokenizer, test, score, opts.max_new_tokens)
        model.train(was_training)
        return reward_mean

    class Clock(TrainerCallback):
        """Evaluates every EVAL_EVERY_S, logs each step, stops at the budget."""

        def __init__(self) -> None:
            self.start = self.last_eval = self.step_start = 0.0

        def _eval(self, step: int) -> None:
            log({"eval/reward": evaluate(), "eval/version": step}, step)
            self.last_eval = time.time()

        def on_train_begin(self, args, state, control, **kwargs):
            # The budget counts from the command's start, as launch.py's max_time_s does:
            # imports and model loading are part of the wall time a user waits.
            self.start = started
            self._eval(0)

        def on_step_begin(self, args, state, control, **kwargs):
            self.step_start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds = time.perf_counter() - self.step_start
            log(
                {"version": state.global_step, "compute_s": seconds, "rollouts_per_s": COMPLETIONS_PER_STEP / seconds},
                state.global_step,
            )
            if time.time() - self.last_eval >= EVAL_EVERY_S:
                self._eval(state.global_step)
            if time.time() - self.start >= opts.budget_s:
                control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                log({"reward_mean": logs["reward"]}, state.global_step)

    config = GRPOConfig(
        output_dir=str(opts.out / "trl"),
        use_cpu=True,
        # TRL turns bf16 and gradient checkpointing on by default; neither suits a tiny fp32 model on CPU.
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_vllm=False,
        per_device_train_batch_size=COMPLETIONS_PER_STEP,
        num_generations=GENERATIONS,
        max_completion_length=opts.max_new_tokens,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        # TRL 1.16's default lr (1e-6) barely moves a model this small in 10 minutes; 5e-5 is the
        # setting its comparison with pipeline_rl was first measured with.
        learning_rate=5e-5,
        # Bounded by time: a step count this large keeps the linear decay of the lr negligible.
        max_steps=1_000_000,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=opts.seed,
    )
    dataset = Dataset.from_list([{"prompt": p["prompt"], "answer": p["answer"]} for p in train])
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_fn,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    trainer.train()
    sink.close()


if __name__ == "__main__":
    main()
