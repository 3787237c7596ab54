"""PNG plots of a run, drawn from its metrics JSONL files (RUN_DIR/metrics/*.jsonl)."""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from pipeline_rl.metrics import read_metrics

TRAIN_REWARD = "reward_mean"
EVAL_REWARD = "eval/reward"
LAG_HISTOGRAM = "lag_hist"
TOKENS_PER_S = "tokens_per_s"


def _series(records: list[dict], key: str, t0: float) -> dict[str, tuple[list[float], list[float]]]:
    by_process: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for r in records:
        value = r["values"].get(key)
        if isinstance(value, (int, float)):
            xs, ys = by_process[r["process"]]
            xs.append(r["time"] - t0)
            ys.append(value)
    return dict(by_process)


def lag_histogram(records: list[dict]) -> Counter:
    """Trained and dropped samples per lag (versions behind the trainer), over the run."""
    total: Counter = Counter()
    for r in records:
        hist = r["values"].get(LAG_HISTOGRAM)
        if isinstance(hist, dict):
            total.update({int(k): int(v) for k, v in hist.items()})
    return total


def write_plots(run_dir: Path) -> list[Path]:
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    out = run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    if not records:
        return []
    t0 = records[0]["time"]
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, key in (("train", TRAIN_REWARD), ("held-out", EVAL_REWARD)):
        for process, (xs, ys) in _series(records, key, t0).items():
            # The actors see every rollout; the trainer's reward_mean covers only the samples it
            # trained on (groups of equal rewards are filtered out), a biased and noisy view.
            if process.startswith("actor"):
                ax.plot(xs, ys, marker="." if label == "held-out" else None, label=f"{label} ({process})")
    ax.set(xlabel="wall time (s)", ylabel="mean reward", title="Reward vs wall time", ylim=(-0.02, 1.02))
    ax.grid(alpha=0.3)
    ax.legend()
    written.append(_save(fig, out / "reward.png"))

    hist = lag_histogram(records)
    fig, ax = plt.subplots(figsize=(6, 4))
    if hist:
        lags = sorted(hist)
        ax.bar(lags, [hist[k] for k in lags])
    ax.set(xlabel="lag (trainer version - oldest token version)", ylabel="samples", title="Lag histogram")
    written.append(_save(fig, out / "lag_histogram.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for process, (xs, ys) in sorted(_series(records, TOKENS_PER_S, t0).items()):
        ax.plot(xs, ys, label=process)
    ax.set(xlabel="wall time (s)", ylabel="tokens/s", title="Throughput per process")
    ax.grid(alpha=0.3)
    ax.legend()
    written.append(_save(fig, out / "tokens_per_s.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
