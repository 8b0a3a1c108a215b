"""The node's cores shared by its local ranks: which CPUs this rank's CPU kernel takes.

torchrun starts one process per GPU and gives each one thread (OMP_NUM_THREADS=1). The processes of a node
share its cores and memory bandwidth, so each rank's kernel takes a disjoint slice of them: on a host with
several NUMA nodes, a slice of the node nearest its GPU, shared with the local ranks whose GPUs sit on the
same node; elsewhere an even slice of the CPUs this process may use. Local rank r is taken to drive cuda:r
(torchrun's convention). Every function that reads the host takes `root`, a prefix of its paths (tests).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


def local_rank() -> int:
    """This process's index among the job's processes on this host (torchrun's LOCAL_RANK; 0 without it)."""
    try:
        return max(0, int(os.environ.get("LOCAL_RANK", "0")))
    except ValueError:
        return 0


def local_ranks() -> int:
    """Processes of this job on this host (torchrun's LOCAL_WORLD_SIZE; 1 without it): they share its memory
    and cores."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity mask; every CPU where the platform has none)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def parse_cpulist(text: str) -> set[int]:
    """The CPUs of a kernel cpulist such as "0-15,32-47" (empty text: none)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def format_cpulist(cpus: Sequence[int] | set[int]) -> str:
    """`cpus` as a cpulist, runs joined: [0, 1, 2, 3, 8] -> "0-3,8"."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def numa_nodes(root: str = "/") -> dict[int, set[int]]:
    """NUMA node -> its CPUs, from /sys/devices/system/node/node*/cpulist (nodes without CPUs left out; empty
    where the host does not say)."""
    nodes = {}
    for path in Path(f"{root}sys/devices/system/node").glob("node[0-9]*/cpulist"):
        try:
            cpus = parse_cpulist(path.read_text())
        except (OSError, ValueError):
            continue
        if cpus:
            nodes[int(path.parent.name[4:])] = cpus
    return nodes


def pci_address(properties: Any) -> str:
    """The sysfs PCI address ("0000:1b:00.0") of a GPU, from torch.cuda.get_device_properties()."""
    domain, bus, device = properties.pci_domain_id, properties.pci_bus_id, properties.pci_device_id
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


def pci_numa_node(address: str, root: str = "/") -> int | None:
    """The NUMA node of the PCI device at `address` (/sys/bus/pci/devices/<address>/numa_node); None where it is
    unreadable or -1 (unknown)."""
    try:
        node = int(Path(f"{root}sys/bus/pci/devices/{address.lower()}/numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def gpu_numa_nodes(ranks: int, root: str = "/") -> list[int | None]:
    """The NUMA node of each local rank's GPU (rank r: cuda:r), None where unknown: all of them where this
    process does not see a GPU per local rank."""
    try:
        if not torch.cuda.is_available() or torch.cuda.device_count() < ranks:
            return [None] * ranks
        return [pci_numa_node(pci_address(torch.cuda.get_device_properties(r)), root) for r in range(ranks)]
    except Exception:  # no driver, or a torch without the PCI ids: unknown, as the other cases
        return [None] * ranks


def nearest_node(
    allowed: set[int], numa: Mapping[int, set[int]], rank: int, gpu_nodes: Sequence[int | None]
) -> int | None:
    """The NUMA node whose cores this rank's kernel takes: its GPU's node, where this process may use the CPUs of
    several nodes (that one among them) and every local rank's GPU node is known (the ranks sharing a node must
    agree on their slices); None otherwise."""
    usable = {node for node, cpus in numa.items() if cpus & allowed}
    if len(usable) < 2 or len(gpu_nodes) <= rank or any(n is None for n in gpu_nodes):
        return None
    return gpu_nodes[rank] if gpu_nodes[rank] in usable else None


def kernel_cpus(
    allowed: set[int], numa: Mapping[int, set[int]], rank: int, ranks: int, gpu_nodes: Sequence[int | None]
) -> list[int]:
    """This rank's CPUs (sorted), disjoint from the other local ranks' while there are cores enough: a slice of
    its nearest NUMA node's allowed cores among the local ranks whose GPUs sit there, else a slice of `allowed`
    among all local ranks. Slices are even (sizes differ by at most one); a rank left none gets one core,
    shared."""
    node = nearest_node(allowed, numa, rank, gpu_nodes)
    if node is None:
        pool, sharers, index = sorted(allowed), ranks, rank
    else:
        peers = [r for r, n in enumerate(gpu_nodes) if n == node]
        pool, sharers, index = sorted(numa[node] & allowed), len(peers), peers.index(rank)
    share = pool[index * len(pool) // sharers : (index + 1) * len(pool) // sharers]
    return share or [pool[index % len(pool)]]


@dataclass(frozen=True)
class CoreShare:
    """This rank's share of the node's cores: `cpus` of the `pool` cores shared among `sharers` local ranks;
    `numa_node` the node nearest its GPU (`gpu`) where the share is a slice of it, else None; `pin`: the
    kernel's worker thread is to be pinned to `cpus`."""

    cpus: tuple[int, ...]
    pool: int
    sharers: int
    numa_node: int | None = None
    gpu: int | None = None
    pin: bool = False

    def describe(self) -> str:
        """One line saying what the kernel was given and why."""
        where = f" on cores {format_cpulist(self.cpus)}" if self.pin else ""
        if self.numa_node is None:
            whose = f"this rank's share of {self.pool} cores among {self.sharers} local ranks"
        else:
            where += f" (NUMA node {self.numa_node}, nearest cuda:{self.gpu})"
            whose = f"this rank's share of that node's {self.pool} cores among the {self.sharers} local ranks there"
        threads = f"{len(self.cpus)} thread{'s' if len(self.cpus) > 1 else ''}"
        return f"the CPU kernel uses {threads}{where}: {whose}; set TWINFLOW_NUM_THREADS to change it"


