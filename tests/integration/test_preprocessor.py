"""The preprocessor end to end on a JSONL run dir: the real CLI process, stopped and
resumed, then two preprocessors (the scored-group hop) with a reference scorer, in-process."""

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import orjson
import pytest
from fixtures.helpers import ROOT, random_qwen2

from pipeline_rl.config import RunConfig, ScorerConfig, save_config
from pipeline_rl.metrics import MetricsLogger
from pipeline_rl.preprocess.advantages import all_zero, group_advantages
from pipeline_rl.preprocess.packing import is_padding
from pipeline_rl.preprocess.preprocessor import StepAssembler, run
from pipeline_rl.streams import PositionStore, open_streams
from pipeline_rl.streams.records import MicroBatch, Rollout, RolloutGroup
from pipeline_rl.wire import Topic


def make_cfg(tmp_path, actors=2, trainers=2, preprocessors=1) -> RunConfig:
    cfg = RunConfig()
    cfg.name = "pp"
    cfg.run_dir = str(tmp_path / "run")
    cfg.metrics.tensorboard = False
    cfg.world.actors, cfg.world.trainers, cfg.world.preprocessors = actors, trainers, preprocessors
    cfg.shared.groups_per_step = 3
    cfg.shared.max_steps = 6
    cfg.preprocess.seq_length = 48
    cfg.preprocess.batch_groups = 2
    return cfg


