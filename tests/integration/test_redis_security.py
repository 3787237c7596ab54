"""The run's Redis password and TLS against real redis-server processes: the launcher's own
server refuses a client without the run's password, and never shows the password on its
command line; a TLS server is reached through the streams.redis.tls_* keys."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import redis
from fixtures.helpers import free_port

from pipeline_rl.config import ConfigError, load_config
from pipeline_rl.launch.redis_server import start_redis
from pipeline_rl.launch.supervisor import Supervisor
from pipeline_rl.streams import open_streams
from pipeline_rl.streams.records import Metrics
from pipeline_rl.streams.redis_backend import RedisStreams
from pipeline_rl.streams.redis_secret import PASSWORD_FILE, ensure_password, password_path

pytestmark = pytest.mark.redis


def _cfg(tmp_path: Path, *overrides: str):
    return load_config(
        "base",
        [f"run_dir={tmp_path / 'run'}", "name=sec", "streams.backend=redis", "metrics.tensorboard=false", *overrides],
    )


def _round_trip(cfg) -> list[str]:
    """Write one record and read it back through the run's streams; the processes that wrote it."""
    streams = open_streams(cfg)
    try:
        writer = streams.writer("metrics")
        writer.write(Metrics(process="round trip", time=time.time(), values={}))
        writer.flush()
        return [e.record.process for e in streams.reader("metrics", Metrics).read(timeout=2.0)]
    finally:
        streams.close()


def _client(cfg) -> redis.Redis:
    streams = open_streams(cfg)
    assert isinstance(streams, RedisStreams)
    return streams.client


def test_the_password_file_is_private_from_its_first_byte(tmp_path):
    """Made with mode 0600 even under a umask that would leave it world-readable; made once and
    read back; a copy others may read is refused."""
    old = os.umask(0)
    try:
        first = ensure_password(tmp_path)
    finally:
        os.umask(old)
    path = password_path(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(first) >= 40 and ensure_password(tmp_path) == first  # token_urlsafe(32): 43 characters
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by other users"):
        ensure_password(tmp_path)


def test_the_runs_server_refuses_clients_without_its_password(tmp_path):
    port = free_port()
    cfg = _cfg(tmp_path, "streams.redis.start_server=true", f"streams.redis.port={port}")
    Path(cfg.run_dir).mkdir(parents=True)
    services = Supervisor(Path(cfg.run_dir) / "logs")
    try:
        start_redis(cfg, services)
        password = (Path(cfg.run_dir) / PASSWORD_FILE).read_text().strip()
        [server] = services.children
        assert password not in " ".join(psutil.Process(server.proc.pid).cmdline())
        conf = Path(cfg.run_dir) / "redis" / "redis.conf"
        assert stat.S_IMODE(conf.stat().st_mode) == 0o600

        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        with pytest.raises((redis.AuthenticationError, redis.ResponseError)):
            redis.Redis(port=port, password="not-the-password").ping()
        # Every process of the run reads the password from the run directory.
        assert _round_trip(cfg) == ["round trip"]
    finally:
        services.stop()


def test_an_external_password_comes_from_the_named_environment_variable(tmp_path, monkeypatch):
    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    assert server.stdin is not None
    server.stdin.write(f'port {port}\nbind 127.0.0.1\nsave ""\nrequirepass s3cret-of-the-user\n'.encode())
    server.stdin.close()
    try:
        _wait(port)
        cfg = _cfg(tmp_path, f"streams.redis.port={port}", "streams.redis.password_env=TEST_REDIS_PASSWORD")
        monkeypatch.delenv("TEST_REDIS_PASSWORD", raising=False)
        with pytest.raises(ConfigError, match="TEST_REDIS_PASSWORD, which is not set"):
            open_streams(cfg)
        monkeypatch.setenv("TEST_REDIS_PASSWORD", "s3cret-of-the-user")
        assert _round_trip(cfg) == ["round trip"]
    finally:
        server.terminate()
        server.wait(timeout=10)


def _wait(port: int) -> None:
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"redis-server did not start on port {port}")


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def _make_certs(d: Path) -> None:
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate, all signed
    by the CA; and a second CA that signed nothing here."""
    for ca in ("ca", "other_ca"):
        _openssl(
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            f"/CN={ca}",
            "-keyout",
            d / f"{ca}.key",
            "-out",
            d / f"{ca}.crt",
        )
    for name, extra in (
        ("server", "subjectAltName=DNS:localhost,IP:127.0.0.1"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={name}",
            "-keyout",
            d / f"{name}.key",
            "-out",
            d / f"{name}.csr",
        )
        (d / f"{name}.ext").write_text(extra + "\n")
        _openssl(
            "x509",
            "-req",
            "-in",
            d / f"{name}.csr",
            "-CA",
            d / "ca.crt",
            "-CAkey",
            d / "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            d / f"{name}.ext",
            "-out",
            d / f"{name}.crt",
        )


@pytest.fixture
def tls_server(tmp_path):
    if shutil.which("openssl") is None:
        pytest.fail("openssl is not on PATH (needed to make the test's certificates)")
    certs = tmp_path / "certs"
    certs.mkdir()
    _make_certs(certs)
    port = free_port()
    server = subprocess.Popen(
        [
            "redis-server",
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--tls-cert-file",
            str(certs / "server.crt"),
            "--tls-key-file",
            str(certs / "server.key"),
            "--tls-ca-cert-file",
            str(certs / "ca.crt"),
            "--tls-auth-clients",
            "yes",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        _wait(port)
    except RuntimeError:
        server.kill()
        out = server.stdout.read().decode() if server.stdout else ""
        pytest.fail(f"this redis-server cannot serve TLS: {out[-500:]}")
    yield port, certs
    server.terminate()
    server.wait(timeout=10)


def test_tls_to_an_external_server(tmp_path, tls_server):
    """Server verified against tls_ca_file, client certificate from tls_cert_file/tls_key_file;
    a wrong CA, or no client certificate where the server requires one, is refused."""
    port, certs = tls_server
    base = [f"streams.redis.port={port}", "streams.redis.host=localhost", "streams.redis.tls=true"]
    ca = f"streams.redis.tls_ca_file={certs / 'ca.crt'}"
    client = [
        f"streams.redis.tls_cert_file={certs / 'client.crt'}",
        f"streams.redis.tls_key_file={certs / 'client.key'}",
    ]
    assert _round_trip(_cfg(tmp_path, *base, ca, *client)) == ["round trip"]

    wrong_ca = _cfg(tmp_path, *base, f"streams.redis.tls_ca_file={certs / 'other_ca.crt'}", *client)
    with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
        _client(wrong_ca).ping()
    without_client_cert = _cfg(tmp_path, *base, ca)
    with pytest.raises(redis.ConnectionError):
        _client(without_client_cert).ping()
    # Plain TCP to the TLS port gets nothing back.
    with pytest.raises(redis.ConnectionError):
        _client(_cfg(tmp_path, f"streams.redis.port={port}")).ping()
