"""Start a pipeline_rl run from a checkout: `python launch.py conf=tiny [key=value ...] [--fresh]`.

The installed package gives the same command as `pipeline-rl`.
"""

from pipeline_rl.launch.launcher import cli

if __name__ == "__main__":
    cli()
