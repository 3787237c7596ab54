"""Build the tiny arithmetic model and its data set (see pipeline_rl/demo/tiny_model.py).

    python scripts/make_tiny_model.py [--cache DIR] [--seed N] [--learner]

--learner builds the second model (DIR/tiny_learner: about half right greedily, not softened).

DIR defaults to $PIPELINE_RL_CACHE, else <repo>/.cache.
"""

from __future__ import annotations

import argparse
import json
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
    parser.add_argument("--learner", action="store_true", help="build tiny_learner instead of tiny_model")
    args = parser.parse_args()

    import torch

    from pipeline_rl.demo.tiny_model import LEARNER, TINY, build

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    start = time.time()
    path = build(args.cache, args.seed, LEARNER if args.learner else TINY)
    report = json.loads((path / "pretrain_report.json").read_text())
    print(f"built {path} ({time.time() - start:.0f} s): {json.dumps(report)}")


if __name__ == "__main__":
    main()
