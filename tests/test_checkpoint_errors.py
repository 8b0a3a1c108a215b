"""Checkpoint mistakes and damage: each error names the problem and the fix; a failed save leaves nothing behind."""

import builtins
import errno
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_checkpoint import assert_unchanged, build, snapshot, train
from twinflow import CPUAdam, TwinFlowAdam
from twinflow.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

REPO = Path(__file__).resolve().parents[1]


def listing(root: Path) -> list[str]:
    """Every file and folder under `root`, relative to it."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def saved(tmp_path: Path, *tags: str) -> tuple:
    """A trained model, optimizer and scheduler, saved under `tags` (the last one is 'latest')."""
    model, opt, sched = build()
    train(model, opt, sched, torch.Generator().manual_seed(3), 2)
    for tag in tags:
        save_checkpoint(tmp_path, tag, model=model, optimizer=opt, scheduler=sched)
    return model, opt, sched


# ------------------------------------------------------------- 7: where the checkpoint is


def test_a_tag_folder_is_named_with_its_parent_and_tag(tmp_path) -> None:
    model, opt, sched = saved(tmp_path, "step3")
    with pytest.raises(CheckpointError, match="is a checkpoint tag folder; pass its parent") as info:
        load_checkpoint(tmp_path / "step3", model=model, optimizer=opt, scheduler=sched)
    assert repr(str(tmp_path)) in str(info.value) and "tag='step3'" in str(info.value)


def test_a_shard_file_is_named_with_the_directory_and_tag(tmp_path) -> None:
    model, opt, sched = saved(tmp_path, "step3")
    with pytest.raises(CheckpointError, match="is a shard file .*pass the checkpoint directory") as info:
        load_checkpoint(tmp_path / "step3" / "rank0.pt", model=model, optimizer=opt, scheduler=sched)
    assert repr(str(tmp_path)) in str(info.value) and "tag='step3'" in str(info.value)


def test_a_missing_directory_is_named(tmp_path) -> None:
    model, opt, sched = build()
    with pytest.raises(CheckpointError, match="does not exist: pass the directory given to save_checkpoint"):
        load_checkpoint(tmp_path / "nope", model=model, optimizer=opt, scheduler=sched)


def test_without_latest_the_tags_there_are_listed(tmp_path) -> None:
    model, opt, sched = saved(tmp_path, "a", "b")
    (tmp_path / "latest").unlink()
    with pytest.raises(CheckpointError, match=r"no 'latest' file.*\['a', 'b'\]; pass one as tag=, e.g. tag='b'"):
        load_checkpoint(tmp_path, model=model, optimizer=opt, scheduler=sched)
    load_checkpoint(tmp_path, "b", model=model, optimizer=opt, scheduler=sched)  # the fix works


def test_a_missing_tag_lists_the_tags_there(tmp_path) -> None:
    model, opt, sched = saved(tmp_path, "a")
    with pytest.raises(CheckpointError, match=r"no checkpoint 'x' in .*\['a'\]; pass one as tag="):
        load_checkpoint(tmp_path, "x", model=model, optimizer=opt, scheduler=sched)


# ------------------------------------------------------------- 7: meta.json's structure


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda m: m.pop("shards"), "'shards' is missing; expected an object mapping each shard file"),
        (lambda m: m.update(shards=[]), r"'shards' is \[\]; expected an object"),
        (lambda m: m.pop("world_size"), "'world_size' is missing; expected the number of ranks"),
        (lambda m: m["shards"]["rank0.pt"].pop("sha256"), r"'shards'\['rank0.pt'\]\['sha256'\] is missing"),
        (lambda m: m["shards"]["rank0.pt"].update(bytes="12"), r"\['bytes'\] is '12'; expected the shard's size"),
    ],
    ids=["no_shards", "shards_list", "no_world_size", "no_sha256", "bytes_str"],
)
def test_a_bad_meta_json_names_the_file_and_key(tmp_path, damage, message: str) -> None:
    model, opt, sched = saved(tmp_path, "t")
    meta_path = tmp_path / "t" / "meta.json"
    info = json.loads(meta_path.read_text())
    damage(info)
    meta_path.write_text(json.dumps(info))
    before = snapshot(model, opt, sched)
    with pytest.raises(CheckpointError, match=message) as caught:
        load_checkpoint(tmp_path, model=model, optimizer=opt, scheduler=sched)
    assert str(meta_path) in str(caught.value) and "damaged or was not written by" in str(caught.value)
    assert_unchanged(before, snapshot(model, opt, sched))


# ------------------------------------------------------------- 7: the optimizer state's entries


def make_optimizer(kind: str, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    if kind == "twinflow":
        return TwinFlowAdam(model.parameters(), lr=lr, ratio=0.5, chunk_bytes=256)
    if kind == "cpu_adam":
        return CPUAdam(model.parameters(), lr=lr)
    return torch.optim.AdamW(model.parameters(), lr=lr)


@pytest.mark.parametrize("key", ["exp_avg_sq", "step"])
@pytest.mark.parametrize("kind", ["twinflow", "cpu_adam", "adamw"])
def test_a_missing_optimizer_state_key_names_the_parameter_and_changes_nothing(
    tmp_path, monkeypatch: pytest.MonkeyPatch, kind: str, key: str
) -> None:
    def step(model, opt) -> None:
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    model, _, _ = build()
    opt = make_optimizer(kind, model, lr=1e-2)
    step(model, opt)
    state = opt.state_dict()
    del state["state"][1][key]  # a damaged state dict, saved with a valid hash
    monkeypatch.setattr(opt, "state_dict", lambda: state)
    save_checkpoint(tmp_path, "t", model=model, optimizer=opt)

    target, _, _ = build(seed=7)
    target_opt = make_optimizer(kind, target, lr=3e-3)  # another lr: a changed param group would show
    step(target, target_opt)
    before = [{k: v.clone() for k, v in target.state_dict().items()}, target_opt.state_dict(), None]
    with pytest.raises(CheckpointError, match=f"parameter index 1 .*has no '{key}'") as caught:
        load_checkpoint(tmp_path, model=target, optimizer=target_opt)
    assert "'exp_avg', 'exp_avg_sq'" in str(caught.value) and "load another tag" in str(caught.value)
    after = [target.state_dict(), target_opt.state_dict(), None]
    assert_unchanged(before, after)
    assert [g["lr"] for g in target_opt.param_groups] == [3e-3]


@pytest.mark.parametrize("damage", ["empty", "step_str"])
def test_a_damaged_twinflow_entry_is_refused_and_changes_nothing(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                                  damage: str) -> None:  # fmt: skip
    """An entry without Adam's keys would load into TwinFlowAdam as a fresh parameter (torch's rule for state of
    the user's own), and a step count that is not a number used to fail half-way through the load."""

    def step(model, opt) -> None:
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    model, _, _ = build()
    opt = make_optimizer("twinflow", model, lr=1e-2)
    step(model, opt)
    state = opt.state_dict()
    if damage == "empty":
        state["state"][1] = {}
    else:
        state["state"][1]["step"] = "3"
    monkeypatch.setattr(opt, "state_dict", lambda: state)
    save_checkpoint(tmp_path, "t", model=model, optimizer=opt)

    target, _, _ = build(seed=7)
    target_opt = make_optimizer("twinflow", target, lr=3e-3)
    step(target, target_opt)
    before = [{k: v.clone() for k, v in target.state_dict().items()}, target_opt.state_dict(), None]
    with pytest.raises(CheckpointError, match="parameter index 1") as caught:
        load_checkpoint(tmp_path, model=target, optimizer=target_opt)
    assert "load another tag" in str(caught.value)
    assert_unchanged(before, [target.state_dict(), target_opt.state_dict(), None])


