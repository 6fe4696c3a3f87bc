"""The live roles' control channel (``ina/live/rpc.py``, ``wire.py``, ``auth.py``, ``tenancy.py``),
against real role processes over real sockets:

* a client holding the channel's former public key (``atp-pipeline``) that sends a pickle —
  through ``multiprocessing.connection.Client`` and as raw bytes, before and after a valid
  handshake — runs nothing (the pickle would create a marker file), and the role goes on
  serving honest clients;
* a second tenant of a shared switch (and of a PS shard) cannot tear down, read, diagnose or
  take over the first tenant's job, nor shut the role down;
* a role bound to a non-loopback address without an explicit secret, or given a weak or
  world-readable one, exits 2 with one line before it binds anything;
* malformed, oversized, truncated and schema-breaking frames close their connection, are
  counted, and the role survives; so does a burst of connections over the limit;
* the framing itself: JSON only, string keys, no numpy scalars, a size cap.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import secrets
import socket
import struct
import subprocess
import sys
import time
from multiprocessing.connection import AuthenticationError, Client
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import pytest

from atp_pipeline.config.schema import AggregationConfig, AggregationMode
from atp_pipeline.errors import ConfigError
from atp_pipeline.ina.live import auth, rpc, wire
from atp_pipeline.ina.live.services import Services, add_job, remove_job

ROOT = Path(__file__).resolve().parents[2]
LIVE = ROOT / "atp_pipeline" / "ina" / "live"


class _Role:
    """One role process started as the docs start it (``python -m atp_pipeline.ina.live.nodes``)."""

    def __init__(self, args: List[str], env: Dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "atp_pipeline.ina.live.nodes", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        assert line, self.proc.stderr.read() if self.proc.stderr else ""
        self.line: Dict[str, Any] = json.loads(line)
        self.addr: Tuple[str, int] = tuple(self.line["control"])  # type: ignore[assignment]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def _env(tmp_path: Path, **extra: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != auth.ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["XDG_RUNTIME_DIR"] = str(tmp_path / "run")  # the generated secrets' directory: this test's own
    env.update(extra)
    return env


@pytest.fixture
def switch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[_Role]:
    """A switch emulator started standalone on loopback without a secret (docs/ina.md)."""
    (tmp_path / "run").mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.delenv(auth.ENV, raising=False)
    role = _Role(["switch", "--aggregators", "64"], _env(tmp_path))
    yield role
    role.stop()


def _honest(role: _Role, token: Optional[str] = None) -> rpc.Peer:
    key = auth.key_for(role.addr)
    assert key is not None
    return rpc.Peer(role.addr, key, token or role.line["owner"], "switch")


def _closed(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything the role still sends until it closes the connection (fails if it does not)."""
    sock.settimeout(timeout)
    got = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:  # (closed with what we sent still unread)
            return got
        if not chunk:
            return got
        got += chunk


def _counters(owner: rpc.Peer, timeout: float = 10.0, **want: int) -> Dict[str, int]:
    """The role's control counters once they reach ``want`` (fails after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        got = owner.call("stats")["control"]
        if all(got[k] >= v for k, v in want.items()):
            assert all(got[k] == v for k, v in want.items()), got
            return got
        assert time.monotonic() < deadline, got
        time.sleep(0.1)


def _authenticated(role: _Role) -> socket.socket:
    sock = socket.create_connection(role.addr, timeout=5)
    auth.join_handshake(sock, auth.key_for(role.addr) or "")
    return sock


class _Marker:
    """Unpickling this runs a shell command that creates ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return os.system, (f"touch {self.path}",)


def test_generated_secret_is_a_0600_file_this_user_finds(switch):
    path = Path(switch.line["secret_file"])
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    assert len(path.read_text().strip()) == 64 and auth.key_for(switch.addr) == path.read_text().strip()
    assert "owner" not in _honest(switch).call("info")  # the owner token is in the start line only