def make_group(i: int, vocab: int = 97) -> RolloutGroup:
    """Group i: three rollouts of random lengths; every fourth group has equal rewards (filtered)."""
    rng = random.Random(i)
    rollouts = []
    for k in range(3):
        p, c = rng.randint(2, 10), rng.randint(2, 20)
        rollouts.append(
            Rollout(
                prompt_ids=[rng.randrange(vocab) for _ in range(p)],
                completion_ids=[rng.randrange(vocab) for _ in range(c)],
                logprobs=[-rng.random() for _ in range(c)],
                versions=[i // 3] * c,
                reward=1.0 if i % 4 == 3 else float(k == i % 3),
                finish_reason="stop",
            )
        )
    return RolloutGroup(problem_id=f"p{i}", group_id=f"g{i}", rollouts=rollouts, actor=i % 2)


def write_groups(cfg: RunConfig, indices) -> list[RolloutGroup]:
    streams = open_streams(cfg)
    writer = streams.writer(Topic.ACTOR, partitions=cfg.world.actors)
    groups = [make_group(i) for i in indices]
    for g in groups:
        writer.write(g, partition=g.actor % cfg.world.actors)
    streams.close()
    return groups


def read_micro_batches(cfg: RunConfig) -> list[list[MicroBatch]]:
    streams = open_streams(cfg)
    out = []
    for rank in range(cfg.world.trainers):
        reader = streams.reader(Topic.TRAINER, MicroBatch, partitions=(rank,))
        batches = []
        while entries := reader.read(timeout=0.2):
            batches += [e.record for e in entries]
        out.append(batches)
    streams.close()
    return out


def saved_step(cfg: RunConfig, index: int = 0) -> int:
    saved = PositionStore(Path(cfg.run_dir) / "positions" / f"preprocessor{index}.json").load()
    return saved["next_step"] if saved else 0


def run_cli_until(cfg: RunConfig, step: int) -> None:
    """Run `python -m pipeline_rl.preprocess` until it has saved `step`, then SIGTERM it."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline_rl.preprocess", "--run-dir", cfg.run_dir, "--index", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.time() + 60
        while saved_step(cfg) < step:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.time() < deadline, "preprocessor did not reach step in time"
            time.sleep(0.1)
        time.sleep(0.5)  # let it read (but not save) groups of the next, incomplete step
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0].decode()
    assert proc.returncode == 0, out


def check_steps(per_rank: list[list[MicroBatch]], steps: int) -> dict[int, list[tuple]]:
    """Equal counts per rank, 0-based step numbering, indices, denominators; returns the
    real sequences of each step as (group_id, input_ids, advantages, loss_mask, ref_logprobs)."""
    by_step = [defaultdict(list) for _ in per_rank]
    for rank, batches in enumerate(per_rank):
        assert [mb.step for mb in batches] == sorted(mb.step for mb in batches)
        for mb in batches:
            by_step[rank][mb.step].append(mb)
    sequences = {}
    for step in range(steps):
        mbs = [by_step[rank][step] for rank in range(len(per_rank))]
        count = len(mbs[0])
        assert all(len(m) == count for m in mbs), f"step {step}: unequal counts per rank"
        for m in mbs:
            assert [mb.index for mb in m] == list(range(count)) and all(mb.count == count for mb in m)
        flat = [mb for m in mbs for mb in m]
        seqs = []
        for mb in flat:
            if is_padding(mb):
                continue
            start = 0
            for n, gid in zip(mb.seq_lengths, mb.group_ids):
                sl = slice(start, start + n)
                ref = mb.ref_logprobs[sl] if mb.ref_logprobs is not None else None
                seqs.append((gid, mb.input_ids[sl], mb.advantages[sl], mb.loss_mask[sl], ref))
                start += n
        assert all(mb.step_tokens == sum(sum(x.loss_mask) for x in flat) for mb in flat)
        assert all(mb.step_samples == len(seqs) for mb in flat)
        sequences[step] = seqs
    assert set().union(*(s.keys() for s in by_step)) == set(range(steps))
    return sequences


def test_cli_end_to_end_with_resume(tmp_path):
    cfg = make_cfg(tmp_path)
    save_config(cfg, Path(cfg.run_dir) / "config.yaml")
    # A step is 3 groups taken, filtered ones included: groups 0..9 make 3 steps, 1 left over.
    written = write_groups(cfg, range(10))
    run_cli_until(cfg, 3)
    assert len(check_steps(read_micro_batches(cfg), 3)) == 3
    written += write_groups(cfg, range(10, 20))
    run_cli_until(cfg, 6)

    steps = check_steps(read_micro_batches(cfg), 6)
    source = {g.group_id: g for g in written}
    used = defaultdict(list)
    for step, seqs in steps.items():
        assert len({gid for gid, *_ in seqs}) <= 3, f"step {step} holds more than 3 groups"
        for gid, ids, adv, mask, _ in seqs:
            used[gid].append((ids, adv, mask))
    # No group lost or duplicated across the restart; filtered groups never reach the trainer;
    # 18 of the 20 groups were taken, so at most 2 kept ones are still waiting.
    kept = [g for g in written if not all_zero(group_advantages(g, cfg.preprocess.advantage))]
    assert len(kept) == 15 and len(kept) - 2 <= len(used) <= len(kept)
    assert all(not all_zero(group_advantages(source[gid], cfg.preprocess.advantage)) for gid in used)
    for partition in range(2):
        order = [g.group_id for g in kept if g.actor == partition]
        taken = [gid for gid in order if gid in used]
        assert taken == order[: len(taken)], "groups were not taken in stream order"
    # Each group's three sequences carry the group's advantages on the completion tokens.
    for gid, seqs in used.items():
        group = source[gid]
        expected = group_advantages(group, cfg.preprocess.advantage)
        assert len(seqs) == 3
        for r, adv in zip(group.rollouts, expected):
            match = [s for s in seqs if s[0] == r.prompt_ids + r.completion_ids]
            assert len(match) == 1
            _, got_adv, mask = match[0]
            assert mask == [0] * len(r.prompt_ids) + [1] * len(r.completion_ids)
            assert got_adv[len(r.prompt_ids) :] == pytest.approx(adv)
    # The run resumed at step 3 rather than renumbering; the metrics count filtered groups.
    metrics_file = Path(cfg.run_dir) / "metrics" / "preprocessor0.jsonl"
    metrics = [orjson.loads(line) for line in metrics_file.read_bytes().splitlines()]
    step_records = [m for m in metrics if "preprocess/groups_out" in m["values"]]
    assert [m["step"] for m in step_records] == [0, 1, 2, 3, 4, 5]
    assert all(m["values"]["preprocess/groups_in"] == 3 for m in step_records)
    assert (
        sum(m["values"]["preprocess/groups_in"] - m["values"]["preprocess/groups_out"] for m in step_records)
        == sum(m["values"]["preprocess/groups_filtered"] for m in step_records)
        > 0
    )


def test_two_preprocessors_with_reference_scorer(tmp_path):
    random_qwen2().save_pretrained(tmp_path / "model")
    cfg = make_cfg(tmp_path, actors=2, trainers=1, preprocessors=2)
    cfg.model.path = str(tmp_path / "model")
    cfg.shared.max_steps = 3
    cfg.preprocess.scorers = [ScorerConfig(cls="pipeline_rl.scorers:ReferenceLogprobScorer")]
    write_groups(cfg, range(16))
    done = threading.Event()
    helper = threading.Thread(target=run, args=(cfg, 1, done.is_set))
    helper.start()
    try:
        deadline = time.time() + 60
        next_step = run(cfg, 0, lambda: saved_step(cfg) >= 3 or time.time() > deadline)
    finally:
        done.set()
        helper.join(timeout=30)
    assert next_step == 3
    steps = check_steps(read_micro_batches(cfg), 3)
    groups = {gid for seqs in steps.values() for gid, *_ in seqs}
    # Actor partition 1 belongs to preprocessor 1: its groups came through the scored hop.
    assert any(int(gid[1:]) % 2 == 1 for gid in groups) and any(int(gid[1:]) % 2 == 0 for gid in groups)
    assert Path(cfg.run_dir, "streams", Topic.SCORED, "1.jsonl").stat().st_size > 0
    for seqs in steps.values():
        for _gid, ids, _adv, mask, ref in seqs:
            assert ref is not None and len(ref) == len(ids)
            assert all(lp < 0 for lp, m in zip(ref, mask) if m)


def test_shared_prompts_lay_out_every_rollout(tmp_path):
    """With shared.share_prompts a group becomes one prompt followed by its completions, and
    each rollout's prompt + completion (and its advantages) can be read back from the step."""
    cfg = make_cfg(tmp_path, actors=1, trainers=1)
    cfg.shared.share_prompts = True
    cfg.shared.max_steps = 2
    streams = open_streams(cfg)
    writer = streams.writer(Topic.ACTOR, partitions=1)
    groups = []
    for i in range(6):
        g = make_group(i)
        for r in g.rollouts:
            r.prompt_ids = [5, 6, 7, i]
        g.actor = 0
        writer.write(g, partition=0)
        groups.append(g)
    streams.close()
    deadline = time.time() + 60
    assert run(cfg, 0, lambda: saved_step(cfg) >= 2 or time.time() > deadline) == 2
    (batches,) = read_micro_batches(cfg)
    rebuilt = defaultdict(list)
    # A micro-batch of heads only (each group's block filled its row) carries no prefix lengths.
    assert any(mb.prefix_lengths for mb in batches)
    for mb in batches:
        prefixes = mb.prefix_lengths or [0] * len(mb.seq_lengths)
        start, prompt = 0, None
        for n, p, gid in zip(mb.seq_lengths, prefixes, mb.group_ids):
            ids, adv = mb.input_ids[start : start + n], mb.advantages[start : start + n]
            assert mb.position_ids[start : start + n] == list(range(p, p + n))
            if p == 0:
                prompt = ids[:4]
                rebuilt[gid].append((ids, adv[4:]))
            else:
                rebuilt[gid].append((prompt + ids, adv))
            start += n
    kept = [g for g in groups if not all_zero(group_advantages(g, cfg.preprocess.advantage))]
    assert sorted(rebuilt) == sorted(g.group_id for g in kept)
    for g in kept:
        expected = [
            (r.prompt_ids + r.completion_ids, a)
            for r, a in zip(g.rollouts, group_advantages(g, cfg.preprocess.advantage))
        ]
        assert sorted(rebuilt[g.group_id]) == sorted(expected)


@pytest.mark.parametrize("count_filtered", [True, False])
def test_a_filtered_groups_tokens_count_in_the_steps_denominators(tmp_path, count_filtered):
    """preprocess.advantage.count_filtered: the step's micro-batches carry the completion tokens
    (and sequences) of the groups filtered for zero advantage, beside the trained ones; or none."""
    cfg = make_cfg(tmp_path, actors=1, trainers=2)
    cfg.preprocess.advantage.count_filtered = count_filtered
    kept, filtered = make_group(0), make_group(3)  # group 3: equal rewards
    assert all_zero(group_advantages(filtered, cfg.preprocess.advantage))
    streams = open_streams(cfg)
    assembler = StepAssembler(cfg, streams, MetricsLogger(cfg, "preprocessor0"), next_step=0)
    assembler.add([kept, filtered, make_group(7)])  # group 7: filtered too
    assembler.write_step()
    streams.close()
    batches = [mb for rank in read_micro_batches(cfg) for mb in rank]
    tokens = sum(len(r.completion_ids) for g in (filtered, make_group(7)) for r in g.rollouts)
    expected = (tokens, 6) if count_filtered else (0, 0)
    assert {(mb.filtered_tokens, mb.filtered_samples) for mb in batches} == {expected}
    # Both filtered groups are solved (reward 1, above the step's mean of 7/9): none is unsolved.
    assert {mb.unsolved_samples for mb in batches} == {0}
    # The trained denominators hold the kept group alone.
    assert {mb.step_tokens for mb in batches} == {sum(len(r.completion_ids) for r in kept.rollouts)}


def test_the_filtered_groups_below_the_steps_mean_reward_are_counted_as_unsolved(tmp_path):
    """trainer.optimizer.lr_by_signal=unsolved: of the filtered groups, those whose reward is
    below the step's mean reward (here a failed group: 0 against (1 + 3 + 0) / 9) count their
    samples as unsolved; a solved one (1) does not."""
    cfg = make_cfg(tmp_path, actors=1, trainers=2)
    failed = make_group(7)
    for rollout in failed.rollouts:
        rollout.reward = 0.0
    streams = open_streams(cfg)
    assembler = StepAssembler(cfg, streams, MetricsLogger(cfg, "preprocessor0"), next_step=0)
    assembler.add([make_group(0), make_group(3), failed])
    assembler.write_step()
    streams.close()
    batches = [mb for rank in read_micro_batches(cfg) for mb in rank]
    assert {(mb.filtered_samples, mb.unsolved_samples) for mb in batches} == {(6, 3)}
