"""`python -m pipeline_rl.actor --run-dir RUN_DIR --index I`: one actor process (the launcher runs it)."""

from pipeline_rl.actor.actor import main
from pipeline_rl.core.process import exit_process

exit_process(main())
