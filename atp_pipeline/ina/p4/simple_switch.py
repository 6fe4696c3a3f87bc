"""BMv2 ``simple_switch`` in a network namespace of its own, frames over nanomsg IPC.

The switch runs the compiled v1model program of ATP's switch logic (§5.3, ``p4/v1model/atp.p4``).
:class:`SimpleSwitch` starts it as ``unshare --net -- sh -c 'ip link set lo up; exec
simple_switch --packet-in ipc://<workdir>/packets.ipc ...'``: the process gets a fresh network
namespace holding only its loopback, so its Thrift control port is reachable from nowhere
else and no address or interface of the machine is touched. Frames travel on BMv2's
nanomsg packet interface (:mod:`.nanomsg`; a Unix-domain socket in ``workdir``, the
switch's working directory): a frame is sent to a port number and received with the port
it left on. (veth pairs, the other way
in, lose every frame of a burst beyond a few dozen in BMv2's libpcap capture ring here; the
nanomsg send waits instead.) The persistent :class:`CLI` (``simple_switch_CLI``) is started
inside the namespace (``setns`` before ``exec``).

Cleanup does not depend on this process behaving: the namespace has no name, so the kernel
frees it as soon as ``simple_switch`` has exited, and ``simple_switch`` and the CLI carry
``PR_SET_PDEATHSIG`` = SIGKILL, so they die with the thread that started them even when this
process is killed with SIGKILL (the IPC socket files are in ``workdir``). :meth:`SimpleSwitch.close`
stops them in order. Start a switch from a thread that lives as long as it does (the main
thread): the death signal follows the starting thread.

Needs root (CAP_SYS_ADMIN for the namespace) and Linux.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import select
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from atp_pipeline.ina.p4.nanomsg import PacketSocket
from atp_pipeline.ina.p4.toolchain import P4ToolError, require

CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
THRIFT_PORT = 9090  # the namespace is private: the default port never collides
PACKET_BUFFER = 64 << 10  # nanomsg buffer toward the switch: a backlog shows up in front of it, not inside

_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"setns(CLONE_NEWNET): {os.strerror(e)}")


def _die_with_parent() -> None:
    """In a forked child: SIGKILL when the thread that forked it exits."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@contextlib.contextmanager
def in_netns(pid: int) -> Iterator[None]:
    """Run the block with the calling thread inside ``pid``'s network namespace (sockets
    created there stay there); other threads are not affected."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)


def _preexec_in(fd: int) -> Callable[[], None]:
    def enter() -> None:
        _die_with_parent()
        _setns(fd)
    return enter


def netns_inode(pid: int) -> int:
    """The inode that identifies ``pid``'s network namespace."""
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def boot_seconds() -> float:
    """Seconds since boot, the clock of a process's start time in ``/proc/<pid>/stat``."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def started_at(pid: int) -> float:
    """When ``pid`` started, in :func:`boot_seconds` (``/proc/<pid>/stat`` field 22)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[19]) / os.sysconf("SC_CLK_TCK")


def netns_users(inode: int, started_before: Optional[float] = None) -> List[int]:
    """Processes in, or holding a descriptor of, the network namespace ``inode`` (empty: the
    kernel has freed it, and with it every interface it contained). The kernel reuses a freed
    namespace's inode number for a new one: ``started_before`` (:func:`boot_seconds`, taken before
    the namespace's own processes began to stop; none joins it after that) leaves out processes
    started after it, which can only be in a new namespace of that number."""
    tag = f"net:[{inode}]"
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            member = os.readlink(d / "ns" / "net") == tag or any(os.readlink(fd) == tag for fd in (d / "fd").iterdir())
            if member and (started_before is None or started_at(int(d.name)) <= started_before):
                out.append(int(d.name))
        except OSError:
            continue
    return out


_CLI_ERROR = re.compile(r"(?:^|RuntimeCmd:\s*)((?:Error|Invalid|Exception|Traceback)\b.*)")


def thrift_answers(switch_pid: int, port: int = THRIFT_PORT) -> bool:
    """Whether the switch ``switch_pid`` accepts a connection on its Thrift ``port`` (in its
    network namespace)."""
    try:
        with in_netns(switch_pid):
            s = socket.socket()
    except OSError:
        return False  # the namespace is not there yet (still the launcher's), or the switch is gone
    with s:
        s.settimeout(0.5)
        try:
            s.connect(("127.0.0.1", port))
            return True
        except OSError:
            return False


