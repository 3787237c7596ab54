"""`python -m pipeline_rl.trainer --run-dir RUN_DIR --index I`: one trainer process (the launcher runs it)."""

from pipeline_rl.core.process import exit_process
from pipeline_rl.trainer.trainer import main

exit_process(main())
