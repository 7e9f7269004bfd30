"""Browser safety: what a web page must not be able to make a local server do. Sans-IO.

Two ways a page in a browser reaches a server on the user's machine:

* **A cross-site POST.** A page may POST ``text/plain`` (or a form) to any
  address without a CORS preflight, and a JSON body parses the same. Only
  ``application/json`` needs a preflight, which this server never grants.
  So every POST must say ``Content-Type: application/json`` (parameters
  such as ``charset`` allowed); anything else, or none, is a 415.
* **DNS rebinding.** A page's own name, re-pointed at 127.0.0.1, lets it
  read the answers too. The browser still sends that name as ``Host``; so on
  a loopback bind a ``Host`` that is not a loopback name (``localhost``,
  ``127.0.0.1``, ``[::1]``, any port) is a 403. ``--allowed-hosts`` widens
  the set (``*``: any). A server bound to another address is reached by
  names nobody can list here: it checks ``Host`` only against
  ``--allowed-hosts``, when given.

A request without ``Host`` (HTTP/1.0; browsers always send one) passes.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Iterable
from typing import Final

from tserve.web._errors import ForbiddenHost, UnsupportedMediaType

__all__ = ["LOOPBACK_NAMES", "BrowserGuard", "is_loopback"]

LOOPBACK_NAMES: Final = frozenset({"localhost", "127.0.0.1", "[::1]"})


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` listens on loopback only (``localhost`` included)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_name(header: str) -> str:
    """``Host`` without its port, lower case: ``[::1]:8000`` -> ``[::1]``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[: header.find("]") + 1] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


@dataclasses.dataclass(frozen=True, slots=True)
class BrowserGuard:
    """The checks of the module docstring. ``hosts`` None: any ``Host`` passes."""

    hosts: frozenset[str] | None

    @classmethod
    def for_bind(cls, bind_host: str, allowed: Iterable[str] = ()) -> BrowserGuard:
        """The guard for a server bound to ``bind_host`` with ``--allowed-hosts``."""
        extra = {_host_name(name) for name in allowed if name.strip()}
        if "*" in extra or (not extra and not is_loopback(bind_host)):
            return cls(None)
        return cls(frozenset(extra | (LOOPBACK_NAMES if is_loopback(bind_host) else set())))

    def check(self, method: str, host: str | None, content_type: str | None) -> None:
        """Raise ForbiddenHost (403) or UnsupportedMediaType (415), in that order,
        for a request with these ``Host`` and ``Content-Type`` headers."""
        if self.hosts is not None and host is not None and _host_name(host) not in self.hosts:
            raise ForbiddenHost(f"Host {host!r} is not served here (see --allowed-hosts)")
        if method == "POST":
            media = (content_type or "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                raise UnsupportedMediaType(
                    "a request body must be JSON (Content-Type: application/json)"
                )
