"""The processes `moeray up` started, by PID and start time, so that `moeray down` stops exactly them, also
after the cluster (or `up` itself) died: a Ray node's processes and their children (workers, Serve's
HAProxy), which outlive their parent when it dies, and a Redis it started.

A record is ``[pid, start]``: ``start`` is the process's start time in clock ticks since boot (field 22 of
/proc/PID/stat), so that a PID the kernel has since given to another process is never signalled. Reads
/proc (Linux); signals only recorded processes.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), or None if it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


def record(pids) -> list[list[int]]:
    """``[pid, start]`` for each of ``pids`` that runs."""
    out = []
    for pid in pids:
        start = start_time(pid)
        if start is not None:
            out.append([pid, start])
    return out


def _parents() -> dict[int, int]:
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                out[int(d.name)] = int(Path(d, "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return out


def with_descendants(pids) -> set[int]:
    """``pids`` and every process below them (their children, the children's children, ...)."""
    children: dict[int, list[int]] = {}
    for pid, parent in _parents().items():
        children.setdefault(parent, []).append(pid)
    out, todo = set(), list(pids)
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo += children.get(pid, [])
    return out


def running(pid) -> bool:
    """The process runs. A zombie (exited, not yet reaped by its parent, e.g. a `moeray up` started
    by a script that has not waited for it yet) counts as gone."""
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no procfs: trust kill(0)
        return True


def alive(records) -> list[list[int]]:
    """The records whose process still runs (the same process: its start time matches)."""
    return [[pid, start] for pid, start in records if start_time(pid) == start]


def stop(records, *, grace_s: float = 5.0) -> list[int]:
    """SIGTERM every recorded process that still runs, SIGKILL what is left after ``grace_s``; wait until
    all are gone (10 s at most). Returns the PIDs it signalled."""
    left = alive(records)
    for pid, _ in left:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive(left) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid, _ in alive(left):
        _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while alive(left) and time.monotonic() < deadline:
        _reap()
        time.sleep(0.05)
    return [pid for pid, _ in left]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _reap() -> None:
    """Reap exited children of this process (a recorded process may be one), so they stop counting."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def listeners() -> list[tuple[str, int, int]]:
    """(ip, port, socket inode) of every listening TCP socket. IPv6: "::" for the wildcard address
    (which also takes IPv4 unless v6only), "v6" for any other."""
    out = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            addr, port = fields[1].split(":")
            if v6:
                ip = "::" if set(addr) == {"0"} else "v6"
            else:
                ip = socket.inet_ntoa(bytes.fromhex(addr)[::-1])
            out.append((ip, int(port, 16), int(fields[9])))
    return out


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets process `pid` holds open."""
    out = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """(ip, port) of every listening TCP socket process ``pid`` holds."""
    mine = socket_inodes(pid)
    return [(ip, port) for ip, port, inode in listeners() if inode in mine]
