"""The tables in docs/ that show kept benchmark results, generated from the results' JSON; and a
comparison of a new run's JSON with the kept one.

    python scripts/bench_tables.py              rewrite every generated table in docs/
    python scripts/bench_tables.py --check      exit 1 when a table differs from its JSON
    python scripts/bench_tables.py --compare NEW.json [--baseline docs/bench_delta.json] [--tolerance 0.25]
                                                the figures of NEW that moved beyond the kept run's

A generated table sits in its page between `<!-- table: NAME -->` and `<!-- end table -->`; NAME
is a key of TABLES, which names the kept JSON (written by the benchmark's `--json` or `--out`)
and how its rows become the table. tests/unit/test_bench_tables.py keeps the pages in step.

The comparison matches rows by their identity fields (the setup, the learning rate) and looks at
every numeric field: it has moved when it leaves the band of the kept value +- `tolerance`
(relative), widened to the kept run's own maximum where the JSON records one (`X_max` beside
`X_median`), the spread that run saw over its updates.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import sweep_tables
from table_cells import cell, markdown, measured_on, seconds, sooner

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def machine(cpuinfo: str | None = None) -> str:
    """The machine a benchmark ran on: its CPU as `cpuinfo` (/proc/cpuinfo's text) names it, its
    core count and, where the CPU has AVX2 but not AVX-512, "AVX2": vLLM's CPU kernels are built
    for both, and one model name covers CPUs with and without AVX-512."""
    import os

    lines = (Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo).splitlines()
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    isa = ", AVX2" if "avx2" in flags and "avx512f" not in flags else ""
    return f"{os.cpu_count()}-core {names[0] if names else 'unknown CPU'}{isa}"


def commit() -> str:
    """The commit the benchmark ran (short hash; "+changes" when the code differed from it)."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    changed = git("status", "--porcelain", "--", "pipeline_rl", "scripts", "launch.py")
    return git("rev-parse", "--short", "HEAD") + ("+changes" if changed else "")


def keep(path: Path, rows: list[dict]) -> None:
    """Write a benchmark's `rows` into its kept JSON at `path`: each replaces the kept row of the
    same identity (IDENTITY), the other kept rows stay, so the runs of one benchmark with
    different arguments (a model, a TP size) gather in one file."""
    kept = json.loads(path.read_text()) if path.exists() else []
    ours = {identity(r) for r in rows}
    path.write_text(json.dumps([r for r in kept if identity(r) not in ours] + rows, indent=1) + "\n")


def identity(row: dict) -> tuple:
    return tuple(row.get(k) for k in IDENTITY)


def named(row: dict) -> str:
    """The row's identity fields, as a comparison names the row."""
    return ", ".join(f"{k}={row[k]}" for k in IDENTITY if row.get(k) is not None)


def delta_table(rows: list[dict]) -> str:
    """scripts/bench_delta.py's rows."""

    def row(r: dict) -> list[str]:
        exact = not r["engine_differs_from_checkpoint"] and not r["checksum_mismatches"] and not r["swaps_failed"]
        return [
            r["setup"],
            f"{r['lr']:.0e}",
            f"{r['changed_fraction_median']:.2%} ({r['changed_fraction_max']:.2%})",
            f"{r['delta_bytes_ratio_median']:.2%} ({r['delta_bytes_ratio_max']:.2%}) = "
            f"1/{1 / r['delta_bytes_ratio_median']:.0f}",
            f"{r['publish_s_delta'] * 1e3:.0f} / {r['publish_s_full'] * 1e3:.0f} ms",
            f"{r['lock_hold_s_delta'] * 1e3:.1f} / {r['lock_hold_s_full'] * 1e3:.1f} ms",
            f"{r['staging_bytes_delta_max'] / MIB:.1f} / {r['staging_bytes_full'] / MIB:.1f} MiB",
            "yes" if exact else "NO",
        ]

    header = [
        "setup",
        "lr",
        "elements changed per update, median (max)",
        "bytes / full update, median (max)",
        "rank 0's publication, delta / full",
        "engine lock hold, delta / full",
        "staging, delta (max) / full",
        "engine = final checkpoint",
    ]
    return markdown(header, [row(r) for r in rows])


KINDS = [
    ("matrix products", "matmul"),
    ("elementwise", "elementwise"),
    ("copies and casts", "copy"),
    ("softmax", "softmax"),
    ("norms and reductions", "norm and reduction"),
    ("optimizer", "optimizer"),
    ("attention", "attention"),
    ("compiled logprob kernel", "compiled"),
]


def step_tally_table(result: dict) -> str:
    """scripts/step_tally.py's result: least device time a step by kind, per loop."""
    loops = result["per_step"]
    names = list(loops)
    total = {n: sum(k["least_ms"] for k in loops[n].values()) for n in names}

    def row(label: str, cells: list[str]) -> str:
        return f"| {label} | " + " | ".join(cells) + " |"

    lines = [row("least ms a step, by kind", names), "| --- |" + " --- |" * len(names)]
    for label, kind in KINDS:
        lines.append(row(label, [f"{loops[n][kind]['least_ms']:.1f}" if kind in loops[n] else "0" for n in names]))
    lines.append(row("**total**", [f"**{total[n]:.1f}**" for n in names]))
    lines.append(row("bare / loop", [f"{total[names[0]] / total[n]:.2f}" for n in names]))
    lines.append(
        row(
            "TFLOP / GB / operators a step",
            [
                f"{sum(k['flops'] for k in loops[n].values()) / 1e12:.1f} / "
                f"{sum(k['bytes'] for k in loops[n].values()) / 1e9:.0f} / "
                f"{sum(int(k['ops']) for k in loops[n].values()):,}"
                for n in names
            ],
        )
    )
    return "\n".join(lines)


GPU_RUNS = {
    "bare8": "bare loop",
    "bare8b": "bare loop, again",
    "z2noovf": "ZeRO-2, as shipped (no overflow check)",
    "z2": "ZeRO-2 with DeepSpeed's overflow check",
    "z2host": "ZeRO-2 with the overflow check, host profiled",
    "z2nocontig": "ZeRO-2, overflow check, `contiguous_gradients: false`",
    "z2sync": "ZeRO-2, overflow check, synchronisations counted",
    "z3": "ZeRO-3 (overflow check on)",
    "z3host": "ZeRO-3, host profiled",
    "z2lora": "ZeRO-2, LoRA r16",
    "z2ck32": "ZeRO-2, 32k, gradient checkpointing",
}
"""The runs of the GPU calls' scripts (docs/gpu.md's commands), by the name each call's log gives."""


def logged_results(text: str) -> dict[str, dict]:
    """The result JSON a GPU check printed, one per line as `NAME {...}` (gpu_check.py --suite) or
    `call N NAME: {...}` (the scripts that ran several checks in one call), by that name."""
    found = {}
    for line in text.splitlines():
        m = re.match(r"(.+?):? (\{.*\})$", line)
        if m:
            found[m.group(1)] = json.loads(m.group(2))
    return found


def peak_gib(r: dict) -> float:
    """What the device held at a run's peak: the allocator's peak and what lies outside it."""
    return r["peak_gpu_gib"] + r["outside_allocator_gib"]


def gpu_calls_table(results: dict[str, dict]) -> str:
    """Trainer runs of several GPU calls: tokens/s against the bare loop of the same call (the mean
    of the call's bare-loop runs), MFU, and peak device memory against the memory plan."""
    rows = []
    for key, r in results.items():
        if "tokens_per_s" not in r:
            continue
        call, name = key.split(" ", 2)[1:]
        bare = [b["tokens_per_s"] for k, b in results.items() if k.startswith(f"call {call} bare")]
        plan = r.get("plan_gib")
        rows.append(
            [
                call,
                GPU_RUNS.get(name, name),
                f"{r['seq_length'] // 1024}k",
                f"{r['tokens_per_s'] / 1e3:.1f}k",
                f"{r['tokens_per_s'] / (sum(bare) / len(bare)):.2f}",
                f"{r['mfu']:.3f}",
                f"{peak_gib(r):.2f}",
                cell(plan, ".2f", "-"),
            ]
        )
    return markdown(
        ["call", "run", "tokens a micro-batch", "tokens/s", "of the bare loop", "MFU", "peak GiB", "plan GiB"], rows
    )


def gpu_swap_table(results: dict[str, dict]) -> str:
    """`gpu_swap_check.py --concurrent`'s runs: forward passes against weight transfers on one device."""
    rows = [
        [
            "ordered" if r["ordered"] else "`--unordered`",
            str(r["forward_passes"]),
            str(r["passes_on_device_during_transfers"]),
            str(r["torn_reads"]),
            str(r["stale_reads"]),
            f"{r['transfer_ms_p50']:.1f}",
        ]
        for r in results.values()
        if "ordered" in r
    ]
    header = [
        "transfers",
        "forward passes",
        "on the device during a transfer",
        "torn reads",
        "stale reads",
        "transfer ms, p50",
    ]
    return markdown(header, rows)


def logprobs_table(rows: list[dict]) -> str:
    """scripts/bench_logprobs.py's rows: each head against the bare loop's of the same setup and
    machine, the whole head and its arithmetic alone."""
    bare = {(r["setup"], r["machine"]): r for r in rows if r["name"] == "bare"}
    table = []
    for r in rows:
        b = bare[(r["setup"], r["machine"])]
        table.append(
            [
                r["setup"],
                HEADS.get(r["name"], r["name"]),
                f"{r['seconds']:.3f}",
                f"{b['seconds'] / r['seconds']:.2f}",
                f"{r['arithmetic_s']:.3f}",
                f"{b['arithmetic_s'] / r['arithmetic_s']:.2f}",
                f"{r['peak_added_mib']:,}",
                measured_on(r),
            ]
        )
    header = ["setup", "head", "s / micro-batch", "of bare", "arithmetic s", "of bare", "peak added MiB", "measured on"]
    return markdown(header, table)


HEADS = {"bare": "bare loop's (every token's logits)", "eager": "trainer's, eager", "compiled": "trainer's, compiled"}


def faults_table(result: dict) -> str:
    """scripts/bench_faults.py's result: each fault, what it cost against the clean run's pace and
    what became of the rollouts in flight; each restart's recovery; both runs' ends."""
    rows = []
    for c in result["faults"]:
        kept = ", ".join(f"{k.replace('_', ' ')} {v:,.0f}" for k, v in c["in_flight"].items() if v) or "none"
        rows.append([c["fault"], f"{c['at_s']:.0f} s (version {c['version']})", f"{c['cost_s']:.0f} s", kept])
    for r in result["restarts"]:
        rows.append([f"restart of {r['what']}", "", f"back in {r['recovered_s']} s", f"{r['died']} lost"])
    for name in ("clean", "faults"):
        final = f"held-out {cell(result['final_reward'][name], '.3f')}, version {result['final_version'][name]}"
        rows.append([f"end, {'with faults' if name == 'faults' else 'clean run'}", "", "", final])
    table = markdown(["fault", "at", "cost", "rollouts in flight"], rows)
    return table + f"\n\n`conf={result['conf']}`, {result['budget_s']:.0f} s a run; {measured_on(result)}."


def gpu_memory_table(results: dict[str, dict]) -> str:
    """`gpu_check.py --suite`'s trainer runs: peak device memory against the memory plan."""
    rows = [
        [name, f"{peak_gib(r):.2f}", f"{r['plan_gib']:.2f}", f"{peak_gib(r) / r['plan_gib']:.3f}"]
        for name, r in results.items()
        if r.get("loop") == "trainer" and not name.startswith("profile")
    ]
    return markdown(["run", "peak GiB", "plan GiB", "peak / plan"], rows)


def learning_table(rows: list[dict], variants: bool = False, extra: dict[str, Callable] | None = None) -> str:
    """scripts/bench_learning.py's rows: each model's pipeline_rl run against TRL's, with the goals
    (TRL's final reached in at most half its budget, ended >= +0.05 above it, no fall of more than
    0.05 after the best, none below the start - 0.05 in the first minute); with `variants`, a
    column naming each row's `--variant`; `extra`: more columns (header -> a row's cell), before
    "measured on"."""
    extra = extra or {}

    def row(r: dict) -> list[str]:
        t, span = r["time_to_trl_s"], r["trl_span_s"]
        gain = "" if r["gain"] is None else f" ({r['gain']:+.3f})"
        return [
            f"`{r['model']}`",
            *([r["mode"]] if variants else []),
            cell(r["start"], ".3f"),
            cell(r["trl_final"], ".3f"),
            seconds(t),
            sooner(span, t),
            f"{cell(r['final'], '.3f')}{gain}",
            f"{r['worst_drop']:.3f}",
            f"{r['early_fall']:.3f}",
            cell(r["versions_per_s"], ".2f"),
            *(make(r) for make in extra.values()),
            measured_on(r),
        ]

    header = ["model", *(["variant"] if variants else []), "start", "TRL final", "time to TRL's final"]
    header += ["sooner than TRL", "final (vs TRL)", "worst drop after best", "first-minute fall", "versions/s"]
    return markdown(header + list(extra) + ["measured on"], [row(r) for r in rows])


BAR_SOONER = 2.0
"""The family's bar: TRL's 10-minute reward reached in at most 1 / BAR_SOONER of TRL's time..."""
BAR_GAIN = 0.05
"""...the run ending this much above TRL's final, where TRL's final leaves that much room below 1..."""
BAR_FALL = 0.05
"""...and neither a fall after the best 3-evaluation mean nor a first-minute fall larger than this."""


def goals_missed(r: dict) -> list[str]:
    """The bar's goals a family row misses, by name ("time", "gain", "drop", "first minute")."""
    t, span = r["time_to_trl_s"], r["trl_span_s"]
    missed = [] if t and span and span / t >= BAR_SOONER else ["time"]
    room = r["trl_final"] is not None and r["trl_final"] <= 1.0 - BAR_GAIN
    if room and (r["gain"] is None or r["gain"] < BAR_GAIN):
        missed.append("gain")
    if r["worst_drop"] > BAR_FALL:
        missed.append("drop")
    if r["early_fall"] > BAR_FALL:
        missed.append("first minute")
    return missed


def step_settings(r: dict) -> str:
    """The `conf=tiny` step a row ran: problems x attempts and the entropy bonus."""
    if r.get("groups_per_step") is None:
        return "not recorded"
    return f"{r['groups_per_step']} x {r['attempts']}, {r['entropy_coef']:g}"


def family_table(rows: list[dict]) -> str:
    """The family's rows, by problems a step and then entropy bonus, largest first (conf=tiny's
    64 x 4 with its bonus ahead of the earlier settings): each member's run against TRL's, the
    step and bonus it ran with, and the goals of the bar it misses."""
    ordered = sorted(rows, key=lambda r: (r.get("groups_per_step") or 0, r.get("entropy_coef") or 0), reverse=True)
    extra = {
        "problems x attempts, entropy bonus": step_settings,
        "goals missed": lambda r: ", ".join(goals_missed(r)) or "none",
    }
    return learning_table(ordered, extra=extra)


def variants_table(rows: list[dict], columns: tuple[str, ...] = ()) -> str:
    """scripts/bench_learning.py's rows of `--variant` runs without TRL: per model and variant, the
    start, times to 0.7 and 0.9, the final reward, the worst drop and the pace, and the optional
    `columns`: "dropped" (the share of samples the lag gate dropped), "tool_calls" (tool calls per
    training rollout, first third of the run -> last third)."""

    def row(r: dict) -> list[str]:
        counted = r.get("dropped_samples") is not None and r.get("samples")
        extra = {
            "dropped": cell(100 * r["dropped_samples"] / r["samples"] if counted else None, ".1f") + " %",
            "tool_calls": f"{cell(r.get('tool_calls_first_third'), '.2f')} -> {cell(r.get('tool_calls_last_third'), '.2f')}",
        }
        return [
            f"`{r['model']}`",
            r["mode"],
            cell(r["start"], ".3f"),
            seconds(r.get("time_to_0.7_s")),
            seconds(r.get("time_to_0.9_s")),
            cell(r["final"], ".3f"),
            f"{r['worst_drop']:.3f}",
            cell(r["completions_per_s"], ".0f"),
            cell(r["versions_per_s"], ".2f"),
            *(extra[c] for c in columns),
            measured_on(r),
        ]

    header = ["model", "variant", "start", "time to 0.7", "time to 0.9", "final", "worst drop", "completions/s"]
    names = {"dropped": "samples dropped by the lag gate", "tool_calls": "tool calls a rollout, first -> last third"}
    header += ["versions/s", *(names[c] for c in columns), "measured on"]
    return markdown(header, [row(r) for r in rows])


def guidance_table(rows: list[dict]) -> str:
    """scripts/bench_learning.py's rows with `--against`: each variant against the run it names
    (step guidance against the plain pipelined run: its final reached 1.3x sooner or more, a
    final no lower, no fall of more than 0.05), with what each run generated per trained token,
    the attempts it cut and the step scorer's share of the run's CPU."""

    def row(r: dict) -> list[str]:
        own = r["mode"] == r["against"]
        t, span = r.get("time_to_against_s"), r["against_span_s"]
        gain = "" if own or r["gain_against"] is None else f" ({r['gain_against']:+.3f})"
        return [
            f"`{r['model']}`",
            r["mode"],
            cell(r["start"], ".3f"),
            "-" if own else seconds(t),
            "(the bar)" if own else sooner(span, t),
            f"{cell(r['final'], '.3f')}{gain}",
            f"{r['worst_drop']:.3f}",
            cell(r.get("tokens_per_trained"), ".2f"),
            cell(r.get("cuts"), ".0f", "0"),
            cell(None if r.get("scorer_share") is None else 100 * r["scorer_share"], ".1f", "0") + " %",
            cell(r["versions_per_s"], ".2f"),
            measured_on(r),
        ]

    header = ["model", "variant", "start", "time to the bar's final", "sooner", "final (vs the bar)", "worst drop"]
    header += ["generated / trained tokens", "attempts cut", "step scorer's CPU", "versions/s", "measured on"]
    return markdown(header, [row(r) for r in rows])


def pipelining_table(rows: list[dict]) -> str:
    """scripts/bench_learning.py's rows with `--against sync`: the pipelined and sync runs of one
    model, each against sync's final reward and TRL's, with where a version's time goes (waiting
    for its samples, training), the idle shares and the samples the lag gate dropped."""

    def row(r: dict) -> list[str]:
        own = r["mode"] == r["against"]
        t, span = r.get("time_to_against_s"), r["against_span_s"]
        trl_t, trl_span = r["time_to_trl_s"], r["trl_span_s"]
        gain = "" if own or r["gain_against"] is None else f" ({r['gain_against']:+.3f})"
        wait, train = r.get("version_wait_s"), r.get("version_train_s")
        dropped, samples = r.get("dropped_samples"), r.get("samples")
        return [
            f"`{r['model']}`",
            r["mode"],
            cell(r["start"], ".3f"),
            f"{cell(r['final'], '.3f')}{gain}",
            "(the bar)" if own else seconds(t),
            "-" if own else sooner(span, t),
            f"{seconds(trl_t)} ({cell(r['trl_final'], '.3f')})",
            sooner(trl_span, trl_t),
            f"{r['worst_drop']:.3f}",
            f"{wait:.2f} + {train:.2f}" if wait is not None and train is not None else "n/a",
            f"{cell(r.get('actor_idle'), '.2f')} / {cell(r.get('trainer_idle'), '.2f')}",
            f"{dropped:,.0f} of {samples:,.0f}" if dropped is not None and samples else "n/a",
            cell(r["completions_per_s"], ".0f"),
            cell(r["versions_per_s"], ".2f"),
            measured_on(r),
        ]

    header = ["model", "run", "start", "final (vs sync)", "time to sync's final", "sooner than sync"]
    header += ["time to TRL's final (TRL's final)", "sooner than TRL", "worst drop"]
    header += ["s/version: samples + training", "idle: actor / trainer", "samples dropped by the lag gate"]
    header += ["completions/s", "versions/s", "measured on"]
    return markdown(header, [row(r) for r in rows])


HEADLINE = (
    ("`conf=tiny`: 2-digit addition, answers of 2-3 tokens", "family_char_base_s23", "async", "(not tuned on)"),
    ("`conf=tiny_long`: 2 to 20 worked steps, completions of 14 to 140 tokens", "long_chain_policy", "async", ""),
)
"""The README's rows: the task, and the model and pipelined run of the kept rows it shows (the
first kept JSON of the table that has them)."""


def headline_table(sources: list[list[dict]]) -> str:
    """The README's table: per demo task, its pipelined run against the sync run beside it (where
    one was run) and against TRL's, from the kept learning rows."""

    def find(model: str, mode: str) -> dict | None:
        return next((r for rows in sources for r in rows if (r["model"], r["mode"]) == (model, mode)), None)

    def row(task: str, model: str, mode: str, note: str) -> list[str]:
        r = find(model, mode)
        if r is None:
            raise KeyError(f"no kept learning row of model {model!r}, run {mode!r}")
        sync = find(model, "sync")
        t, span = r.get("time_to_against_s"), r.get("against_span_s")
        versus_sync = (
            f"sync's 10-minute reward reached {sooner(span, t)} sooner" if sync and t and span else "not measured"
        )
        trl_t = r["time_to_trl_s"]
        finals = [cell(r["final"], ".3f"), cell(sync["final"], ".3f") if sync else "not measured"]
        return [
            task,
            f"`{model}`{' ' + note if note else ''}",
            versus_sync,
            f"{seconds(trl_t)} against TRL's {r['trl_span_s']:.0f} s",
            " / ".join([*finals, cell(r["trl_final"], ".3f")]),
            measured_on(r),
        ]

    header = ["task", "model", "pipelined vs sync", "pipelined vs TRL: time to TRL's 10-minute reward"]
    header += ["final held-out reward: pipelined / sync / TRL", "measured on"]
    return markdown(header, [row(*spec) for spec in HEADLINE])


def step_scorer_table(report: dict) -> str:
    """A PRM build's report (pipeline_rl/demo/long_chain_prm.py): its step rates on held-out
    written solutions and on the policy's own attempts, at a score of 0.5."""

    def row(what: str, r: dict, attempts: bool) -> list[str]:
        return [
            what,
            f"{r['held_out_wrong'] + r['held_out_right']:,} ({r['held_out_wrong']:,} wrong)",
            f"{r['accuracy']:.3f}",
            f"{r['wrong_caught']:.3f}",
            f"{r['right_kept']:.3f}",
            f"{r['first_wrong_step_caught']:.3f}" if attempts else "-",
            f"{r['attempts_cut_while_right']:.3f}" if attempts else "-",
        ]

    header = ["judged on", "steps", "accuracy", "wrong steps caught", "right steps kept"]
    header += ["attempts' first wrong step caught", "attempts cut while right"]
    own = report["on_policy_attempts"]
    return markdown(
        header,
        [
            row(
                f"held-out written solutions (best of {report['steps']} steps: step {report['kept_step']})",
                report,
                False,
            ),
            row(f"the policy's own attempts ({own['attempts']}, T=1)", own, True),
        ],
    )


def swap_table(rows: list[dict]) -> str:
    """scripts/bench_actor.py's rows: the swap's lock hold against a memcpy of the update, how long
    a swap waited against the engine call it found running, decode with updates against without."""
    header = ["run", "update", "lock hold p50 / memcpy (p99)", "swap wait / the call it waited for, max"]
    header += ["decode with updates / without (median of rounds)", "sender's send p50 / engine step p50"]
    header += ["peak RSS, engine process", "measured on"]
    cells = [
        [
            r["name"],
            f"{r['update_bytes'] / MIB:.1f} MiB",
            f"{r['lock_hold_p50_ms']:.2f} / {r['memcpy_ms']:.3f} ms = {r['lock_hold_p50_ms'] / r['memcpy_ms']:.1f}x "
            f"({r['lock_hold_p99_ms']:.2f} ms)",
            f"{r['wait_over_call_max']:.2f}",
            f"{r['updating_over_client']:.3f} ({r['updating_over_client_median']:.3f})",
            f"{r['send_p50_ms']:.1f} / {r['step_p50_ms']:.1f} ms",
            f"{r['actor_rss_mib']:.0f} MiB",
            r["machine"],
        ]
        for r in rows
    ]
    return markdown(header, cells)


def lora_table(rows: list[dict]) -> str:
    """scripts/bench_lora.py's rows: full-weight and LoRA updates on the same engine setup, each
    LoRA run's lock hold against the full-weight run's on the same model and machine."""
    full = {(r["name"], r["machine"]): r for r in rows if not r["lora_rank"]}
    header = ["model", "update", "bytes per update", "swap lock hold p50 (p99)", "LoRA hold / full hold"]
    header += ["decode tok/s without updates", "with updates / without (median of rounds)", "measured on"]

    def row(r: dict) -> list[str]:
        base = full.get((r["name"], r["machine"]))
        ratio = f"{r['lock_hold_p50_ms'] / base['lock_hold_p50_ms']:.3f}" if r["lora_rank"] and base else ""
        return [
            f"`{r['name']}`",
            f"LoRA r={r['lora_rank']}" if r["lora_rank"] else "full weights",
            f"{r['update_bytes']:,.0f}",
            f"{r['lock_hold_p50_ms']:.2f} ms ({r['lock_hold_p99_ms']:.2f} ms)",
            ratio,
            f"{r['client_tok_s']:.0f}",
            f"{r['updating_over_client']:.3f} ({r['updating_over_client_median']:.3f})",
            r["machine"],
        ]

    return markdown(header, [row(r) for r in rows])


def digits_table(rows: list[dict]) -> str:
    """scripts/answer_digits.py's rows: which digits of the answers a model gets right, and how
    often its samples of a problem all agree."""
    header = ["model", "exact", "right length", "first digit", "last digit", "samples agree"]
    keys = ("exact", "length", "first_digit", "last_digit", "agreement")
    return markdown(header, [[r["name"], *(f"{r[k]:.3f}" for k in keys)] for r in rows])


def spread_table(rows: list[dict]) -> str:
    """scripts/group_spread.py's rows: groups without a reward spread against a binomial at the
    same mean reward, and the dispersion of right attempts between groups."""
    header = ["run", "groups", "attempts", "mean reward", "no spread (binomial's)", "all right (binomial's)"]
    header += ["dispersion", "measured on"]

    def row(r: dict) -> list[str]:
        dispersion = "" if r["dispersion"] is None else f"{r['dispersion']:.2f}"
        groups = f"{r['first_group']:,}-{r['first_group'] + r['groups']:,}"
        shares = [f"{r[k]:.3f} ({r[k + '_binomial']:.3f})" for k in ("no_spread", "all_right")]
        return [
            f"`{r['run']}`",
            groups,
            str(r["attempts"]),
            f"{r['mean_reward']:.3f}",
            *shares,
            dispersion,
            measured_on(r),
        ]

    return markdown(header, [row(r) for r in rows])


def streams_table(rows: list[dict]) -> str:
    """scripts/bench_streams.py's rows without routes: each case's best round, and the layers
    against raw redis-py."""
    rows = [r for r in rows if r["kind"] != "codec" and not r["routes"]]
    raw = {r["size"]: r["records_s"] for r in rows if r["kind"] == "raw"}

    def row(r: dict) -> list[str]:
        return [
            r["name"],
            f"{r['record_bytes'] / 1024:.1f} KB",
            f"{r['records_s']:,.0f}",
            f"{r['mb_s']:.1f}",
            f"{r['records_s'] / raw[r['size']]:.2f}" if r["kind"] == "redis" and r["size"] in raw else "",
            f"{r['writer_cpu_us']:.0f} / {r['reader_cpu_us']:.0f} us",
            f"{r['encode_us']:.1f} / {r['decode_us']:.1f} us" if "encode_us" in r else "none",
            f"{r['writer_rss']:.0f} / {r['reader_rss']:.0f} MB",
            r["machine"],
        ]

    header = ["case", "record", "records/s", "MB/s", "of raw redis-py", "CPU a record, writer / reader"]
    header += ["codec a record, encode / decode", "peak RSS, writer / reader", "measured on"]
    return markdown(header, [row(r) for r in rows])


def routes_table(rows: list[dict]) -> str:
    """scripts/bench_streams.py's `--routes-bytes` rows: each layer's tokens/s with routes against
    the same groups without."""
    plain = {(r["kind"], r["size"]): r for r in rows if r["kind"] in ("jsonl", "redis") and not r["routes"]}

    def row(r: dict) -> list[str]:
        base = plain[r["kind"], r["size"]]
        return [
            {"jsonl": "JSONL", "redis": "Redis"}[r["kind"]],
            f"{r['routes']} B",
            f"{base['tokens_s'] / 1e6:.2f} M tokens/s ({base['mb_s']:.0f} MB/s)",
            f"{r['tokens_s'] / 1e6:.2f} M tokens/s ({r['mb_s']:.0f} MB/s)",
            f"{r['tokens_s'] / base['tokens_s']:.2f}",
            r["machine"],
        ]

    routed = [r for r in rows if r["kind"] in ("jsonl", "redis") and r["routes"] and (r["kind"], r["size"]) in plain]
    header = ["layer", "routes a token", "without routes", "with routes", "tokens/s with / without", "measured on"]
    return markdown(header, [row(r) for r in routed])


def codec_table(rows: list[dict]) -> str:
    """scripts/bench_streams.py's `--codec-routes` rows: the codec's bytes and CPU time a token."""
    codec = sorted((r for r in rows if r["kind"] == "codec"), key=lambda r: r["routes"])
    header = ["routes a token", "bytes / token", "encode ns / token", "decode ns / token", "measured on"]
    return markdown(
        header,
        [
            [
                f"{r['routes']} B",
                f"{r['bytes_per_token']:.1f}",
                f"{r['encode_ns_per_token']:.0f}",
                f"{r['decode_ns_per_token']:.0f}",
                r["machine"],
            ]
            for r in codec
        ],
    )


def trainer_table(rows: list[dict]) -> str:
    """scripts/bench_trainer.py's rows: the trainer against the bare loop, and WeightSender against
    a raw gloo broadcast of the same bytes."""

    def row(r: dict) -> list[str]:
        if r["part"] == "training":
            return [
                f"{r['name']}: trainer / bare loop, tokens/s ({r['model']})",
                f"{r['wall_over_bare']:.3f} (CPU time: {r['cpu_over_bare']:.3f})",
                f">= {r['goal']}",
                r["machine"],
            ]
        return [
            f"{r['name']}: WeightSender / raw gloo ({r['bytes'] / MIB:.1f} MiB), best round",
            f"{r['weight_sync_s'] / r['raw_s']:.2f} (median of {r['rounds']} rounds {r['round_ratio']:.2f}); "
            f"{r['weight_sync_s'] * 1e3:.2f} / {r['raw_s'] * 1e3:.2f} ms",
            f"<= {r['goal']}" if r["goal"] else "none (pays a packing copy)",
            r["machine"],
        ]

    return markdown(["measure", "figure", "goal", "measured on"], [row(r) for r in rows])


def update_size_table(rows: list[dict]) -> str:
    """scripts/bench_learning.py's rows of short `--variant` runs: per model and variant, the size of
    the first updates (the largest behaviour KL of versions 2-5) against the later ones' (their
    median and largest), with the start, the final reward and the first-minute fall."""

    def row(r: dict) -> list[str]:
        return [
            f"`{r['model']}`",
            r["mode"],
            cell(r["start"], ".3f"),
            cell(r.get("first_kl_max"), ".4f"),
            cell(r.get("later_kl_median"), ".4f"),
            cell(r.get("later_kl_max"), ".4f"),
            cell(r["final"], ".3f"),
            f"{r['early_fall']:.3f}",
            measured_on(r),
        ]

    header = ["model", "variant", "start", "largest KL, versions 2-5", "median KL after", "largest KL after"]
    header += ["final", "first-minute fall", "measured on"]
    return markdown(header, [row(r) for r in rows])


TABLES: dict[str, tuple[str | tuple[str, ...], Callable, str]] = {
    "headline": (
        ("docs/bench_learning_family.json", "docs/bench_learning_tiny_long.json"),
        headline_table,
        "README.md",
    ),
    "bench_delta": ("docs/bench_delta.json", delta_table, "docs/performance.md"),
    "step_tally": ("docs/step_tally_cpu.json", step_tally_table, "docs/gpu.md"),
    "gpu_calls": ("docs/gpu_host_waits_h200.log", gpu_calls_table, "docs/gpu.md"),
    "bench_logprobs": ("docs/bench_logprobs.json", logprobs_table, "docs/gpu.md"),
    "bench_faults": ("docs/bench_faults.json", faults_table, "docs/running.md"),
    "gpu_swap": ("docs/gpu_host_waits_h200.log", gpu_swap_table, "docs/gpu.md"),
    "gpu_memory": ("docs/gpu_check_suite_h200.log", gpu_memory_table, "docs/gpu.md"),
    "bench_actor": ("docs/bench_actor.json", swap_table, "docs/performance.md"),
    "bench_streams": ("docs/bench_streams.json", streams_table, "docs/performance.md"),
    "bench_trainer": ("docs/bench_trainer.json", trainer_table, "docs/performance.md"),
    "streams_routes": ("docs/bench_streams.json", routes_table, "docs/moe.md"),
    "streams_codec": ("docs/bench_streams.json", codec_table, "docs/moe.md"),
    "bench_lora": ("docs/bench_lora.json", lora_table, "docs/lora.md"),
    "learning_lora": (
        "docs/bench_learning_lora.json",
        functools.partial(variants_table, columns=("dropped",)),
        "docs/lora.md",
    ),
    "learning_tools": (
        "docs/bench_learning_tools.json",
        functools.partial(variants_table, columns=("tool_calls",)),
        "docs/agents.md",
    ),
    "answer_digits_family": ("docs/answer_digits_family.json", digits_table, "docs/learning.md"),
    "group_spread_family": ("docs/group_spread_family.json", spread_table, "docs/learning.md"),
    "learning_lr_by_signal": (
        "docs/bench_learning_lr_by_signal.json",
        functools.partial(learning_table, variants=True),
        "docs/learning.md",
    ),
    "learning_family": ("docs/bench_learning_family.json", family_table, "docs/learning.md"),
    "learning_lr": (
        "docs/bench_learning_lr.json",
        functools.partial(learning_table, variants=True),
        "docs/learning.md",
    ),
    "learning_entropy_plateau": (
        "docs/bench_learning_entropy_plateau.json",
        functools.partial(learning_table, variants=True),
        "docs/learning.md",
    ),
    "learning_entropy": (
        "docs/bench_learning_entropy.json",
        functools.partial(learning_table, variants=True),
        "docs/learning.md",
    ),
    "learning_skip_solved": (
        "docs/bench_learning_skip_solved.json",
        functools.partial(learning_table, variants=True),
        "docs/learning.md",
    ),
    "learning_two_actors": (
        "docs/bench_learning_two_actors.json",
        functools.partial(learning_table, variants=True),
        "docs/learning.md",
    ),
    "learning_step_guidance": ("docs/bench_learning_step_guidance.json", guidance_table, "docs/learning.md"),
    "learning_pipelining_tiny_long": ("docs/bench_learning_tiny_long.json", pipelining_table, "docs/learning.md"),
    "long_chain_prm": ("docs/long_chain_prm_report.json", step_scorer_table, "docs/learning.md"),
    "learning_step_guidance_prm": ("docs/bench_learning_step_guidance_prm.json", guidance_table, "docs/learning.md"),
    "learning_warmup": ("docs/bench_learning_warmup.json", update_size_table, "docs/learning.md"),
    "learning_brief_variants": (
        "docs/bench_learning_brief_variants.json",
        functools.partial(learning_table, variants=True),
        "docs/learning.md",
    ),
    "learning_count_filtered": (
        "docs/bench_learning_count_filtered.json",
        functools.partial(learning_table, variants=True),
        "docs/learning.md",
    ),
    "learning_pipelining_actors": (
        "docs/bench_learning_pipelining_actors.json",
        sweep_tables.pipelining_actors_table,
        "docs/learning.md",
    ),
    "learning_family_sync": (
        "docs/bench_learning_family_sync.json",
        sweep_tables.family_sync_table,
        "docs/learning.md",
    ),
    "learning_decay": ("docs/bench_learning_decay.json", sweep_tables.decay_table, "docs/learning.md"),
    "learning_lr_sweep": ("docs/bench_learning_lr_sweep.json", sweep_tables.lr_sweep_table, "docs/learning.md"),
    "learning_moe": ("docs/bench_learning_moe.json", sweep_tables.moe_table, "docs/learning.md"),
    "learning_moe_sync": ("docs/bench_learning_moe_sync.json", sweep_tables.moe_sync_table, "docs/learning.md"),
    "learning_tiny_long_lag8": ("docs/bench_learning_tiny_long_lag8.json", sweep_tables.lag_table, "docs/learning.md"),
}
"""Table name -> (kept JSON, or a tuple of them, whose loaded list the table is made of, or a GPU
call's kept log, whose result lines it is made of; how it becomes the table; the page it is in)."""

IDENTITY = ("setup", "lr", "model", "mode", "name", "lora_rank")
"""Fields that say which row is which, where a benchmark's rows have them."""

SPAN = re.compile(r"(<!-- table: (\S+) -->\n)(.*?)(<!-- end table -->)", re.S)
"""A generated table's region: the nearest end marker closes it, so an empty region stays one."""


def render(page: str, root: Path = ROOT) -> str:
    """`page`'s text with every generated table made again from its JSON."""

    def table(m: re.Match) -> str:
        name = m.group(2)
        if name not in TABLES:
            raise KeyError(f"a generated table names {name!r}, which is not in TABLES ({sorted(TABLES)})")
        path, make, _ = TABLES[name]
        if isinstance(path, tuple):
            data = [json.loads((root / p).read_text()) for p in path]
        elif path.endswith(".log"):
            data = logged_results((root / path).read_text())
        else:
            data = json.loads((root / path).read_text())
        return m.group(1) + make(data) + "\n" + m.group(4)

    return SPAN.sub(table, page)


def pages() -> list[Path]:
    return sorted({ROOT / page for _, _, page in TABLES.values()})


def moved(new: list[dict], kept: list[dict], tolerance: float) -> list[str]:
    """The figures of `new` outside the band of the matching row of `kept` (module docstring),
    and the rows of either that the other lacks."""

    kept_rows = {identity(r): r for r in kept}
    names = {identity(r): named(r) for r in kept}
    out = []
    for row in new:
        base = kept_rows.pop(identity(row), None)
        if base is None:
            out.append(f"{named(row)}: no such row in the kept run")
            continue
        for field, value in row.items():
            was = base.get(field)
            if field in IDENTITY or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if not isinstance(was, int | float):
                continue
            lo, hi = sorted((was * (1 - tolerance), was * (1 + tolerance)))
            if field.endswith("_median") and isinstance(base.get(field[: -len("median")] + "max"), int | float):
                hi = max(hi, base[field[: -len("median")] + "max"])
            if not lo <= value <= hi:
                out.append(f"{named(row)} {field}: {value:.4g}, kept {was:.4g} (band {lo:.4g}..{hi:.4g})")
    out += [f"{names[k]}: in the kept run only" for k in kept_rows]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a table differs from its JSON")
    parser.add_argument("--compare", type=Path, help="a new run's JSON, compared with --baseline")
    parser.add_argument("--baseline", type=Path, default=ROOT / "docs" / "bench_delta.json")
    parser.add_argument("--tolerance", type=float, default=0.25, help="relative band around each kept figure")
    args = parser.parse_args()
    if args.compare:
        found = moved(json.loads(args.compare.read_text()), json.loads(args.baseline.read_text()), args.tolerance)
        print("\n".join(found) if found else f"every figure of {args.compare} within the kept run's band")
        return 1 if found else 0
    stale = []
    for page in pages():
        text = page.read_text()
        made = render(text)
        if made != text:
            stale.append(page)
            if not args.check:
                page.write_text(made)
    if args.check and stale:
        print(f"out of date: {', '.join(map(str, stale))}: run python scripts/bench_tables.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
