"""How much host memory this process may still take, and how many processes of the job share it
(:func:`twinflow.base.node.local_ranks`)."""

from __future__ import annotations

from pathlib import Path

from twinflow.base.node import local_ranks

__all__ = ["host_available_bytes", "local_ranks"]  # local_ranks: defined in twinflow.base.node, kept importable here


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _cgroup_room(limit: str | None, usage: str | None, stat: str | None, inactive_key: str) -> float:
    """A cgroup's limit less its usage, page cache it can drop (inactive file pages) not counted as used."""
    if limit is None or usage is None or not limit.strip().isdigit():  # "max" (v2) or unreadable: no limit
        return float("inf")
    if int(limit) >= 1 << 60:  # cgroup v1 writes "no limit" as a huge number
        return float("inf")
    stats = dict(line.split() for line in (stat or "").splitlines() if len(line.split()) == 2)
    used = int(usage) - int(stats.get(inactive_key, 0))
    return float(max(0, int(limit) - used))


def host_available_bytes(root: str = "/") -> float:
    """What this process may still take of host memory: MemAvailable, or less under its cgroup's limit (v2: the
    group /proc/self/cgroup names, else the root group; v1: the memory controller's). inf where none can be read.
    `root`: prefixed to every path (tests)."""
    available = float("inf")
    for line in (_read(f"{root}proc/meminfo") or "").splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    groups = [line.split(":", 2)[2] for line in (_read(f"{root}proc/self/cgroup") or "").splitlines()
              if line.startswith("0::")]  # fmt: skip
    for group in [g.strip().strip("/") for g in groups] + [""]:
        base = f"{root}sys/fs/cgroup/{group}/".replace("//", "/")
        if _read(base + "memory.max") is not None:
            room = _cgroup_room(_read(base + "memory.max"), _read(base + "memory.current"),
                                _read(base + "memory.stat"), "inactive_file")  # fmt: skip
            return min(available, room)
    v1 = f"{root}sys/fs/cgroup/memory/"
    room = _cgroup_room(_read(v1 + "memory.limit_in_bytes"), _read(v1 + "memory.usage_in_bytes"),
                        _read(v1 + "memory.stat"), "total_inactive_file")  # fmt: skip
    return min(available, room)