def test_old_default_key_and_a_pickle_run_nothing(switch, tmp_path):
    """The attack that worked on the old channel: ``multiprocessing.connection`` with the public
    key ``atp-pipeline`` and a pickle whose unpickling runs ``touch MARKER``."""
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Marker(marker))
    assert not (tmp_path / "probe").exists()
    pickle.loads(pickle.dumps(_Marker(tmp_path / "probe")))  # (the payload works where it is unpickled)
    assert (tmp_path / "probe").exists()
    # 1. multiprocessing's client with the old default key: the role's first frame is no
    # multiprocessing challenge, so the client gives up before it can send anything
    with pytest.raises((AuthenticationError, AssertionError, EOFError, OSError)):
        conn = Client(switch.addr, authkey=b"atp-pipeline")
        conn.send(_Marker(marker))  # (reached only if the handshake passed)
    # 2. the pickle as multiprocessing frames it (4-byte length + bytes), without any handshake
    with socket.create_connection(switch.addr, timeout=5) as s:
        s.sendall(struct.pack("!i", len(evil)) + evil)
        _closed(s)
    # 3. the same answering the handshake with the old default key
    with socket.create_connection(switch.addr, timeout=5) as s:
        with pytest.raises((auth.AuthError, EOFError, ConnectionError)):
            auth.join_handshake(s, "atp-pipeline")
    # 4. a client that holds the real secret: a pickle is not a JSON frame, so it is dropped
    with _authenticated(switch) as s:
        s.sendall(struct.pack("!i", len(evil)) + evil)
        assert _closed(s) == b""
    owner = _honest(switch)
    assert _counters(owner, rejected=3, malformed=1)  # (the first once its client's socket is collected)
    assert not marker.exists()
    tenant = _honest(switch, secrets.token_hex(16))  # and it still serves honest clients
    job = tenant.call("add_job", up=[["127.0.0.1", 9]], down=[["127.0.0.1", 10]], job=None)
    assert tenant.call("stats")["installed"] == [job] and tenant.call("remove_job", job=job) == 0
    assert switch.proc.poll() is None and not marker.exists()


def test_the_control_path_deserializes_no_code():
    """No module of the live roles imports pickle, marshal or multiprocessing.connection."""
    banned = {"pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "multiprocessing.connection"}
    for path in sorted(LIVE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) else [])
            assert not banned & set(names), f"{path.name} imports {banned & set(names)}"


def test_a_second_tenant_cannot_tear_down_or_read_the_first_job(tmp_path, monkeypatch):
    """Two tenants of one switch and one PS shard (real role processes, the launcher's secret):
    tenant B holds the roles' secret but not tenant A's token."""
    svc = Services.start(AggregationConfig(mode=AggregationMode.atp, n_ps=1, aggregators=64, payload_k=62))
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
    try:
        shared = AggregationConfig(mode=AggregationMode.atp, n_ps=0, switch="%s:%d" % svc.switch.control)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # (no generated secret there)
        monkeypatch.delenv(auth.ENV, raising=False)
        with pytest.raises(ConfigError, match=r"aggregation.switch=127.0.0.1:\d+: no secret for its control "
                                              r"channel; set ATP_AUTHKEY to the secret the switch was started with"):
            Services.start(shared)  # a run that does not hold the switch's secret
        monkeypatch.setenv(auth.ENV, auth.new_secret())
        with pytest.raises(rpc.AggregationError, match="refused the control channel's secret"):
            Services.start(shared)
        for s in socks:
            s.bind(("127.0.0.1", 0))
        workers = [s.getsockname() for s in socks]
        a = svc
        b = Services.from_dict({**svc.to_dict(), "tenant": secrets.token_hex(16)})
        assert a.to_dict()["switch"].keys() == {"role", "data", "control", "pid", "secret"}  # no owner token
        job = add_job(a, workers)
        for ep in (b.switch, b.ps[0]):
            peer = b.peer(ep)
            for op, args in (("remove_job", {"job": job}), ("aggregator", {"job": job, "seq": 0}),
                             ("missing", {"job": job, "seq": 0}), ("shutdown", {}), ("cpu", {})):
                with pytest.raises(rpc.AggregationError, match="PermissionError"):
                    peer.call(op, **args)
            st = peer.call("stats")
            assert str(job) not in st["jobs"] and st.get("installed", []) == [], st
            with pytest.raises(rpc.AggregationError, match="PermissionError: job .* belongs to another tenant"):
                peer.call("add_job", **({"up": [], "down": [list(w) for w in workers], "job": job}
                                        if ep.role == "switch" else
                                        {"job": job, "workers": [list(w) for w in workers],
                                         "switch": list(svc.switch.data)}))
            with pytest.raises(rpc.AggregationError, match="PermissionError: stats needs a tenant token"):
                ep.peer(None).call("stats")
        assert remove_job(b, job) == 0  # B's teardown (best effort) reaches nothing of A's
        st = a.stats()
        assert st["switch"]["installed"] == [job] and str(job) in st["ps"][0]["jobs"]
        own = add_job(b, workers)  # B's own job: a fresh id, invisible to A
        assert own != job and str(own) not in a.peer(a.switch).call("stats")["jobs"]
        assert a.peer(a.ps[0]).call("missing", job=job, seq=0) == {"installed": True, "missing": None}
        remove_job(a, job)
        remove_job(b, own)
        assert add_job(b, workers) not in (job, own)  # torn-down ids are not handed out again
        assert svc.stats()["switch"]["installed"] != []  # (the owner sees every tenant's jobs)
    finally:
        for s in socks:
            s.close()
        svc.stop()


