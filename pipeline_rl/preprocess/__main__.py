"""`python -m pipeline_rl.preprocess --run-dir RUN_DIR --index I`: one preprocessor process (the launcher runs it)."""

import sys

from pipeline_rl.preprocess.preprocessor import main

sys.exit(main())