def core_share(rank: int, ranks: int, pin: bool = True, root: str = "/") -> CoreShare:
    """Local rank `rank`'s share on this host: :func:`kernel_cpus` over the CPUs this process may use, the NUMA
    nodes and the GPUs' nodes (looked up only where there are several nodes). `pin`: pin the worker thread where
    the share is a NUMA node's slice (elsewhere pinning gains nothing)."""
    allowed, numa = allowed_cpus(), numa_nodes(root)
    several = len({node for node, cpus in numa.items() if cpus & allowed}) > 1
    gpu_nodes = gpu_numa_nodes(ranks, root) if several else [None] * ranks  # one node: no GPU to look up
    cpus = kernel_cpus(allowed, numa, rank, ranks, gpu_nodes)
    node = nearest_node(allowed, numa, rank, gpu_nodes)
    if node is None:
        return CoreShare(tuple(cpus), len(allowed), ranks)
    sharers = sum(n == node for n in gpu_nodes)
    return CoreShare(tuple(cpus), len(numa[node] & allowed), sharers, node, rank, pin)


def pin_this_thread(cpus: Sequence[int]) -> None:
    """Pins the calling thread (not the process: pid 0 is the caller on Linux) to `cpus`; threads it starts
    later inherit its mask. A host that refuses is warned about, and the thread runs unpinned."""
    try:
        os.sched_setaffinity(0, cpus)
    except (OSError, AttributeError) as exc:  # AttributeError: a platform without sched_setaffinity
        log.warning("could not pin the CPU kernel's thread to cores %s (%s); it runs unpinned",
                    format_cpulist(cpus), exc)  # fmt: skip


_OUTSIDE: list[int] = []  # torch's thread count before each open torch_threads window that raised it, oldest first
_WINDOWS = threading.Lock()


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads raised to `threads` for the block (never lowered), then put back: a rank that
    torchrun gave one thread fills and copies its share of the host state with its share of the cores."""
    before = torch.get_num_threads()
    raised = threads > before
    if raised:
        with _WINDOWS:
            _OUTSIDE.append(before)
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
        if raised:
            with _WINDOWS:
                _OUTSIDE.remove(before)


def settle_torch_threads() -> None:
    """The first call of a thread that no :func:`torch_threads` window covers (the CPU share's worker). torch
    gives a thread the count that is set process-wide when the thread first uses it, for the thread's life: one
    started inside another thread's window would keep the raised count (and the worker would neither see torchrun's
    one thread nor pin itself to its share of the cores). Here it takes the count from outside every window. torch
    sets that count process-wide too: a thread that first uses torch later inside the same window starts with it,
    as it would have outside the window; the window's own thread keeps its raised count."""
    with _WINDOWS:
        outside = _OUTSIDE[0] if _OUTSIDE else None
    if outside is not None and per_thread_counts() and torch.get_num_threads() != outside:
        torch.set_num_threads(outside)


@functools.cache
def per_thread_counts() -> bool:
    """Whether torch keeps a thread count per thread (its OpenMP backend); its native pool has one for the
    process, which a window raises for every thread alike."""
    return "OpenMP" in torch.__config__.parallel_info()
