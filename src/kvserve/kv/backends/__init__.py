"""KV tier backends (host memory now; disk, shared file system and Redis fit the same
:class:`~kvserve.kv.backends.base.Backend` interface), selected by name."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

BACKENDS: dict[str, Callable[..., Any]] = {}
_BUILTIN = {"cpu": "kvserve.kv.backends.cpu"}


def register_backend(name: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        BACKENDS[name] = cls
        return cls

    return deco


def create_backend(name: str, *args: Any, **kwargs: Any) -> Any:
    """Instantiate backend ``name`` (``cpu``, ...) with the backend's own arguments."""
    if name not in BACKENDS and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])
    if name not in BACKENDS:
        raise ValueError(
            f"unknown KV backend {name!r}; known: {sorted(set(BACKENDS) | set(_BUILTIN))}"
        )
    return BACKENDS[name](*args, **kwargs)
