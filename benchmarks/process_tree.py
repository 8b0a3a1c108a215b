"""The processes a benchmark starts: how one ended, and stopping one with everything it started."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from pathlib import Path


def failure(code: int | str, output: str) -> str:
    """What stopped a system: timeout, out of memory (CUDA's message), killed (a SIGKILL), or failed."""
    if code == "timeout":
        return "timeout"
    if "out of memory" in output.lower():  # before SIGKILL: torchrun kills the other ranks after an OOM
        return "out of memory"
    tail = output[-3000:]
    if code in (-9, 137) or "SIGKILL" in tail or "Killed" in tail:
        return "killed (host memory?)"
    return "failed"


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


def stop_tree(proc: subprocess.Popen, grace: float = 15.0, reap: float = 60.0) -> None:
    """Stops a launcher and everything it started, and returns once every one of them has exited.

    torchrun puts its workers in sessions of their own, so neither killing it nor its process group
    reaches them, and left running they would hold GPU and host memory through the next system. It
    gets SIGTERM first (it then stops its workers itself), then whatever is left gets SIGKILL. The
    launcher is reaped here; the workers are not this process's children, so they are waited for
    through pidfds (readable once the process has exited), opened before any signal so that a
    number the system reuses afterwards is never signalled nor waited for.
    """
    handles = pidfds(descendants(proc.pid))
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        handles += pidfds(descendants(proc.pid))  # any started meanwhile (the launcher still runs)
    proc.kill()  # no-op when already reaped
    proc.wait()
    for fd in handles:
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            pass  # exited already
    poller = select.poll()
    for fd in handles:
        poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + reap
    left = set(handles)
    while left and time.monotonic() < deadline:
        for fd, _ in poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
            poller.unregister(fd)
            left.discard(fd)
    for fd in handles:
        os.close(fd)
    if left:
        print(f"warning: {len(left)} process(es) of {proc.args[:3]} still running {reap:.0f} s after SIGKILL",
              flush=True)  # fmt: skip


def pidfds(pids: list[int]) -> list[int]:
    """A pidfd for each process still running (opened before any signal: a reused number is never hit)."""
    fds = []
    for pid in pids:
        try:
            fds.append(os.pidfd_open(pid))
        except ProcessLookupError:
            pass  # exited meanwhile
    return fds
