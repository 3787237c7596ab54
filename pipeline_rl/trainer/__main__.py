"""`python -m pipeline_rl.trainer --run-dir RUN_DIR --index I`: one trainer process (the launcher runs it)."""

import sys

from pipeline_rl.trainer.trainer import main

sys.exit(main())