def test_non_loopback_bind_needs_an_explicit_secret(tmp_path, monkeypatch, capsys):
    p = subprocess.run([sys.executable, "-m", "atp_pipeline.ina.live.nodes", "switch", "--host", "0.0.0.0"],
                       capture_output=True, text=True, env=_env(tmp_path), cwd=ROOT, timeout=60)
    assert p.returncode == 2 and p.stdout == "" and p.stderr.splitlines() == [
        "error: --host 0.0.0.0 is not a loopback address: give the control channel a secret with "
        "--secret-file PATH or ATP_AUTHKEY (at least 32 characters), the same to its clients"], p

    from atp_pipeline.ina.live import nodes

    def refused(*args: str) -> str:  # the same check in-process (it runs before anything binds)
        assert nodes.main(["switch", *args]) == 2
        out = capsys.readouterr()
        assert out.out == "" and len(out.err.splitlines()) == 1, out
        return out.err.strip()

    monkeypatch.setenv(auth.ENV, "atp-pipeline")  # the old public default
    assert refused("--host", "0.0.0.0").startswith(
        "error: ATP_AUTHKEY holds 12 characters; a control-channel secret needs at least 32")
    monkeypatch.delenv(auth.ENV)
    assert refused("--host", "10.1.2.3").startswith("error: --host 10.1.2.3 is not a loopback address")
    key = tmp_path / "secret"
    key.write_text(auth.new_secret() + "\n")
    key.chmod(0o644)
    assert refused("--host", "0.0.0.0", "--secret-file", str(key)) == (
        f"error: --secret-file {key} is readable by others (mode 644): chmod 600 it")
    assert refused("--secret-file", str(tmp_path / "absent")) == (
        f"error: --secret-file {tmp_path / 'absent'}: No such file or directory")
    key.chmod(0o600)  # an explicit secret: it starts, writes no secret file, and serves that secret
    role = _Role(["switch", "--host", "0.0.0.0", "--secret-file", str(key)], _env(tmp_path))
    try:
        assert "secret_file" not in role.line and not (tmp_path / "run").exists()
        addr = ("127.0.0.1", role.addr[1])
        assert rpc.call(addr, "info", secret=key.read_text().strip())["role"] == "switch"
        with pytest.raises(rpc.AggregationError, match="refused the control channel's secret"):
            rpc.call(addr, "info", secret=auth.new_secret())
    finally:
        role.stop()


def _request(sock: socket.socket, body: bytes) -> None:
    sock.sendall(struct.pack("!I", len(body)) + body)


