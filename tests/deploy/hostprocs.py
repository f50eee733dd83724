"""What runs and listens on this machine, read from /proc, for the `ray up` test (rayup.py): processes
by owner, listening TCP sockets and which process holds them, and stopping a process group by PID.
Reads /proc and signals only the PIDs it is given; it never looks processes up by name."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

from deploy.owned import listeners, socket_inodes  # noqa: F401 — this module's callers use them too
from deploy.owned import running as alive  # noqa: F401 — a process runs (a zombie is gone)


def listening(ip: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((ip, port)) == 0


def processes() -> list[tuple[int, int, str]]:
    """(pid, real uid, command line) of every live (non-zombie) process."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            status = (d / "status").read_text().splitlines()
            if any(line.startswith("State:") and "Z" in line.split()[1] for line in status):
                continue  # a zombie holds nothing; its reaping is up to its parent
            uid = next(int(line.split()[1]) for line in status if line.startswith("Uid:"))
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, StopIteration):
            continue
        out.append((int(d.name), uid, cmd))
    return out


def port_holders(port: int) -> list[str]:
    """The command lines of this user's processes that hold a listening socket on ``port``."""
    inodes = {inode for _, p, inode in listeners() if p == port}
    return [cmd for pid, uid, cmd in processes() if uid == os.getuid() and socket_inodes(pid) & inodes]


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a process started with start_new_session=True and every process left in its group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def kill_pids(pids: list[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError as e:
        return f"({path}: {e})"


def die_with_parent() -> None:
    """A Popen preexec_fn: the child gets SIGTERM when the process that started it dies, even by
    SIGKILL, which runs no `finally` (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
