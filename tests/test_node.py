"""The node's cores shared by its local ranks: the partition (pure), the /sys readers on fake trees, the
kernel's default thread count under torchrun's environment, and the worker thread pinning itself."""

import logging
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from twinflow.base import node
from twinflow.host import ops
from twinflow.host.executor import CpuExecutor, Job


@pytest.fixture(autouse=True)
def fresh_share(monkeypatch: pytest.MonkeyPatch):
    """No LOCAL_* or thread settings from outside, and the share read again by each test (and after it)."""
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "TWINFLOW_NUM_THREADS", "TWINFLOW_PIN"):
        monkeypatch.delenv(name, raising=False)
    ops.announced_share.cache_clear()
    yield
    ops.announced_share.cache_clear()


def slices(allowed, numa, ranks, gpu_nodes) -> list[list[int]]:
    return [node.kernel_cpus(set(allowed), numa, r, ranks, gpu_nodes) for r in range(ranks)]


def test_one_numa_node_is_shared_evenly_by_local_rank() -> None:
    cpus = set(range(64))
    got = slices(cpus, {0: cpus}, 4, [0, 0, 0, 0])
    assert got == [list(range(16 * r, 16 * r + 16)) for r in range(4)]
    assert slices(cpus, {0: cpus}, 4, [None] * 4) == got  # GPUs unknown: the same even slices


def test_two_numa_nodes_give_each_rank_a_slice_of_its_gpus_node() -> None:
    numa = {0: set(range(0, 16)) | set(range(32, 48)), 1: set(range(16, 32)) | set(range(48, 64))}
    got = slices(set(range(64)), numa, 4, [0, 0, 1, 1])
    assert got == [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], list(range(32, 48)),
                   list(range(16, 32)), list(range(48, 64))]  # fmt: skip
    assert all(set(s) <= numa[0] for s in got[:2]) and all(set(s) <= numa[1] for s in got[2:])
    # GPUs interleaved across the nodes: each rank still on its own GPU's node, the pairs disjoint
    got = slices(set(range(64)), numa, 4, [0, 1, 0, 1])
    assert set(got[0]) | set(got[2]) == numa[0] and set(got[1]) | set(got[3]) == numa[1]
    assert not set(got[0]) & set(got[2]) and not set(got[1]) & set(got[3])


def test_uneven_counts_differ_by_at_most_one_core_and_cover_the_pool() -> None:
    numa = {0: set(range(10)), 1: set(range(10, 17))}
    got = slices(set(range(17)), numa, 4, [0, 0, 0, 1])  # three ranks share node 0's 10 cores, one has node 1
    assert [len(s) for s in got] == [3, 3, 4, 7]
    assert set().union(*got[:3]) == numa[0] and set(got[3]) == numa[1]
    assert sum(len(s) for s in got) == len(set().union(*got))  # disjoint
    got = slices(set(range(7)), {0: set(range(7))}, 3, [None] * 3)
    assert sorted(len(s) for s in got) == [2, 2, 3] and set().union(*got) == set(range(7))


def test_more_ranks_than_cores_still_gives_each_rank_one() -> None:
    got = slices({0, 1}, {0: {0, 1}}, 4, [None] * 4)
    assert all(len(s) == 1 for s in got) and set().union(*got) == {0, 1}
    share = node.CoreShare(tuple(got[3]), pool=2, sharers=4)
    assert share.describe().startswith("the CPU kernel uses 1 thread: this rank's share of 2 cores among 4 local")


def test_the_numa_slice_needs_several_usable_nodes_and_every_ranks_gpu_node() -> None:
    numa = {0: set(range(8)), 1: set(range(8, 16))}
    assert node.nearest_node(set(range(16)), numa, 1, [0, 1]) == 1
    assert node.nearest_node(set(range(16)), numa, 1, [None, 1]) is None  # a peer's node unknown
    assert node.nearest_node(set(range(8)), numa, 0, [0, 0]) is None  # only node 0's CPUs allowed
    assert node.nearest_node(set(range(12)), numa, 1, [0, 1]) == 1
    # allowed CPUs limit the slice: node 1's allowed cores are 8-11 only
    assert node.kernel_cpus(set(range(12)), numa, 1, 2, [0, 1]) == [8, 9, 10, 11]
    # no usable nodes' slice: all allowed CPUs shared by local rank
    assert node.kernel_cpus(set(range(8)), numa, 1, 2, [0, 1]) == [4, 5, 6, 7]