def test_malformed_and_oversized_frames_are_dropped_and_the_role_survives(switch):
    before = [  # before the handshake: the connection closes, nothing answered
        struct.pack("!I", 0xFFFFFFFF),  # a 4 GiB frame announced (nothing allocated)
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # not our protocol ("GET " is a 1.2 GB length)
        struct.pack("!I", 100) + b'{"response": ',  # truncated, then the client hangs up
        struct.pack("!I", 2) + b"[]",  # a frame that is no object
    ]
    for data in before:
        with socket.create_connection(switch.addr, timeout=5) as s:
            s.sendall(data)
            if data.endswith(b": "):
                s.shutdown(socket.SHUT_WR)
            _closed(s)
    silent = [  # after the handshake, unreadable frames: closed without an answer
        struct.pack("!I", wire.MAX_FRAME + 1),
        struct.pack("!I", 5) + b"\xff\xfe\x00{}",  # not UTF-8
        struct.pack("!I", 7) + b"{'op':1",  # not JSON
        struct.pack("!I", 3) + b"[1]",  # not an object
        struct.pack("!I", 13) + b'{"op": NaN}  ',  # NaN
        struct.pack("!I", 200_000) + b"[" * 200_000,  # nesting too deep to decode
    ]
    for data in silent:
        with _authenticated(switch) as s:
            s.sendall(data)
            assert _closed(s) == b"", data[:20]
    answered = [  # readable frames that break the schema: one error reply, then closed
        ({"op": "exec", "args": {}}, "unknown control operation 'exec'"),
        ({"op": "add_job", "args": {"up": [["127.0.0.1", 70000]], "down": []}}, "argument up="),
        ({"op": "remove_job", "args": {"job": "1"}, "token": "ab" * 16}, "argument job=1 has the wrong type"),
        ({"op": "info", "args": {"__class__": 1}}, "unknown argument '__class__'"),
        ({"op": "info", "code": "import os"}, "unknown request fields ['code']"),
        ({"op": "stats", "token": "not hex"}, "token must be 32..128 hex characters"),
        ({"op": "add_job", "args": {"shm": ["../../etc/passwd"]}}, "argument shm="),
    ]
    for msg, why in answered:
        with _authenticated(switch) as s:
            _request(s, json.dumps(msg).encode())
            reply = wire.decode(_closed(s)[4:])
            assert reply["ok"] is False and reply["error"].startswith("RequestError: ") and why in reply["error"], reply
    # more connections at once than a role serves: the excess is closed, the role goes on
    flood = [socket.create_connection(switch.addr, timeout=5) for _ in range(rpc.MAX_CONNECTIONS + 8)]
    for s in flood:
        s.close()
    deadline = time.monotonic() + 10
    owner = _honest(switch)
    while True:
        try:
            st = owner.call("stats")
            break
        except rpc.AggregationError:  # (until the flood's threads have seen their clients hang up)
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert st["control"]["malformed"] == len(silent) + len(answered), st["control"]
    assert st["control"]["rejected"] >= len(before) and switch.proc.poll() is None
    assert owner.call("info")["role"] == "switch"


def test_frames_carry_json_only():
    msg = {"op": "x", "args": {"a": (1, 2.5, None, True, "s")}}
    assert wire.decode(wire.encode(msg)[4:]) == {"op": "x", "args": {"a": [1, 2.5, None, True, "s"]}}
    for bad, where in (({"v": np.int64(3)}, "message['v']: a numpy.int64"), ({"jobs": {1: {}}}, "key 1 is a int"),
                       ({"v": float("nan")}, "nan is not a finite number"), ({"v": b"x"}, "a builtins.bytes")):
        with pytest.raises(TypeError, match=where.replace("[", r"\[").replace("]", r"\]")):
            wire.encode(bad)
    with pytest.raises(wire.FrameError, match="exceeds the 1048576-byte frame limit"):
        wire.encode({"v": "x" * wire.MAX_FRAME})
    for body in (b"[]", b"1", b'"s"', b"{", b"\xff", b'{"a": Infinity}'):
        with pytest.raises(wire.FrameError):
            wire.decode(body)
    assert rpc.check_request({"op": "aggregator", "args": {"job": 3, "seq": 7}, "token": "a" * 32}) == (
        "aggregator", {"job": 3, "seq": 7}, "a" * 32)
    with pytest.raises(rpc.RequestError, match="remove_job: job must be a job id"):
        rpc.check_request({"op": "remove_job", "args": {"job": None}})
