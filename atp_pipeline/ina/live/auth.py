"""Who may talk to a live role's control channel: its secret, where the secret comes from, and
the HMAC challenge-response that proves a peer holds it.

**The secret.** Every role process has one control-channel secret; there is no default.

* The training launcher (:meth:`.services.Services.start`) generates one per run with
  :func:`new_secret` and hands it to the roles it starts in their environment
  (:data:`ENV`), and to the run's ranks with the roles' addresses.
* A role started by hand takes it from ``--secret-file PATH`` (a file only its owner can
  read) or :data:`ENV`; on a loopback address without either it generates one and writes it
  to a file of mode 0600 (:func:`write_key_file`) in a per-user directory of mode 0700
  (:func:`key_dir`), named after its control address, where a client of the same user finds it
  (:func:`key_for`). A role bound to any other address refuses to start without an explicit
  secret (:func:`role_secret`).
* Explicit secrets shorter than :data:`MIN_SECRET` characters are refused (the channel's
  former public default, ``atp-pipeline``, among them).

**The handshake** (:func:`serve_handshake`, :func:`join_handshake`), mutual, over
:mod:`.wire` frames, before any request: the role sends ``{"challenge": C1}``; the client
answers ``{"response": HMAC(secret, "atp-control client" | C1), "challenge": C2}``; the role
checks it with :func:`hmac.compare_digest`, closes the connection if it is wrong, else answers
``{"response": HMAC(secret, "atp-control role" | C2)}``, which the client checks in turn (it
talks to the role that holds the secret, not to whatever took over its port). ``C1``/``C2``
are 32 random bytes in hex, the HMAC is SHA-256 in hex; handshake frames are at most
:data:`HANDSHAKE_FRAME` bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
import stat
import string
from pathlib import Path
from typing import Optional, Tuple

from atp_pipeline.ina.live import wire

ENV = "ATP_AUTHKEY"  # the control-channel secret, where a launcher or a user sets it
MIN_SECRET = 32  # characters an explicit secret must have (new_secret: 64)
HANDSHAKE_FRAME = 512
_CLIENT, _ROLE = b"atp-control client", b"atp-control role"

Addr = Tuple[str, int]


class AuthError(Exception):
    """The peer does not hold the secret (or did not follow the handshake)."""


class SecretError(ValueError):
    """No usable secret: the one-line reason a role refuses to start."""


def new_secret() -> str:
    """A fresh control-channel secret (256 random bits, hex)."""
    return secrets.token_hex(32)


def check_secret(secret: str, source: str) -> str:
    """``secret`` if it is long enough to be one, else :class:`SecretError` naming ``source``."""
    if len(secret) < MIN_SECRET:
        raise SecretError(f"{source} holds {len(secret)} characters; a control-channel secret needs at least "
                          f"{MIN_SECRET} (e.g. python -c 'import secrets; print(secrets.token_hex(32))')")
    return secret


def read_secret_file(path: str) -> str:
    """The secret in ``path`` (surrounding whitespace stripped); refused unless only its owner
    may read it."""
    p = Path(path).expanduser()
    try:
        mode = p.stat().st_mode
        text = p.read_text().strip()
    except OSError as e:
        raise SecretError(f"--secret-file {path}: {e.strerror or e}") from None
    if mode & 0o077:
        raise SecretError(f"--secret-file {path} is readable by others (mode {stat.S_IMODE(mode):o}): chmod 600 it")
    return check_secret(text, f"--secret-file {path}")


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback address (127.0.0.0/8, ::1)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def role_secret(host: str, secret_file: Optional[str]) -> Optional[str]:
    """The secret a role started by hand uses: ``secret_file``'s, else :data:`ENV`'s; ``None``
    (generate one, :func:`new_secret`) only on a loopback ``host``. :class:`SecretError` otherwise."""
    if secret_file:
        return read_secret_file(secret_file)
    if os.environ.get(ENV):
        return check_secret(os.environ[ENV], ENV)
    if not is_loopback(host):
        raise SecretError(f"--host {host} is not a loopback address: give the control channel a secret with "
                          f"--secret-file PATH or {ENV} (at least {MIN_SECRET} characters), the same to its clients")
    return None


def key_dir() -> Path:
    """This user's directory of generated role secrets (mode 0700): ``$XDG_RUNTIME_DIR/atp-pipeline``,
    else ``~/.cache/atp-pipeline/control``. Refused if someone else owns it or may enter it."""
    run = os.environ.get("XDG_RUNTIME_DIR")
    d = Path(run) / "atp-pipeline" if run else Path.home() / ".cache" / "atp-pipeline" / "control"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = d.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise SecretError(f"{d} must belong to this user with mode 700 (it holds control-channel secrets)")
    return d


def key_path(addr: Addr) -> Path:
    """Where the generated secret of the role with control address ``addr`` is kept."""
    host, port = addr
    return key_dir() / f"{host.replace(':', '_')}-{int(port)}.key"


def write_key_file(addr: Addr, secret: str) -> Path:
    """Write ``secret`` to :func:`key_path` (mode 0600, replaced atomically); the path."""
    path = key_path(addr)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    os.replace(tmp, path)
    return path


def remove_key_file(path: Path, secret: str) -> None:
    """Remove ``path`` if it still holds ``secret`` (a newer role on the port keeps its own)."""
    try:
        if path.read_text().strip() == secret:
            path.unlink()
    except OSError:
        pass


def key_for(addr: Addr) -> Optional[str]:
    """The secret a client uses for the role at ``addr``: :data:`ENV`'s, else the file a
    loopback role wrote (:func:`write_key_file`), else ``None``."""
    if os.environ.get(ENV):
        return os.environ[ENV]
    host, port = addr
    if not is_loopback(host):
        return None
    try:
        hosts = {i[4][0] for i in socket.getaddrinfo(host, None)}
    except OSError:
        return None
    for h in sorted(hosts):
        try:
            return key_path((h, port)).read_text().strip()
        except (OSError, SecretError):
            continue
    return None


def _mac(secret: str, label: bytes, challenge: str) -> str:
    return hmac.new(secret.encode(), label + challenge.encode(), hashlib.sha256).hexdigest()


def _field(msg: dict, name: str) -> str:
    v = msg.get(name)
    if not isinstance(v, str) or not 0 < len(v) <= 128 or v.strip(string.hexdigits):
        raise AuthError(f"handshake without a hex {name!r}")
    return v


def serve_handshake(sock: socket.socket, secret: str) -> None:
    """The role's side: :class:`AuthError` (or :class:`~.wire.FrameError`, ``EOFError``,
    ``OSError``) unless the client proves it holds ``secret``; then the role's proof."""
    c1 = secrets.token_hex(32)
    wire.send(sock, {"challenge": c1})
    msg = wire.recv(sock, HANDSHAKE_FRAME)
    if not hmac.compare_digest(_field(msg, "response"), _mac(secret, _CLIENT, c1)):
        raise AuthError("wrong secret")
    wire.send(sock, {"response": _mac(secret, _ROLE, _field(msg, "challenge"))})


def join_handshake(sock: socket.socket, secret: str) -> None:
    """The client's side: proves it holds ``secret``; :class:`AuthError` unless the role proves
    it too (a role that refused the client closes the connection: ``EOFError``)."""
    msg = wire.recv(sock, HANDSHAKE_FRAME)
    c2 = secrets.token_hex(32)
    wire.send(sock, {"response": _mac(secret, _CLIENT, _field(msg, "challenge")), "challenge": c2})
    try:
        answer = wire.recv(sock, HANDSHAKE_FRAME)
    except EOFError:
        raise AuthError("the role refused the secret") from None
    if not hmac.compare_digest(_field(answer, "response"), _mac(secret, _ROLE, c2)):
        raise AuthError("the role did not prove it holds the secret")