def test_cpulists_parse_and_format() -> None:
    assert node.parse_cpulist("0-15,32-47\n") == set(range(16)) | set(range(32, 48))
    assert node.parse_cpulist("3") == {3} and node.parse_cpulist("\n") == set()
    assert node.format_cpulist([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"
    assert node.format_cpulist(node.parse_cpulist("0-15,32-47")) == "0-15,32-47"


def fake_sys(root: Path, files: dict[str, str]) -> str:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return f"{root}/"


def test_numa_nodes_and_a_pci_devices_node_are_read_from_sys(tmp_path: Path) -> None:
    root = fake_sys(tmp_path, {
        "sys/devices/system/node/node0/cpulist": "0-15,32-47\n",
        "sys/devices/system/node/node1/cpulist": "16-31,48-63\n",
        "sys/devices/system/node/node2/cpulist": "\n",  # memory only: no CPUs
        "sys/devices/system/node/online": "0-2\n",
        "sys/bus/pci/devices/0000:1b:00.0/numa_node": "1\n",
        "sys/bus/pci/devices/0000:3a:00.0/numa_node": "-1\n",
    })  # fmt: skip
    assert node.numa_nodes(root) == {0: set(range(16)) | set(range(32, 48)), 1: set(range(16, 32)) | set(range(48, 64))}
    assert node.numa_nodes(f"{tmp_path}/nothing/") == {}
    gpu = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x1B, pci_device_id=0)
    assert node.pci_address(gpu) == "0000:1b:00.0"
    assert node.pci_numa_node(node.pci_address(gpu), root) == 1
    assert node.pci_numa_node("0000:3A:00.0", root) is None  # -1: unknown
    assert node.pci_numa_node("0000:99:00.0", root) is None  # no such device


def test_local_ranks_come_from_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (node.local_rank(), node.local_ranks()) == (0, 1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert (node.local_rank(), node.local_ranks()) == (3, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "four")
    assert node.local_ranks() == 1


def two_node_host(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, gpu_nodes: list[int | None]) -> None:
    """A host of 64 CPUs on two NUMA nodes whose local ranks' GPUs sit on `gpu_nodes`, as this process sees it."""
    root = fake_sys(tmp_path, {"sys/devices/system/node/node0/cpulist": "0-31\n",
                               "sys/devices/system/node/node1/cpulist": "32-63\n"})  # fmt: skip
    real = node.numa_nodes
    monkeypatch.setattr(node, "numa_nodes", lambda root_="/": real(root))
    monkeypatch.setattr(node, "gpu_numa_nodes", lambda ranks, root_="/": list(gpu_nodes))
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(64)))


def torchrun(monkeypatch: pytest.MonkeyPatch, rank: int, ranks: int, torch_threads: int = 1) -> None:
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    monkeypatch.setattr(torch, "get_num_threads", lambda: torch_threads)


def test_torchruns_one_thread_becomes_this_ranks_share(monkeypatch, tmp_path, caplog) -> None:
    two_node_host(monkeypatch, tmp_path, [0, 0, 1, 1])
    torchrun(monkeypatch, rank=2, ranks=4)
    with caplog.at_level(logging.INFO, logger="twinflow.notice"):
        assert ops.default_num_threads() == 16
    share = ops.automatic_share()
    assert share.cpus == tuple(range(32, 48)) and share.numa_node == 1 and share.pin
    assert caplog.messages == ["the CPU kernel uses 16 threads on cores 32-47 (NUMA node 1, nearest cuda:2): this "
                               "rank's share of that node's 32 cores among the 2 local ranks there; set "
                               "TWINFLOW_NUM_THREADS to change it"]  # fmt: skip


def test_gpus_of_unknown_node_share_the_host_evenly_unpinned(monkeypatch, tmp_path) -> None:
    two_node_host(monkeypatch, tmp_path, [None, None])
    torchrun(monkeypatch, rank=1, ranks=2)
    assert ops.default_num_threads() == 32
    share = ops.automatic_share()
    assert share.cpus == tuple(range(32, 64)) and share.numa_node is None and not share.pin


def test_the_users_thread_settings_win(monkeypatch, tmp_path) -> None:
    two_node_host(monkeypatch, tmp_path, [0, 1])
    torchrun(monkeypatch, rank=0, ranks=2)
    monkeypatch.setenv("TWINFLOW_NUM_THREADS", "5")
    assert ops.default_num_threads() == 5 and ops.automatic_share() is None
    monkeypatch.delenv("TWINFLOW_NUM_THREADS")
    torchrun(monkeypatch, rank=0, ranks=2, torch_threads=7)  # the user's OMP_NUM_THREADS=7
    assert ops.default_num_threads() == 7 and ops.automatic_share() is None
    torchrun(monkeypatch, rank=0, ranks=1)  # one process: torch's count, nothing shared
    assert ops.default_num_threads() == 1 and ops.automatic_share() is None
    torchrun(monkeypatch, rank=0, ranks=2)
    monkeypatch.setenv("TWINFLOW_PIN", "0")
    assert ops.default_num_threads() == 32 and not ops.automatic_share().pin


