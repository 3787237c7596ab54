"""docs/config.md is the schema's own documentation: every key of RunConfig, documented, and the
page in step with the schema (scripts/config_reference.py writes it)."""

import dataclasses
import typing

from fixtures.helpers import ROOT, load_script

from pipeline_rl.config import RunConfig
from pipeline_rl.rollouts.domains.agent import AgentSettings
from pipeline_rl.rollouts.domains.math import MathReward
from pipeline_rl.rollouts.domains.verifiers_env import VerifiersSettings


def _script():
    return load_script("config_reference")


def _keys(cls, prefix=""):
    """Every dotted key of a config dataclass, as the loader accepts them."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        yield f"{prefix}{f.name}"
        for inner in (hint, *typing.get_args(hint)):
            if dataclasses.is_dataclass(inner) and isinstance(inner, type):
                suffix = "[]" if typing.get_origin(hint) is list else ""
                yield from _keys(inner, f"{prefix}{f.name}{suffix}.")


def test_every_key_is_on_the_page_with_its_meaning():
    page = _script().reference()
    rows = {line.split("`")[1]: line for line in page.splitlines() if line.startswith("| `")}
    keys = list(_keys(RunConfig))
    assert len(keys) > 100
    for settings in (MathReward, AgentSettings, VerifiersSettings):  # the built-in domains' own
        keys += _keys(settings, "actor.domain_settings.")
    assert set(keys) == set(rows)
    undocumented = [k for k, row in rows.items() if row.rstrip().endswith("|  |")]
    assert not undocumented, f"keys without a docstring in pipeline_rl/config/schema.py: {undocumented}"


def test_the_page_in_the_repository_is_up_to_date():
    assert (ROOT / "docs" / "config.md").read_text() == _script().reference(), (
        "docs/config.md is out of date: python scripts/config_reference.py"
    )
