"""Which processes listen on a TCP port, read from Linux's /proc: how the launcher tells that the
server answering its readiness check is the service it started, not another program that held the
port first (a health check over the network cannot tell them apart).

/proc/net/tcp{,6} lists every socket with its local port, state and inode; /proc/<pid>/fd/* links
to `socket:[inode]` for the sockets a process holds. A listener whose inode a process of the
service's group holds is the service's.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

PROC = Path("/proc")
TCP_TABLES = ("net/tcp", "net/tcp6")
TCP_LISTEN = "0A"  # the state column of a listening socket (include/net/tcp_states.h: TCP_LISTEN = 10)


def is_supported(proc: Path = PROC) -> bool:
    """Whether this system has the tables (Linux); elsewhere ownership cannot be checked."""
    return (proc / TCP_TABLES[0]).is_file()


def listening_inodes(port: int, proc: Path = PROC) -> set[int]:
    """Inodes of the sockets that listen on `port` (any address, IPv4 or IPv6)."""
    inodes: set[int] = set()
    for table in TCP_TABLES:
        try:
            lines = (proc / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            # E.g. "0: 0100007F:1F40 00000000:0000 0A ... 0 12345 ...": local address:port in hex,
            # remote, state, ..., the inode is the 10th column.
            fields = line.split()
            if len(fields) < 10 or fields[3] != TCP_LISTEN:
                continue
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(int(fields[9]))
    return inodes


def group_pids(pgid: int, proc: Path = PROC) -> list[int]:
    """The processes of process group `pgid` (a service and what it spawned)."""
    pids = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # /proc/<pid>/stat: "pid (comm) state ppid pgrp ..."; comm may hold spaces and parentheses.
            after_comm = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(after_comm) > 2 and int(after_comm[2]) == pgid:
            pids.append(int(entry.name))
    return pids


def socket_inodes(pids: Iterable[int], proc: Path = PROC) -> set[int]:
    """Inodes of the sockets the processes hold (those whose fds this user may read)."""
    inodes: set[int] = set()
    for pid in pids:
        fd_dir = proc / str(pid) / "fd"
        try:
            names = os.listdir(fd_dir)
        except OSError:
            continue
        for name in names:
            try:
                target = os.readlink(fd_dir / name)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def is_listening_in_group(pgid: int, port: int, proc: Path = PROC) -> bool:
    """Whether a process of group `pgid` holds a socket listening on `port`."""
    listeners = listening_inodes(port, proc)
    return bool(listeners) and bool(listeners & socket_inodes(group_pids(pgid, proc), proc))
