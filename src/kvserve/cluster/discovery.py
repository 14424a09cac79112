"""Endpoint discovery without a Kubernetes API client: an endpoints file and DNS.

Owns the sources of endpoints beyond the static list, for every front end that holds an
:class:`~kvserve.cluster.endpoints.EndpointPool` (the HTTP router, the EPP). Each source is
polled on its own period and answers with the endpoints it wants now, or ``None`` when it has
nothing new (unchanged, or a failure that keeps the last good answer); the pool merges the
answers and its listeners (event subscribers, index, health checks) follow.

- :class:`FileSource`: a YAML/JSON list of endpoints (entries in the ``--endpoint`` flag's
  syntax or as mappings), the file a ConfigMap volume or a sidecar keeps current. The content
  is read every poll and compared by digest, not by mtime: a ConfigMap volume swaps a
  symlink to a new directory (the file's path never changes, its target does), and a file
  rewritten within one timestamp tick keeps its mtime. A file that does not parse keeps the
  last good list.
- :class:`DnsSource`: ``dns://NAME:PORT[,option=value...]``, the A/AAAA records of a headless
  Service resolved every poll, each address one endpoint; the options are the ``--endpoint``
  flag's, their values templates (``{host}``: the address, bracketed for IPv6; ``{ip}``: the
  bare address), e.g. ``dns://engines.llm.svc.cluster.local:8000,events=tcp://{host}:5557,
  replay=tcp://{host}:5558``; with ``dp=N`` each address is N data-parallel ranks (ports
  offset by rank). An address is added on the first answer that has it and removed
  after ``remove_after`` answers without it (a dead pod leaves the rotation at once anyway, on
  its refused connections and failed health checks); a name that does not exist is an empty
  answer, a resolver that fails (timeout, SERVFAIL) keeps the last one.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import yaml

from kvserve.cluster.config import ConfigError, EndpointSpec, parse_endpoints
from kvserve.cluster.data_parallel import expand_data_parallel

logger = logging.getLogger(__name__)

DNS_SCHEME = "dns://"
# getaddrinfo's "this name has no address" answers: authoritative, an empty endpoint set.
_NO_SUCH_NAME = {
    getattr(socket, name) for name in ("EAI_NONAME", "EAI_NODATA") if hasattr(socket, name)
}
Resolver = Callable[[str, int], Awaitable[list[str]]]  # (name, family) -> addresses


def parse_endpoint_text(text: str) -> EndpointSpec:
    """One endpoint in the ``--endpoint`` flag's syntax (``URL[,events=ADDR,...]``)."""
    from kvserve.cluster.cli import parse_endpoint_flag  # the flag's one parser

    return parse_endpoint_flag(text)


def parse_endpoints_data(data: Any, where: str) -> list[EndpointSpec]:
    """Endpoints from a parsed file: a list (or a mapping with an ``endpoints`` list) whose
    entries are ``--endpoint`` strings or mappings of :class:`EndpointSpec` keys."""
    if isinstance(data, dict) and "endpoints" in data:
        data = data["endpoints"]
    if data is None:
        return []
    if not isinstance(data, list):
        raise ConfigError(f"{where}: expected a list of endpoints")
    specs: list[EndpointSpec] = []
    for i, entry in enumerate(data):
        if isinstance(entry, str):
            specs.append(parse_endpoint_text(entry))
        else:
            specs += parse_endpoints([entry], f"{where}[{i}]")
    return expand_data_parallel(specs)  # a data-parallel server: one endpoint per rank