# ------------------------------------------------------------- 7: size or hash mismatch


def test_another_world_size_is_refused_with_the_way_to_move_it_and_changes_nothing(tmp_path) -> None:
    """A per-rank checkpoint loads only on the world size that wrote it; the refusal says how to move it."""
    saved(tmp_path, "t")
    meta = tmp_path / "t" / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "world_size": 2}))  # as if two ranks had saved it
    model, opt, sched = build()
    train(model, opt, sched, torch.Generator().manual_seed(9), 1)
    before = snapshot(model, opt, sched)
    moved = r"saved by 2 ranks; this run has 1.*portable.*convert .* t --to-portable OUT_DIR"
    with pytest.raises(CheckpointError, match=moved):
        load_checkpoint(tmp_path, "t", model=model, optimizer=opt, scheduler=sched)
    assert_unchanged(before, snapshot(model, opt, sched))


def test_a_size_mismatch_says_both_sizes(tmp_path) -> None:
    model, opt, sched = saved(tmp_path, "t")
    shard = tmp_path / "t" / "rank0.pt"
    n = shard.stat().st_size
    shard.write_bytes(shard.read_bytes() + b"x")
    with pytest.raises(CheckpointError, match=f"is {n + 1} bytes, its meta.json records {n}: .*truncated or corrupt"):
        load_checkpoint(tmp_path, model=model, optimizer=opt, scheduler=sched)