class CLI:
    """One ``simple_switch_CLI`` session inside the switch's namespace, kept open: commands
    go to its stdin, and a batch's output ends at a sentinel line it cannot know (so each
    batch costs Thrift calls only, not a new Python process)."""

    def __init__(self, switch_pid: int, thrift_port: int = THRIFT_PORT, timeout: float = 30.0) -> None:
        cli = require("simple_switch_CLI")
        deadline = time.monotonic() + timeout
        while not thrift_answers(switch_pid, thrift_port):  # a switch just started: not listening yet
            if time.monotonic() > deadline:
                raise P4ToolError(f"simple_switch (pid {switch_pid}) did not answer on its Thrift port "
                                  f"{thrift_port} within {timeout:.0f} s")
            time.sleep(0.05)
        fd = os.open(f"/proc/{switch_pid}/ns/net", os.O_RDONLY)
        try:
            self.proc = subprocess.Popen([cli, "--thrift-port", str(thrift_port)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                         preexec_fn=_preexec_in(fd), pass_fds=(fd,))
        finally:
            os.close(fd)
        self._n = 0
        self._buf = b""
        self.run([], timeout=timeout)  # the banner, and the proof that Thrift answers

    def run(self, commands: Sequence[str], timeout: float = 120.0, check: bool = True) -> str:
        """Run ``commands``; their output. ``check``: raise :class:`P4ToolError` on the first
        line the CLI reports as an error."""
        self._n += 1
        mark = f"#atp-sync-{self._n}"
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(("\n".join([*commands, mark]) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise P4ToolError(f"simple_switch_CLI exited: {self._buf.decode(errors='replace')[-500:]}") from None
        end = f"*** Unknown syntax: {mark}".encode()
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while end not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise P4ToolError(f"simple_switch_CLI did not answer within {timeout:.0f} s")
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise P4ToolError("simple_switch_CLI exited: "
                                      + self._buf.decode(errors="replace").strip()[-500:])
                self._buf += chunk
        i = self._buf.index(end)
        out, self._buf = self._buf[:i].decode(errors="replace"), self._buf[i + len(end):]
        if check:
            for ln in out.splitlines():
                m = _CLI_ERROR.search(ln.strip())
                if m or "Could not connect" in ln:
                    raise P4ToolError(f"simple_switch_CLI: {(m.group(1) if m else ln).strip()}")
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(2)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def parse_counter(out: str) -> Dict[int, int]:
    """``counter_read`` output → ``{index: packets}``."""
    return {int(m.group(1)): int(m.group(2)) for m in re.finditer(r"\[(\d+)\]=\s*\(\d+ bytes, (\d+) packets\)", out)}


def parse_register_all(out: str, name: str) -> List[int]:
    """``register_read <name>`` (whole array) output → its values."""
    m = re.search(re.escape(name) + r"=\s*([-\d, ]*)", out)
    if not m:
        raise P4ToolError(f"no values of register {name} in the CLI output: {out.strip()[-300:]}")
    return [int(v) for v in m.group(1).replace(",", " ").split()]


def parse_register(out: str) -> Dict[int, int]:
    """``register_read <name> <i>`` outputs → ``{i: value}``."""
    return {int(m.group(1)): int(m.group(2)) for m in re.finditer(r"\[(\d+)\]=\s*(-?\d+)", out)}


class SimpleSwitch:
    """``simple_switch`` running ``json_path`` in a network namespace of its own, its ports
    reached through :meth:`send` / :meth:`recv`. Use as a context manager, or call :meth:`close`."""

    def __init__(self, json_path: Path, workdir: Path, log_file: Optional[Path] = None,
                 start_timeout: float = 60.0) -> None:
        self.json_path = Path(json_path)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.packets_ipc = self.workdir / "bmv2-packets.ipc"
        self.notify_ipc = self.workdir / "bmv2-notifications.ipc"
        self.cli: Optional[CLI] = None
        self.proc: Optional[subprocess.Popen] = None
        self.sock: Optional[PacketSocket] = None
        self.inode = 0
        self._log = None
        try:
            self._start(log_file, start_timeout)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ lifecycle
    def _start(self, log_file: Optional[Path], timeout: float) -> None:
        ss, unshare = require("simple_switch"), _which("unshare")
        # IPC paths relative to the switch's working directory: a Unix socket path has at most
        # 107 bytes, which a deep work directory (a test's tmp_path) exceeds
        argv = [ss, "--thrift-port", str(THRIFT_PORT), "--packet-in", f"ipc://{self.packets_ipc.name}",
                "--notifications-addr", f"ipc://{self.notify_ipc.name}"]
        if log_file is not None:
            argv += ["--log-file", str(log_file), "--log-flush"]
        else:
            argv += ["--log-level", "off"]
        argv.append(str(self.json_path))
        script = "set -e\nip link set lo up\nexec " + " ".join(_sh_quote(a) for a in argv) + "\n"
        self._log = open(self.workdir / "simple_switch.out", "wb")
        self.proc = subprocess.Popen([unshare, "--net", "--", "sh", "-c", script], stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.workdir,
                                     preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise P4ToolError(f"simple_switch exited with {self.proc.returncode} at start: {self._log_tail()}")
            if self._thrift_up():
                break
            if time.monotonic() > deadline:
                raise P4ToolError(f"simple_switch did not open its Thrift port within {timeout:.0f} s: "
                                  f"{self._log_tail()}")
            time.sleep(0.05)
        self.inode = netns_inode(self.proc.pid)
        # (through the switch's cwd link: short whatever the work directory)
        self.sock = PacketSocket(f"ipc:///proc/{self.proc.pid}/cwd/{self.packets_ipc.name}", buffer_bytes=PACKET_BUFFER)
        self.cli = CLI(self.proc.pid)

    def _thrift_up(self) -> bool:
        assert self.proc is not None
        return thrift_answers(self.proc.pid, THRIFT_PORT)

    def close(self) -> None:
        """Stop the CLI and the switch (its namespace goes with it), close the packet socket."""
        if self.cli is not None:
            self.cli.close()
            self.cli = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self._log is not None:
            self._log.close()
            self._log = None
        for f in (self.packets_ipc, self.notify_ipc):
            f.unlink(missing_ok=True)

    def __enter__(self) -> "SimpleSwitch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _log_tail(self) -> str:
        try:
            return (self.workdir / "simple_switch.out").read_text(errors="replace").strip()[-800:]
        except OSError:
            return ""

    # ------------------------------------------------------------------ frames
    def send(self, port: int, frame: bytes) -> None:
        """``frame`` arrives at the switch on ``port``."""
        assert self.sock is not None
        self.sock.send(port, frame)

    def fileno(self) -> int:
        """Readable (for ``select``) while a frame from the switch waits."""
        assert self.sock is not None
        return self.sock.rcvfd

    def recv_ready(self) -> List[Tuple[int, bytes]]:
        """Every ``(port, frame)`` the switch has sent and nobody has read yet."""
        assert self.sock is not None
        return self.sock.recv_all()

    def recv(self, timeout: float) -> Optional[Tuple[int, bytes]]:
        """The next ``(port, frame)`` the switch sent; ``None`` after ``timeout`` s."""
        assert self.sock is not None
        deadline = time.monotonic() + timeout
        while True:
            got = self.sock.recv()
            if got is not None:
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            select.select([self.sock.rcvfd], [], [], left)

    def drain(self, quiet: float = 0.2, limit: float = 10.0) -> List[Tuple[int, bytes]]:
        """Every frame the switch sends until it has been quiet for ``quiet`` s."""
        out = []
        end = time.monotonic() + limit
        while True:
            got = self.recv(quiet)
            if got is None:
                break
            out.append(got)
            if time.monotonic() >= end:
                break
        return out


def _which(name: str) -> str:
    for d in os.environ.get("PATH", "").split(os.pathsep) + ["/usr/bin", "/bin", "/usr/sbin", "/sbin"]:
        f = Path(d) / name
        if f.is_file() and os.access(f, os.X_OK):
            return str(f)
    raise P4ToolError(f"{name} (util-linux) not found")


def _sh_quote(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"
