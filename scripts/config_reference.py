"""Write docs/config.md, the list of every config key, from the schema's own docstrings.

    python scripts/config_reference.py            rewrite docs/config.md
    python scripts/config_reference.py --check    exit 1 when docs/config.md is out of date

The schema (pipeline_rl/config/schema.py and pool_sections.py) documents each key once, as the docstring under its
field; this page is generated from it so the two cannot disagree (tests/unit/test_config_reference.py).
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pipeline_rl.config.bounds import Bounds  # noqa: E402

SCHEMA = [ROOT / "pipeline_rl" / "config" / name for name in ("schema.py", "pool_sections.py")]
PLUGINS = [
    ROOT / "pipeline_rl" / "rollouts" / name
    for name in ("domains/math.py", "domains/agent.py", "domains/verifiers_env.py", "agent/settings.py")
]
PLUGIN_SETTINGS = [("MathReward", "math"), ("AgentSettings", "agent"), ("VerifiersSettings", "verifiers")]
"""The built-in domains' own settings (actor.domain_settings): their class and the domain's name."""
PAGE = ROOT / "docs" / "config.md"


def _fields(cls: ast.ClassDef, classes: dict[str, ast.ClassDef]) -> list[tuple[str, str, str, str, str]]:
    """(name, type, default, valid range, docstring) of each annotated field, in order (a base
    class's first)."""
    out = [f for base in cls.bases if isinstance(base, ast.Name) for f in _fields(classes[base.id], classes)]
    body = cls.body
    for i, node in enumerate(body):
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        doc = ""
        after = body[i + 1] if i + 1 < len(body) else None
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            doc = " ".join(after.value.value.split())
        default, valid = "", ""
        if isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "bounded":
            bounds = Bounds(**{k.arg: ast.literal_eval(k.value) for k in node.value.keywords if k.arg})
            default = ast.unparse(node.value.args[0])
            valid = bounds.describe().removeprefix("must be ") + (f" ({bounds.why})" if bounds.why else "")
        elif node.value is not None:
            default = ast.unparse(node.value)
            factory = re.fullmatch(r"field\(default_factory=(.+)\)", default)
            if factory:
                made = factory.group(1)
                default = made.removeprefix("lambda: ") if made.startswith("lambda") else f"{made}()"
        out.append((node.target.id, ast.unparse(node.annotation), default, valid, doc))
    return out


def reference() -> str:
    trees = [ast.parse(path.read_text()) for path in SCHEMA + PLUGINS]
    classes = {n.name: n for tree in trees for n in tree.body if isinstance(n, ast.ClassDef)}
    sections: list[str] = []

    def section(cls_name: str, prefix: str, title: str = "") -> None:
        cls = classes[cls_name]
        rows, nested = [], []
        for name, annotation, default, valid, doc in _fields(cls, classes):
            key = f"{prefix}{name}"
            inner = [c for c in re.findall(r"\w+", annotation) if c in classes]
            if inner:
                suffix = "[]" if annotation.startswith("list[") else ""
                nested.append((inner[0], f"{key}{suffix}."))
                rows.append(f"| `{key}` | section `{inner[0]}` | {_cell(default)} | | {_cell(doc)} |")
            else:
                rows.append(f"| `{key}` | `{annotation}` | {_cell(default)} | {_cell(valid)} | {_cell(doc)} |")
        title = title or f"`{prefix.rstrip('.')}`" if prefix else "(top level)"
        what = " ".join((ast.get_docstring(cls) or "").split())
        intro = f"{what}\n\n" if what else ""
        sections.append(
            f"## {title}\n\n{intro}| key | type | default | valid | meaning |\n| --- | --- | --- | --- | --- |\n"
            + "\n".join(rows)
        )
        for inner_cls, inner_prefix in nested:
            section(inner_cls, inner_prefix)

    section("RunConfig", "")
    for cls_name, domain in PLUGIN_SETTINGS:
        section(cls_name, "actor.domain_settings.", f"`actor.domain_settings` of domain `{domain}`")
    head = (
        "# Every config key\n\n"
        "Generated from `pipeline_rl/config/schema.py`, `pool_sections.py` and the built-in domains by `python scripts/config_reference.py`; edit the\n"
        "schema's docstrings, not this page. A config is `base.yaml`, then the named config (which may\n"
        "`extends:` another), then the dotted overrides of the command line; unknown keys are rejected\n"
        "with a suggestion, and a value outside its key's valid range (declared on the field,\n"
        "`pipeline_rl/config/bounds.py`) is refused naming the key. Choice-valued keys list their\n"
        "choices in `pipeline_rl/config/choices.py`. The built-in domains' own settings\n"
        "(`actor.domain_settings`, declared by each domain) close the page.\n"
    )
    return head + "\n" + "\n\n".join(sections) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ") if text else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/config.md is out of date")
    args = parser.parse_args()
    text = reference()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE} is out of date: run python scripts/config_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
