"""Built-in model scorers against a bare `transformers` forward of the same model on the same
batches, in one run: what the scorer adds (decoding, re-encoding, packing, reading scores out).

    python scripts/bench_scorers.py [--groups 32] [--hidden 256] [--layers 4] [--repeats 3]

Builds random Qwen2-shaped models with the demo's byte-level tokenizer in a temporary
directory (a policy/teacher, a 2-label token-classification PRM, a 1-label reward model) and
multi-step completions of the demo's task, 8 per group. For each scorer it times `score()` on
all groups and, interleaved, the bare forward passes over exactly the rows the scorer builds
(best of --repeats each), and prints tokens/s of both and their ratio (goal >= 0.9), with the
process's peak RSS.
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch
    from transformers import Qwen2ForCausalLM, Qwen2ForSequenceClassification, Qwen2ForTokenClassification

    from pipeline_rl.config import RunConfig
    from pipeline_rl.core.logprobs import packed_logprobs
    from pipeline_rl.demo.multistep import make_problems
    from pipeline_rl.demo.tiny_model import make_tokenizer, qwen2_config
    from pipeline_rl.scorers import DistillationScorer, ProcessRewardScorer, RewardModelScorer
    from pipeline_rl.scorers.hf import pack_rows
    from pipeline_rl.streams.records import Rollout, RolloutGroup

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    tok = make_tokenizer()
    pad = tok.pad_token_id
    assert isinstance(pad, int)
    tmp = Path(tempfile.mkdtemp(prefix="bench_scorers_"))

    def save(cls, name, **extra):
        torch.manual_seed(0)
        config = qwen2_config(
            len(tok),
            hidden=args.hidden,
            layers=args.layers,
            heads=8,
            kv_heads=4,
            max_len=1024,
            pad_token_id=pad,
            **extra,
        )
        cls(config).save_pretrained(tmp / name)
        tok.save_pretrained(tmp / name)
        return str(tmp / name)

    policy = save(Qwen2ForCausalLM, "policy")
    prm = save(Qwen2ForTokenClassification, "prm", num_labels=2)
    rm = save(Qwen2ForSequenceClassification, "rm", num_labels=1)
    cfg = RunConfig()
    cfg.model.path = policy
    cfg.preprocess.seq_length = 1024

    problems = make_problems(0)[1][: args.groups]
    wrong = str.maketrans("125", "234")  # a wrong digit in every other completion
    groups = []
    for p in problems:
        rollouts = []
        for k in range(8):
            text = p["solution"] if k % 2 == 0 else p["solution"].translate(wrong)
            ids = tok.encode(p["prompt"], add_special_tokens=False)
            completion = tok.encode(text, add_special_tokens=False)
            rollouts.append(Rollout(ids, completion, [-1.0] * len(completion), [0] * len(completion), 0.0, "stop"))
        groups.append(RolloutGroup(problem_id=p["id"], group_id=p["id"], rollouts=rollouts))

    def best(fn) -> float:
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    def forward_rows(model, sequences: list[list[int]]) -> None:
        for row in pack_rows([len(s) for s in sequences], cfg.preprocess.seq_length):
            ids = torch.tensor([[t for i in row for t in sequences[i]]])
            pos = torch.tensor([[q for i in row for q in range(len(sequences[i]))]])
            with torch.no_grad():
                model(input_ids=ids, position_ids=pos, use_cache=False)

    results = []

    prm_scorer = ProcessRewardScorer(cfg, path=prm, kind="token_classification", marker="#", separator="\n")
    rollouts = [r for g in groups for r in g.rollouts]
    from pipeline_rl.scorers.process_reward import step_ends

    prm_inputs = [prm_scorer.prm_input(r, step_ends(r.completion_ids, prm_scorer.separator))[0] for r in rollouts]
    tokens = sum(len(s) for s in prm_inputs)
    scorer_s = best(lambda: prm_scorer.score(copy.deepcopy(groups)))
    bare_s = best(lambda: forward_rows(prm_scorer.model, prm_inputs))
    results.append(("ProcessRewardScorer", tokens, scorer_s, bare_s))

    rm_scorer = RewardModelScorer(cfg, path=rm, batch_size=16)
    rm_inputs = [rm_scorer.encode(r.prompt_ids, r.completion_ids) for r in rollouts]
    tokens = sum(len(s) for s in rm_inputs)

    def bare_rm() -> None:
        order = sorted(range(len(rm_inputs)), key=lambda i: len(rm_inputs[i]))
        for b in range(0, len(order), 16):
            chunk = [rm_inputs[i] for i in order[b : b + 16]]
            width = max(map(len, chunk))
            ids = torch.tensor([s + [pad] * (width - len(s)) for s in chunk])
            mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in chunk])
            with torch.no_grad():
                rm_scorer.model(input_ids=ids, attention_mask=mask)

    scorer_s = best(lambda: rm_scorer.score(copy.deepcopy(groups)))
    bare_s = best(bare_rm)
    results.append(("RewardModelScorer", tokens, scorer_s, bare_s))

    distill = DistillationScorer(cfg, path=policy)
    sequences = [r.prompt_ids + r.completion_ids for r in rollouts]
    tokens = sum(len(s) for s in sequences)
    model = distill.logprobs.model

    def bare_logprobs() -> None:
        for row in pack_rows([len(s) for s in sequences], cfg.preprocess.seq_length):
            ids = torch.tensor([[t for i in row for t in sequences[i]]])
            pos = torch.tensor([[q for i in row for q in range(len(sequences[i]))]])
            with torch.no_grad():
                packed_logprobs(model, ids, pos, 1.0)

    scorer_s = best(lambda: distill.score(copy.deepcopy(groups)))
    bare_s = best(lambda: forward_rows(model, sequences))
    logprob_s = best(bare_logprobs)
    results.append(("DistillationScorer", tokens, scorer_s, bare_s))

    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"\n=== bench_scorers: {len(rollouts)} rollouts, hidden {args.hidden}, {args.layers} layers, "
        f"best of {args.repeats} ==="
    )
    for name, n, s, b in results:
        print(
            f"{name:>20}: scorer {n / s:9.0f} tok/s, bare forward {n / b:9.0f} tok/s, ratio {b / s:.2f} (goal >= 0.9)"
        )
    print(
        f"{'':>20}  (DistillationScorer's bare forward plus logprob extraction alone: {tokens / logprob_s:.0f} tok/s)"
    )
    print(f"peak RSS: {peak_mb:.0f} MB")


if __name__ == "__main__":
    main()
