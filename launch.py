"""Start a pipeline_rl run: `python launch.py conf=tiny [key.sub=value ...] [--fresh]`."""

import sys

from pipeline_rl.launcher import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
