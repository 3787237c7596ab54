"""Export a LoRA checkpoint as a plain Hugging Face model: the base with the adapter merged into
its weights (peft's merge_and_unload), with the base's tokenizer files.

    python scripts/merge_lora.py SOURCE OUT [--base DIR]

SOURCE is a run directory (its latest checkpoint's adapter) or a PEFT adapter directory. The
base defaults to the adapter's `base_model_name_or_path` (the run's model.path).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    from pipeline_rl.lora import CONFIG_FILE, merge
    from pipeline_rl.trainer.checkpoint import ADAPTER_DIR, copy_tokenizer_files, latest_checkpoint

    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("source", type=Path, help="run directory or PEFT adapter directory")
    parser.add_argument("out", type=Path)
    parser.add_argument("--base", help="the base model directory (default: the adapter's)")
    args = parser.parse_args()
    adapter = args.source
    if not (adapter / CONFIG_FILE).is_file():
        found = latest_checkpoint(args.source)
        if found is None or found[0].name != ADAPTER_DIR:
            print(f"{args.source}: neither a PEFT adapter nor a run directory with a LoRA checkpoint", file=sys.stderr)
            return 2
        adapter = found[0]
    base = args.base or json.loads((adapter / CONFIG_FILE).read_text()).get("base_model_name_or_path")
    if not base:
        print(f"{adapter / CONFIG_FILE} names no base model: pass --base", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    merge(adapter, base, args.out)
    copy_tokenizer_files(base, args.out)
    print(f"merged {adapter} into {base}: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
