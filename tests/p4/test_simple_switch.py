"""BMv2 ``simple_switch`` in a namespace of its own: frames in and out through its
nanomsg port interface, and nothing left behind — after ``close`` and after its owner is
killed with SIGKILL (the switch dies with it, the kernel frees the namespace)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from atp_pipeline.ina.p4.simple_switch import SimpleSwitch, boot_seconds, netns_users

from ..conftest import running
from . import bmv2_missing

pytestmark = pytest.mark.skipif(bool(bmv2_missing()), reason=bmv2_missing() or "BMv2 is here")

ARP = bytes.fromhex("ffffffffffff020000000009") + b"\x08\x06" + bytes(28)


def _gone(pid: int, inode: int, ended: float, timeout: float = 10.0) -> bool:
    """The switch ``pid`` has exited and its namespace ``inode`` is freed (a process started after
    ``ended``, :func:`boot_seconds` as the switch began to stop, is in a new namespace that reuses
    the number)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not running(pid) and not netns_users(inode, ended):
            return True
        time.sleep(0.1)
    return False


def test_frames_cross_the_switch_and_close_leaves_nothing(v1model_json, tmp_path):
    with SimpleSwitch(v1model_json, tmp_path) as ss:
        pid, inode = ss.pid, ss.inode
        assert ss.cli is not None
        assert set(netns_users(inode)) == {pid, ss.cli.proc.pid}  # the switch and its CLI session only
        assert inode != os.stat("/proc/self/ns/net").st_ino
        ss.cli.run(["table_add AtpIngress.l2_forward AtpIngress.set_port ff:ff:ff:ff:ff:ff => 7"])
        ss.send(3, ARP)
        assert ss.recv(5.0) == (7, ARP)  # non-ATP frames pass untouched, out of the port the table names
        assert ss.recv(0.2) is None
        closing = boot_seconds()
    assert _gone(pid, inode, closing)
    assert not list(tmp_path.glob("*.ipc"))


def test_killed_owner_takes_the_switch_and_its_namespace_along(v1model_json, tmp_path):
    code = ("import sys, time; from pathlib import Path; from atp_pipeline.ina.p4.simple_switch import SimpleSwitch; "
            "ss = SimpleSwitch(Path(sys.argv[1]), Path(sys.argv[2])); print(ss.pid, ss.inode, flush=True); "
            "time.sleep(600)")
    owner = subprocess.Popen([sys.executable, "-c", code, str(v1model_json), str(tmp_path)], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        pid, inode = map(int, owner.stdout.readline().split())
        assert running(pid) and pid in netns_users(inode)
        killed = boot_seconds()
        os.kill(owner.pid, signal.SIGKILL)  # no cleanup code runs in the owner
        owner.wait(10)
        assert _gone(pid, inode, killed), (pid, netns_users(inode, killed))
    finally:
        if owner.poll() is None:
            owner.kill()
