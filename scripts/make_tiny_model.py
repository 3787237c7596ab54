"""Build the tiny arithmetic model and its data set (see pipeline_rl/demo/tiny_model.py).

    python scripts/make_tiny_model.py [--cache DIR] [--seed N] [--name NAME]

NAME is tiny_model (default), tiny_learner (the learning benchmark's second model: about half
right greedily, not softened), multistep_policy or multistep_teacher (the multi-step task's
policy and distillation teacher, built together: pipeline_rl/demo/multistep.py), multistep_prm
(its process reward model: pipeline_rl/demo/prm.py) or multistep_rm (its outcome reward model:
pipeline_rl/demo/outcome_rm.py); multistep_prm_quick and multistep_rm_quick are the tests' quick
recipes of the last two; family_byte_small, family_char_base, family_char_deep,
family_byte_wide, family_char_brief and family_byte_brief are the model family that
scripts/bench_learning.py --family judges learning on (pipeline_rl/demo/family.py), and
NAME_sSEED any of them made afresh from another seed; tools_policy is the tool-use demo's policy (conf=tiny_tools,
pipeline_rl/demo/tools_policy.py); tiny_moe is the mixture-of-experts policy
(pipeline_rl/demo/tiny_moe.py); long_chain_policy is the long, uneven task's policy
(conf=tiny_long, pipeline_rl/demo/long_chain.py) and long_chain_prm its process reward model
(conf=tiny_long_prm, pipeline_rl/demo/long_chain_prm.py). A model's prerequisites are built first when missing.

DIR defaults to $PIPELINE_RL_CACHE, else <repo>/.cache.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# One compute thread: on these machines two OpenMP threads in one process are often far slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get("PIPELINE_RL_CACHE", ROOT / ".cache")))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="tiny_model", help="which model to build (see above)")
    args = parser.parse_args()

    import torch

    from pipeline_rl.demo import build_named

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    start = time.time()
    build_named(args.cache, args.name, args.seed)
    path = args.cache / args.name
    report = next(path.glob("*report.json"))
    print(f"built {path} ({time.time() - start:.0f} s): {report.read_text()}")


if __name__ == "__main__":
    main()
