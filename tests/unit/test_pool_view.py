"""A pool process gets its own config section, `shared` and the machinery; the other pools'
sections are withheld (pipeline_rl/config/pool_view.py, applied by core/process.py)."""

from __future__ import annotations

import copy

import pytest

from pipeline_rl.config import RunConfig, save_config
from pipeline_rl.config.pool_view import WithheldKeyError, for_pool
from pipeline_rl.core.process import run_pool_process


def test_a_pool_reads_its_section_shared_and_the_machinery_but_not_another_pools():
    cfg = RunConfig()
    cfg.shared.max_lag = 7
    view = for_pool(cfg, "preprocessor")
    assert view.shared.max_lag == 7 and view.preprocess is cfg.preprocess and view.model is cfg.model
    with pytest.raises(WithheldKeyError, match=r"the preprocessor pool read 'trainer\.loss'"):
        _ = view.trainer.loss
    # not an AttributeError: a default cannot hide the read
    with pytest.raises(WithheldKeyError, match=r"'actor\.top_p'"):
        getattr(view.actor, "top_p", None)
    # the launcher's config is untouched, and a view can be copied
    assert cfg.trainer.loss is not None and cfg.actor is not None
    assert copy.deepcopy(view).shared.max_lag == 7


def test_each_pool_keeps_only_its_own_section():
    cfg = RunConfig()
    for pool, own in (("actor", "actor"), ("preprocessor", "preprocess"), ("trainer", "trainer")):
        view = for_pool(cfg, pool)
        for section in ("actor", "preprocess", "trainer"):
            if section == own:
                assert getattr(view, section) is getattr(cfg, section)
            else:
                with pytest.raises(WithheldKeyError):
                    _ = getattr(view, section).anything
    with pytest.raises(ValueError, match="no pool is called 'scorer'"):
        for_pool(cfg, "scorer")


def test_a_pool_process_that_reads_another_pools_section_fails_naming_the_key(tmp_path, capsys):
    save_config(RunConfig(), tmp_path / "config.yaml")
    argv = ["--run-dir", str(tmp_path), "--index", "0"]

    def reads_own(cfg, index, stop):
        return f"max_new_tokens {cfg.actor.max_new_tokens}, max_lag {cfg.shared.max_lag}"

    def reads_trainer(cfg, index, stop):
        return f"lr {cfg.trainer.lr}"

    assert run_pool_process("actor", reads_own, argv) == 0
    assert run_pool_process("actor", reads_trainer, argv) == 1
    assert "actor0 failed: WithheldKeyError: the actor pool read 'trainer.lr'" in capsys.readouterr().err
