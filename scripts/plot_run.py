"""Redraw a run's plots from its metrics: `python scripts/plot_run.py RUN_DIR`."""

import argparse
from pathlib import Path

from pipeline_rl.launch.plots import write_plots

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args()
    if not (args.run_dir / "metrics").is_dir():
        raise SystemExit(f"{args.run_dir} has no metrics/ directory: not a pipeline_rl run directory")
    for path in write_plots(args.run_dir):
        print(path)
