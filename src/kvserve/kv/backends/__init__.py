"""KV tier backends, selected by name: the host-memory tier (``cpu``, fixed slots,
:class:`~kvserve.kv.backends.base.Backend`) and the storage tiers below it (``disk``, ``fs``,
``redis``: key-addressed, :class:`~kvserve.kv.backends.storage.StorageBackend`). A new tier
(object store, RDMA pool) registers here with :func:`register_backend`; the offloading
manager and connector need no change."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

BACKENDS: dict[str, Callable[..., Any]] = {}
_BUILTIN = {
    "cpu": "kvserve.kv.backends.cpu",
    "disk": "kvserve.kv.backends.disk",
    "fs": "kvserve.kv.backends.fs",
    "redis": "kvserve.kv.backends.redis",
    "valkey": "kvserve.kv.backends.redis",
}


def register_backend(name: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        BACKENDS[name] = cls
        return cls

    return deco


def backend_class(name: str) -> Callable[..., Any]:
    """The backend registered as ``name`` (``cpu``, ``disk``, ...), its module imported."""
    if name not in BACKENDS and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])
    if name not in BACKENDS:
        raise ValueError(
            f"unknown KV backend {name!r}; known: {sorted(set(BACKENDS) | set(_BUILTIN))}"
        )
    return BACKENDS[name]


def create_backend(name: str, *args: Any, **kwargs: Any) -> Any:
    """Instantiate backend ``name`` (``cpu``, ``disk``, ...) with the backend's own arguments."""
    return backend_class(name)(*args, **kwargs)