class FileSource:
    """An endpoints file, re-read every poll and applied when its content changed."""

    def __init__(self, path: str, poll_s: float = 1.0) -> None:
        self.path = path
        self.poll_s = poll_s
        self.answered = False  # read once without error
        self._digest: bytes | None = None  # of the content last read (good or bad)

    def __repr__(self) -> str:
        return f"FileSource({self.path!r})"

    def read(self) -> list[EndpointSpec]:
        """The file's endpoints now. Raises :class:`ConfigError` on a missing or bad file."""
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise ConfigError(f"cannot read endpoints file {self.path}: {e}") from None
        self._digest = hashlib.sha256(raw).digest()
        try:
            data = yaml.safe_load(raw.decode("utf-8"))  # JSON is YAML
            specs = parse_endpoints_data(data, self.path)
        except (ValueError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read endpoints file {self.path}: {e}") from None
        self.answered = True
        return specs

    async def poll(self) -> list[EndpointSpec] | None:
        try:
            with open(self.path, "rb") as f:
                digest = hashlib.sha256(f.read()).digest()
        except OSError:
            return None  # between a delete and a create, or mid-swap: try again next poll
        if digest == self._digest:
            return None
        try:
            return self.read()
        except ConfigError as e:
            logger.error("%s (keeping the previous endpoints)", e)
            return None


async def system_resolver(name: str, family: int = socket.AF_UNSPEC) -> list[str]:
    """The addresses of ``name`` from the system resolver (getaddrinfo: /etc/hosts, DNS)."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        name, None, family=family, type=socket.SOCK_STREAM
    )
    return [info[4][0] for info in infos]


_FAMILIES = {"any": socket.AF_UNSPEC, "ipv4": socket.AF_INET, "ipv6": socket.AF_INET6}


class DnsSource:
    """The addresses of one DNS name, each an endpoint made from a template."""

    def __init__(
        self,
        target: str,
        poll_s: float = 5.0,
        *,
        resolver: Resolver | None = None,
        remove_after: int = 2,
        timeout_s: float = 5.0,
    ) -> None:
        if not target.startswith(DNS_SCHEME):
            raise ConfigError(f"endpoints DNS target must start with {DNS_SCHEME}: {target!r}")
        self.target = target
        self.poll_s = poll_s
        self.resolver: Resolver = resolver or system_resolver
        self.remove_after = max(1, remove_after)
        self.timeout_s = timeout_s  # a lookup slower than this failed (the last answer stays)
        self.answered = False  # resolved once (an empty answer counts)
        head, *opts = [p.strip() for p in target.split(",")]
        try:
            parts = urlsplit(head)
            port = parts.port
        except ValueError:
            parts, port = None, None
        if parts is None or not parts.hostname or parts.path not in ("", "/"):
            raise ConfigError(f"endpoints DNS target must be dns://NAME[:PORT][,...]: {target!r}")
        self.name = parts.hostname
        self.port = port or 8000
        self.scheme = "http"
        self.family = socket.AF_UNSPEC
        self._options: list[str] = []
        for opt in opts:
            key, _, value = opt.partition("=")
            if key == "scheme":
                if value not in ("http", "https"):
                    raise ConfigError(f"{target!r}: scheme must be http or https")
                self.scheme = value
            elif key == "family":
                if value not in _FAMILIES:
                    raise ConfigError(f"{target!r}: family must be any, ipv4 or ipv6")
                self.family = _FAMILIES[value]
            else:
                self._options.append(opt)
        self._missing: dict[str, int] = {}  # address -> consecutive answers without it
        self.spec_for("192.0.2.1")  # a bad template fails now, not at the first answer

    def __repr__(self) -> str:
        return f"DnsSource({self.target!r})"

    def spec_for(self, ip: str) -> EndpointSpec:
        """The endpoint of one address."""
        host = f"[{ip}]" if ":" in ip else ip
        try:
            opts = [o.format(host=host, ip=ip) for o in self._options]
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(
                f"{self.target!r}: bad template (use {{host}} or {{ip}}): {e}"
            ) from None
        return parse_endpoint_text(",".join([f"{self.scheme}://{host}:{self.port}", *opts]))

    async def resolve(self) -> list[str] | None:
        """The name's addresses now (sorted, unique); ``None`` when the resolver failed."""
        try:
            found = await asyncio.wait_for(self.resolver(self.name, self.family), self.timeout_s)
        except socket.gaierror as e:
            if e.errno in _NO_SUCH_NAME:
                return []
            logger.warning("resolving %s failed: %s (keeping the last answer)", self.name, e)
            return None
        except OSError as e:  # TimeoutError included
            logger.warning("resolving %s failed: %r (keeping the last answer)", self.name, e)
            return None
        out = set()
        for a in found:
            try:
                out.add(str(ipaddress.ip_address(a.split("%", 1)[0])))
            except ValueError:
                logger.warning("resolving %s: not an address: %r", self.name, a)
        return sorted(out)

    async def poll(self) -> list[EndpointSpec] | None:
        found = await self.resolve()
        if found is None:
            return None
        self.answered = True
        before = dict(self._missing)
        missing = {a: n + 1 for a, n in self._missing.items() if a not in found}
        self._missing = {a: 0 for a in found}
        self._missing.update({a: n for a, n in missing.items() if n < self.remove_after})
        if self._missing == before:
            return None
        return expand_data_parallel([self.spec_for(a) for a in sorted(self._missing)])


EndpointSource = FileSource | DnsSource