def test_a_hash_mismatch_says_both_hashes(tmp_path) -> None:
    import hashlib

    model, opt, sched = saved(tmp_path, "t")
    shard = tmp_path / "t" / "rank0.pt"
    recorded = json.loads((tmp_path / "t" / "meta.json").read_text())["shards"]["rank0.pt"]["sha256"]
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    found = hashlib.sha256(data).hexdigest()
    with pytest.raises(CheckpointError, match=f"has sha256 {found}, its meta.json records {recorded}") as caught:
        load_checkpoint(tmp_path, model=model, optimizer=opt, scheduler=sched)
    assert "corrupt or was replaced" in str(caught.value) and "load another tag" in str(caught.value)
    assert "bytes, matches" in str(caught.value)


# ------------------------------------------------------------- 8: nothing half-written

KILLED_SAVE = """
import os, signal, sys, torch
from twinflow.checkpoint import save_checkpoint
model = torch.nn.Linear(4, 4)
opt = torch.optim.AdamW(model.parameters())
def fsync(fd):  # the shard is written, not yet flushed or renamed: the point where a SIGKILL hurts most
    os.kill(os.getpid(), signal.SIGKILL)
os.fsync = fsync
print(os.getpid(), flush=True)
save_checkpoint(sys.argv[1], "killed", model=model, optimizer=opt)
"""


@pytest.mark.parametrize("next_call", ["save", "load"])
def test_the_next_save_or_load_removes_a_killed_saves_temporary(tmp_path, next_call: str) -> None:
    model, opt, sched = saved(tmp_path, "good")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(tmp_path)], env=env, capture_output=True, text=True)
    assert child.returncode == -signal.SIGKILL, child.stderr
    dead = int(child.stdout.split()[0])  # reaped by subprocess.run: no process has this pid now
    left = [p for p in listing(tmp_path) if f".tmp{dead}" in p]
    assert len(left) == 1 and "rank0.pt" in left[0]  # the killed save's shard, never renamed
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())  # as temporaries name this host
    keep = [  # a live writer's (another rank's, in flight), another host's, and not ours
        tmp_path / f".latest.tmp{os.getppid()}@{host}",
        tmp_path / "good" / f".rank1.pt.tmp{dead}@elsewhere",
        tmp_path / "good" / f".notes.tmp{dead}",
    ]
    legacy = tmp_path / "good" / f".rank0.pt.tmp{dead}"  # as versions before the host suffix named them
    for p in [*keep, legacy]:
        p.write_bytes(b"partial")
    if next_call == "save":
        save_checkpoint(tmp_path, "next", model=model, optimizer=opt, scheduler=sched)
    else:
        load_checkpoint(tmp_path, model=model, optimizer=opt, scheduler=sched)
    assert sorted(p for p in listing(tmp_path) if ".tmp" in p) == sorted(str(p.relative_to(tmp_path)) for p in keep)
    assert not (tmp_path / "killed").exists()  # the tag folder is made only once its shard is on disk


@pytest.mark.parametrize("fresh", [True, False], ids=["new_directory", "existing_directory"])
def test_meta_that_json_cannot_hold_is_refused_before_anything_is_written(tmp_path, fresh: bool) -> None:
    model, opt, sched = saved(tmp_path, *(() if fresh else ("old",)))
    directory = tmp_path / "ckpt" if fresh else tmp_path
    before = listing(tmp_path)
    with pytest.raises(TypeError, match=r"meta\['run'\]\['dtype'\] is a dtype, which JSON cannot hold.*str\(value\)"):
        save_checkpoint(directory, "new", model=model, optimizer=opt, scheduler=sched,
                        meta={"run": {"dtype": torch.float32}})  # fmt: skip
    assert listing(tmp_path) == before


@pytest.mark.parametrize(
    ("value", "what"),
    [(lambda: 0, "function"), (object(), "object")],  # unpicklable; picklable but not weights_only-loadable
    ids=["lambda", "object"],
)
@pytest.mark.parametrize("fresh", [True, False], ids=["new_directory", "existing_directory"])
def test_extra_that_cannot_be_saved_is_refused_before_anything_is_written(tmp_path, value, what, fresh) -> None:
    model, opt, sched = saved(tmp_path, *(() if fresh else ("old",)))
    directory = tmp_path / "ckpt" if fresh else tmp_path
    before = listing(tmp_path)
    with pytest.raises(TypeError, match=rf"extra\['hook'\] \(a {what}\) cannot be saved .*obj.state_dict\(\)"):
        save_checkpoint(directory, "new", model=model, optimizer=opt, scheduler=sched,
                        extra={"step": 3, "hook": value})  # fmt: skip
    assert listing(tmp_path) == before


