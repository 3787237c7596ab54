"""`python -m pipeline_rl.actor --run-dir RUN_DIR --index I`: one actor process (the launcher runs it)."""

import sys

from pipeline_rl.actor.actor import main

sys.exit(main())