def run_a_worker(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, int, tuple[int, ...]]]:
    """Starts an executor's worker, runs one job, stops it: each sched_setaffinity call (recorded, not applied)
    as (made on the worker thread, pid, cpus)."""
    calls = []

    def record(pid: int, cpus) -> None:
        calls.append((threading.current_thread(), pid, cpus))

    monkeypatch.setattr(os, "sched_setaffinity", record)
    executor = CpuExecutor(torch.device("cpu"))
    ran = []
    with executor.condition:
        executor.submit(Job("chunk", 0, lambda: ran.append(threading.current_thread()), lambda: (0,)))
        executor.wait_until(lambda: bool(ran) and executor.running is None)
    executor.close()
    assert ran == [executor.thread]
    return [(thread is executor.thread, pid, tuple(cpus)) for thread, pid, cpus in calls]


def test_the_worker_pins_itself_to_this_ranks_numa_share(monkeypatch, tmp_path) -> None:
    two_node_host(monkeypatch, tmp_path, [0, 0, 1, 1])
    torchrun(monkeypatch, rank=1, ranks=4)
    # once, on the worker thread (pid 0: the calling thread), to local rank 1's half of node 0
    assert run_a_worker(monkeypatch) == [(True, 0, tuple(range(16, 32)))]


def test_the_worker_is_not_pinned_when_off_or_not_chosen_by_twinflow(monkeypatch, tmp_path) -> None:
    two_node_host(monkeypatch, tmp_path, [0, 0, 1, 1])
    torchrun(monkeypatch, rank=1, ranks=4)
    monkeypatch.setenv("TWINFLOW_PIN", "0")
    assert run_a_worker(monkeypatch) == []
    monkeypatch.delenv("TWINFLOW_PIN")
    monkeypatch.setenv("TWINFLOW_NUM_THREADS", "8")
    assert run_a_worker(monkeypatch) == []
    monkeypatch.delenv("TWINFLOW_NUM_THREADS")
    two_node_host(monkeypatch, tmp_path, [None] * 4)  # GPUs' nodes unknown: an even share, unpinned
    assert run_a_worker(monkeypatch) == []


def test_pinning_really_sets_the_calling_threads_mask_only() -> None:
    allowed = os.sched_getaffinity(0)
    target = {min(allowed)}
    seen = {}

    def pin() -> None:
        node.pin_this_thread(sorted(target))
        seen["worker"] = os.sched_getaffinity(0)
        node.pin_this_thread(sorted(allowed))

    thread = threading.Thread(target=pin)
    thread.start()
    thread.join()
    assert seen["worker"] == target and os.sched_getaffinity(0) == allowed


@pytest.mark.skipif("OpenMP" not in torch.__config__.parallel_info(),
                    reason="torch's native thread pool cannot change its size once it has run")  # fmt: skip
def test_torch_threads_raises_the_count_for_the_block_and_puts_it_back() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with node.torch_threads(3):
            assert torch.get_num_threads() == 3
        assert torch.get_num_threads() == 1
        torch.set_num_threads(4)
        with node.torch_threads(2):  # never lowered: a user's larger count stays
            assert torch.get_num_threads() == 4
        assert torch.get_num_threads() == 4
        torch.set_num_threads(1)
        with pytest.raises(RuntimeError, match="inside"), node.torch_threads(2):
            raise RuntimeError("inside")
        assert torch.get_num_threads() == 1  # put back on an error too
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not node.per_thread_counts(), reason="torch's native pool keeps one count for the process")
def test_a_worker_started_inside_another_threads_window_takes_the_count_from_outside_it() -> None:
    """torch gives a thread the process-wide count of its first use for its life: a worker whose first call falls
    inside the main thread's torch_threads window would keep the raised count (and read no torchrun share, so run
    unpinned on the raised count). The worker settles the count first."""
    outside = torch.get_num_threads()
    seen = []
    try:
        with node.torch_threads(outside + 2):
            bare = threading.Thread(target=lambda: seen.append(("bare", torch.get_num_threads())))
            bare.start()
            bare.join()
            executor = CpuExecutor(torch.device("cpu"))
            with executor.condition:
                executor.submit(Job("chunk", 0, lambda: seen.append(("worker", torch.get_num_threads())), lambda: (0,)))
                executor.wait_until(lambda: seen[-1][0] == "worker" and executor.running is None)
            executor.close()
            assert torch.get_num_threads() == outside + 2  # the window's own thread keeps its raised count
    finally:
        torch.set_num_threads(outside)
    # the bare thread shows the hazard (torch's behaviour); the worker, which settles its count first, does not
    assert seen == [("bare", outside + 2), ("worker", outside)]
    assert torch.get_num_threads() == outside