def test_a_save_failing_midway_leaves_no_new_file_or_folder(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, sched = build()
    before = listing(tmp_path)

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path / "a" / "b", "new", model=model, optimizer=opt, scheduler=sched)
    assert listing(tmp_path) == before


@pytest.fixture
def unwritable(monkeypatch: pytest.MonkeyPatch):
    """Makes a folder unwritable: its permission bits, and where they do not stop this process, refused creations."""
    made: list[Path] = []

    def refuse(path) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))

    def make(folder: Path) -> None:
        folder.chmod(0o555)
        made.append(folder)
        try:
            (folder / "probe").touch()
        except PermissionError:
            return  # the bits stop this process
        (folder / "probe").unlink()  # they do not (root): refuse what the kernel would refuse another user
        real_open, real_mkdir = builtins.open, os.mkdir

        def open_(file, mode="r", *args, **kwargs):
            if isinstance(file, (str, os.PathLike)) and Path(file).parent == folder and set(mode) & set("wax+"):
                refuse(file)
            return real_open(file, mode, *args, **kwargs)

        def mkdir(path, *args, **kwargs) -> None:
            if Path(path).parent == folder:
                refuse(path)
            real_mkdir(path, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", open_)
        monkeypatch.setattr(os, "mkdir", mkdir)

    yield make
    for folder in made:
        folder.chmod(0o755)


@pytest.mark.parametrize("fresh", [True, False], ids=["new_directory", "existing_directory"])
def test_an_unwritable_directory_is_named_with_the_fix(tmp_path, unwritable, fresh: bool) -> None:
    model, opt, sched = saved(tmp_path / "ckpt", "old")
    directory = tmp_path / "ckpt" / "sub" if fresh else tmp_path / "ckpt"
    before = listing(tmp_path)
    unwritable(tmp_path / "ckpt")
    with pytest.raises(PermissionError) as caught:
        save_checkpoint(directory, "new", model=model, optimizer=opt, scheduler=sched)
    message = str(caught.value)
    if fresh:
        assert f"cannot create the checkpoint directory {str(directory)!r}: {str(tmp_path / 'ckpt')!r}" in message
    else:
        assert f"the checkpoint directory {str(directory)!r} is not writable" in message
    assert f"{str(tmp_path / 'ckpt')!r} is not writable (" in message
    assert f"chmod u+rwx {str(tmp_path / 'ckpt')!r}) or pass a directory you can write to" in message
    assert ".tmp" not in message and "rank0.pt" not in message  # the user's directory, not a temporary
    assert listing(tmp_path) == before
    load_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt, scheduler=sched)


