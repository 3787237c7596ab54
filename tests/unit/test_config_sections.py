"""Each pool's code reads its own config section, the `shared` block and the run's machinery
(model, world, streams, metrics), never another pool's section: what crosses pools is in
`shared`, where the schema documents who reads it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "pipeline_rl"
POOLS = {"actor": ("actor", "engine", "rollouts"), "preprocess": ("preprocess", "scorers"), "trainer": ("trainer",)}
# The one cross-section read, and why it is not a shared key: the launcher checks, before
# starting anything, that the scorers produce what the loss needs.
EXCEPTIONS = {("scorers/base.py", "trainer"): "check_scorers: the scorers against trainer.loss.kl_coef"}


def section_reads(path: Path) -> list[tuple[str, int]]:
    """(section, line) of every `<...>cfg.<section>` / `<...>config.<section>` in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in POOLS:
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name in ("cfg", "config"):
                found.append((node.attr, node.lineno))
    return found


def test_pools_read_only_their_own_sections():
    wrong = []
    for pool, packages in POOLS.items():
        for package in packages:
            for path in sorted((ROOT / package).rglob("*.py")):
                rel = str(path.relative_to(ROOT))
                for section, line in section_reads(path):
                    if section != pool and (rel, section) not in EXCEPTIONS:
                        wrong.append(f"{rel}:{line} (the {pool} pool) reads cfg.{section}")
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_foreign_read(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f(self):\n    return self.cfg.trainer.max_lag + cfg.actor.top_p\n")
    assert sorted(section_reads(source)) == [("actor", 2), ("trainer", 2)]
