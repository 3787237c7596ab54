"""The Redis password of a run: where it comes from, and how it reaches redis-server.

A Redis the run starts (`streams.redis.start_server`) gets a random password, made once per
run directory and kept in RUN_DIR/redis.password with mode 0600; every process of the run
reads it from there when it opens its streams (the run directory is shared by every node).
redis-server gets it in a config file of the same mode (RUN_DIR/redis/redis.conf), never on
its command line, which any user of the machine can read in `ps`. The secret is never in
config.yaml, a log line or a metric.

An external Redis takes its password from the environment variable that
`streams.redis.password_env` names (null: no password).
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from pipeline_rl.config import ConfigError, RunConfig

PASSWORD_FILE = "redis.password"
"""Under the run directory."""
SERVER_CONFIG = "redis.conf"
"""Under the Redis server's own directory."""


def password_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / PASSWORD_FILE


def _write_private(path: Path, text: str) -> None:
    """Create `path` readable by its owner only from the first byte (os.open with 0600 and
    O_EXCL: no window in which it exists with the umask's wider mode)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def ensure_password(run_dir: str | os.PathLike) -> str:
    """The run's password: made (secrets.token_urlsafe, 256 bits) the first time, then read
    back, so that a resumed run's processes and its restarted server agree."""
    path = password_path(run_dir)
    if not path.exists():
        _write_private(path, secrets.token_urlsafe(32))
    return read_password(path)


def read_password(path: Path) -> str:
    """The password in `path`; refuses a file that others may read."""
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except FileNotFoundError:
        raise ConfigError(
            f"the run's Redis password file {path} is missing: the launcher writes it when it starts Redis "
            "(streams.redis.start_server); is run_dir on a file system every node shares?"
        ) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{path} is readable by other users (mode {stat.filemode(mode)}): chmod 600 it")
    if not text:
        raise ConfigError(f"the run's Redis password file {path} is empty")
    return text


def redis_password(cfg: RunConfig) -> str | None:
    """The password every process of the run gives Redis (AUTH), or None."""
    r = cfg.streams.redis
    if r.start_server:
        return read_password(password_path(cfg.run_dir))
    if r.password_env is None:
        return None
    value = os.environ.get(r.password_env)
    if not value:
        raise ConfigError(
            f"streams.redis.password_env names {r.password_env}, which is not set in this process's environment"
        )
    return value


def write_server_config(redis_dir: Path, password: str) -> Path:
    """redis-server's config file holding the password (its first argument: options given on
    the command line after it override nothing in it)."""
    path = redis_dir / SERVER_CONFIG
    _write_private(path, f"requirepass {password}\n")
    return path