def plain(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model and torch's AdamW after one step (so with state), seeded."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    return model, opt


# Each job forks a child that saves and is SIGKILLed just before or after its k-th rename (1: the shard into the
# tag folder, 2: meta.json, 3: latest); the driver imports torch once for all of them.
KILL_DRIVER = """
import json, os, signal, sys, torch
torch.set_num_threads(1)  # no thread pool to inherit: the saves run in forked children
from tests.test_checkpoint_errors import plain
from twinflow.checkpoint import save_checkpoint
for directory, tag, k, when in json.loads(sys.argv[1]):
    model, opt = plain(2)
    pid = os.fork()
    if pid == 0:
        real_replace, renames = os.replace, []
        def replace(src, dst):
            renames.append(dst)
            if len(renames) == k and when == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            real_replace(src, dst)
            if len(renames) == k and when == "after":
                os.kill(os.getpid(), signal.SIGKILL)
        os.replace = replace
        try:
            save_checkpoint(directory, tag, model=model, optimizer=opt)
        finally:
            os._exit(3)  # not killed: the save made fewer renames than k
    _, status = os.waitpid(pid, 0)  # reaped: no process has this pid now
    print(pid, os.WTERMSIG(status) if os.WIFSIGNALED(status) else -1, flush=True)
"""
# (tag, k, when, what the kill left, what the next save or load removes and says so)
KILL_POINTS = [
    ("c", 1, "before", "shard temporary", ".c.rank0.pt.tmp"),
    ("c", 1, "after", "partial tag", "incomplete checkpoint 'c' (rank0.pt, "),
    ("c", 2, "before", "partial tag", "incomplete checkpoint 'c' (rank0.pt, "),
    ("c", 2, "after", "complete tag", None),
    ("c", 3, "before", "complete tag", ".latest.tmp"),
    ("c", 3, "after", "complete tag", None),
    ("b", 1, "after", "partial tag", "incomplete checkpoint 'b' (rank0.pt, "),  # 'b' saved again: it was latest
]


@pytest.fixture(scope="module")
def killed_saves(tmp_path_factory) -> tuple[dict[tuple, Path], dict[str, dict]]:
    """Per kill point, a directory with checkpoints 'a' and 'b' (latest) and what the killed save left."""
    root = tmp_path_factory.mktemp("killed")
    jobs, folders, weights = [], {}, {}
    for point in KILL_POINTS:
        tag, k, when = point[:3]
        directory = root / f"{tag}{k}{when}"
        for name, seed in (("a", 0), ("b", 1)):
            model, opt = plain(seed)
            save_checkpoint(directory, name, model=model, optimizer=opt)
            weights[name] = {key: value.clone() for key, value in model.state_dict().items()}
        jobs.append([str(directory), tag, k, when])
        folders[point] = directory
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run([sys.executable, "-c", KILL_DRIVER, json.dumps(jobs)], env=env, capture_output=True,
                           text=True, cwd=REPO)  # fmt: skip
    assert child.returncode == 0, child.stderr
    assert [line.split()[1] for line in child.stdout.splitlines()] == [str(int(signal.SIGKILL))] * len(jobs)
    return folders, weights


def loads(directory: Path, tag: str | None, weights: dict | None = None) -> str:
    model, opt = plain(7)
    _, meta = load_checkpoint(directory, tag, model=model, optimizer=opt)
    if weights is not None:
        assert all(torch.equal(value, weights[key]) for key, value in model.state_dict().items())
    return meta["tag"]


@pytest.mark.parametrize("next_call", ["load", "save"])
@pytest.mark.parametrize("point", KILL_POINTS, ids=lambda p: f"{p[0]}_rename{p[1]}_{p[2]}")
def test_a_killed_save_keeps_the_old_checkpoints_and_the_next_call_removes_what_it_left(
    killed_saves, tmp_path, caplog, point, next_call: str
) -> None:
    folders, weights = killed_saves
    tag, _, _, left, removed = point
    directory = tmp_path / "ckpt"
    shutil.copytree(folders[point], directory)
    hidden = [p for p in listing(directory) if Path(p).name.startswith(".")]
    if left == "shard temporary":
        assert any(p.startswith(f".{tag}.rank0.pt.tmp") for p in hidden) and not (directory / tag / "rank0.pt").exists()
    else:  # the tag folder, with its shard; meta.json only once complete
        assert (directory / tag / "rank0.pt").is_file()
        assert (directory / tag / "meta.json").is_file() == (left == "complete tag")
    caplog.set_level(logging.INFO, logger="twinflow.notice")
    if next_call == "save":
        model, opt = plain(3)
        save_checkpoint(directory, "d", model=model, optimizer=opt)
        assert loads(directory, None, {k: v.clone() for k, v in model.state_dict().items()}) == "d"  # (c)
    elif tag == "b":  # latest names the tag whose re-save was killed: refused, naming the one that is left
        with pytest.raises(CheckpointError, match=r"latest names 'b', but there is no checkpoint 'b'.*tag='a'"):
            loads(directory, None)
    else:
        assert loads(directory, None) == ("c" if point[1:3] == (3, "after") else "b")
    lines = [r.getMessage() for r in caplog.records if r.name == "twinflow.notice" and "removed" in r.getMessage()]
    if removed is None:
        assert lines == []
    else:
        assert len(lines) == 1 and removed in lines[0] and str(directory) in lines[0]
    # (b) no temporary, marker or partial tag is left; (a) the old checkpoints load, and a complete new one
    assert not [p for p in listing(directory) if Path(p).name.startswith(".")]
    tags = sorted(p.name for p in directory.iterdir() if p.is_dir())
    assert all((directory / t / "meta.json").is_file() for t in tags)
    expected = {"a", "b", tag} if left == "complete tag" else {"a", "b"} - {tag}
    assert tags == sorted(expected | ({"d"} if next_call == "save" else set()))
    loads(directory, "a", weights["a"])
    if tag != "b":
        loads(directory, "b", weights["b"])
    if "c" in tags:
        loads(directory, "c")
