"""ZMQ CURVE key files: the engine's and the API servers' key pairs in one flat directory.

``python -m tserve keys DIR`` (:func:`write_keys`) writes, with pyzmq's
``zmq.auth.create_certificates``::

    DIR/server.key          the engine's public key      (0644)
    DIR/server.key_secret   the engine's key pair        (0600)
    DIR/client.key          the API servers' public key  (0644)
    DIR/client.key_secret   the API servers' key pair    (0600)

Flat, because ``kubectl create secret generic NAME --from-file=DIR`` keeps
only file names. Who reads what:

* the engine (``tserve engine --keys DIR``, :func:`server_keys`) serves with
  ``server.key_secret`` and accepts exactly the clients whose public keys are
  in a ``*.key`` file of DIR (pyzmq's ZAP authenticator reads them once, at
  start);
* an API server (``tserve serve --engine ADDR --keys DIR``,
  :func:`client_keys`) checks the engine against ``server.key`` and proves
  itself with ``client.key_secret``.

A network address without keys is refused unless the caller says
``insecure`` (:func:`require_keys`): then anyone who reaches the port can
submit requests and read every output, in plain text.

A stdlib-and-pyzmq leaf: the engine (``tserve.gpu``), the mux and the
command line import it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
from pathlib import Path

import zmq
import zmq.auth

from tserve._errors import LLMError

__all__ = [
    "CLIENT",
    "SERVER",
    "ClientKeys",
    "KeyFileError",
    "ServerKeys",
    "client_keys",
    "is_network_address",
    "require_keys",
    "server_keys",
    "write_keys",
]

log = logging.getLogger("tserve")

SERVER = "server"  # the engine's pair: server.key, server.key_secret
CLIENT = "client"  # the API servers' pair: client.key, client.key_secret
_PUBLIC_MODE = 0o644
_SECRET_MODE = 0o600


class KeyFileError(LLMError):
    """A key directory or key file that is missing, unreadable or malformed."""


@dataclasses.dataclass(frozen=True, slots=True)
class ServerKeys:
    """What the engine's socket needs: its own pair and the clients it accepts (z85)."""

    public: bytes
    secret: bytes
    clients: frozenset[bytes]  # the public keys of DIR's *.key files
    directory: Path


@dataclasses.dataclass(frozen=True, slots=True)
class ClientKeys:
    """What an API server's socket needs: the engine's public key and its own pair (z85)."""

    server_public: bytes
    public: bytes
    secret: bytes


def is_network_address(address: str) -> bool:
    """Whether ``address`` reaches beyond this host's own private sockets (``tcp://``)."""
    return address.startswith("tcp://")


def require_keys(address: str, keys: str | os.PathLike[str] | None, *, insecure: bool) -> None:
    """Refuse a network ``address`` without ``keys`` unless ``insecure``; raise KeyFileError."""
    if is_network_address(address) and keys is None and not insecure:
        raise KeyFileError(
            f"{address} is a network address: give --keys DIR (made by 'python -m tserve "
            "keys DIR') so that ZMQ CURVE authenticates and encrypts it, or --insecure to "
            "let anyone who reaches the port use the engine"
        )


def write_keys(directory: str | os.PathLike[str]) -> list[Path]:
    """Write a server and a client key pair into ``directory``; return the files written.

    Creates the directory (0700) when it does not exist. Secret files are
    0600, public ones 0644. Refuses (KeyFileError) to overwrite any key file.
    Blocking (file IO).
    """
    root = Path(directory)
    names = [f"{who}{suffix}" for who in (SERVER, CLIENT) for suffix in (".key", ".key_secret")]
    existing = [name for name in names if (root / name).exists()]
    if existing:
        raise KeyFileError(f"{root} already holds {', '.join(existing)}; not overwriting keys")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    written: list[Path] = []
    old_mask = os.umask(0o077)  # no moment at which a secret file is readable by others
    try:
        for who in (SERVER, CLIENT):
            public, secret = map(Path, zmq.auth.create_certificates(root, who))
            os.chmod(secret, _SECRET_MODE)
            os.chmod(public, _PUBLIC_MODE)
            written += [public, secret]
    finally:
        os.umask(old_mask)
    return written


def server_keys(directory: str | os.PathLike[str]) -> ServerKeys:
    """The engine's keys from ``directory`` (see the module docstring). Raises KeyFileError."""
    root = Path(directory)
    public, secret = _load(root / f"{SERVER}.key_secret", secret=True)
    clients = frozenset(_load(path, secret=False)[0] for path in sorted(root.glob("*.key")))
    return ServerKeys(public, secret, clients, root)


def client_keys(directory: str | os.PathLike[str]) -> ClientKeys:
    """An API server's keys from ``directory`` (see the module docstring). Raises KeyFileError."""
    root = Path(directory)
    server_public, _ = _load(root / f"{SERVER}.key", secret=False)
    public, secret = _load(root / f"{CLIENT}.key_secret", secret=True)
    return ClientKeys(server_public, public, secret)


def _load(path: Path, *, secret: bool) -> tuple[bytes, bytes]:
    """(public, secret) from a key file; secret is b"" for a public one."""
    if not path.is_file():
        raise KeyFileError(
            f"no key file {path} (make a key directory with 'python -m tserve keys')"
        )
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"cannot read the key file {path}: {exc}") from exc
    if secret and not secret_key:
        raise KeyFileError(f"{path} holds no secret key")
    if secret and path.stat().st_mode & stat.S_IROTH:
        log.warning("%s is readable by every user of this host: chmod 600 it", path)
    return public, secret_key or b""
