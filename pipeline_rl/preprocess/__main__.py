"""`python -m pipeline_rl.preprocess --run-dir RUN_DIR --index I`: one preprocessor process (the launcher runs it)."""

from pipeline_rl.core.process import exit_process
from pipeline_rl.preprocess.preprocessor import main

exit_process(main())
