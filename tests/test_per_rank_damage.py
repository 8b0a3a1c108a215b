"""A damaged per-rank checkpoint (twinflow 0.1.0's format, tests/per_rank_fixture.py) is refused by ``--to-portable``
(twinflow.checkpoint.to_portable), naming the file and what is wrong with it, and nothing is written: neither in
OUT_DIR (absent, or as an earlier conversion left it) nor in the source. And the messages of
checkpoint_files.read_meta where the directory given is not a per-rank checkpoint directory, or names no tag there."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.per_rank_fixture import NAME, two_ranks
from twinflow.checkpoint import CheckpointError, to_portable
from twinflow.checkpoint.checkpoint_files import read_meta
from twinflow.checkpoint.compact_checkpoint import MAGIC
from twinflow.checkpoint.convert_cli import main as convert_main

WRITTEN = Path(__file__).with_name("data") / NAME
TWO_RANKS = two_ranks(3, "fp32")  # its tag is "moved"
SHARD_KINDS = {"int8_m24": MAGIC, "fp32": b"PK"}  # a compact shard; a torch.save one (a zip file)


@pytest.fixture
def copy(tmp_path: Path) -> Callable[[str], Path]:
    """``copy(name)``: the per-rank checkpoint directory of fixture `name`, copied into tmp_path (damaged there)."""

    def made(name: str) -> Path:
        return Path(shutil.copytree(WRITTEN / name / "ckpt", tmp_path / name / "ckpt"))

    return made


@pytest.fixture(params=["new", "existing"])
def out(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """OUT_DIR: folders not there yet, or a checkpoint directory holding an earlier conversion (tag "before")."""
    if request.param == "new":
        return tmp_path / "new" / "deeper"
    intact = Path(shutil.copytree(WRITTEN / "fp32" / "ckpt", tmp_path / "intact"))
    to_portable.to_portable(intact, "a", tmp_path / "out", "before")
    assert (tmp_path / "out" / "latest").read_text() == "before"
    return tmp_path / "out"


def contents(root: Path) -> dict[str, str | None]:
    """Every file (its sha256) and folder (None) under `root`, by its path relative to it."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
            for p in root.rglob("*")}  # fmt: skip


def refused(ckpt: Path, tag: str, out_dir: Path, match: str) -> str:
    """Converts `tag` of `ckpt` to `out_dir`: refused with a CheckpointError matching `match`, and nothing in the
    temporary folder holding both (the source, OUT_DIR) changed. Returns the message."""
    root = ckpt.parent.parent
    before = contents(root)
    with pytest.raises(CheckpointError, match=match) as caught:
        to_portable.to_portable(ckpt, tag, out_dir)
    assert contents(root) == before  # no OUT_DIR made, no ".saving" left, the source only read
    return str(caught.value)


def rewrite_meta(folder: Path, change: Callable[[dict[str, Any]], object]) -> None:
    info = json.loads((folder / "meta.json").read_text())
    change(info)
    (folder / "meta.json").write_text(json.dumps(info))


def record_as_it_is(shard: Path) -> None:
    """meta.json records `shard`'s size and sha256 as they are now: only its structure tells it is damaged."""
    data = shard.read_bytes()
    entry = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    rewrite_meta(shard.parent, lambda info: info["shards"][shard.name].update(entry))


# ------------------------------------------------------------- a shard's size, hash and structure


def test_a_truncated_compact_shard_is_refused_by_its_recorded_size(copy, out: Path) -> None:
    ckpt = copy("int8_m24")
    shard = ckpt / "a" / "rank0.pt"
    data = shard.read_bytes()
    assert data.startswith(MAGIC)
    shard.write_bytes(data[: len(data) * 2 // 3])
    n = len(data) * 2 // 3
    refused(ckpt, "a", out, rf"shard {re.escape(str(shard))} is {n} bytes, its meta.json records {len(data)}: the "
                            "shard is truncated or corrupt")  # fmt: skip


def test_a_truncated_compact_shard_whose_size_is_recorded_is_refused_by_its_structure(copy, out: Path) -> None:
    """The size and hash checks pass: the frame that runs past the shard's end is found before it is read."""
    ckpt = copy("int8_m24")
    shard = ckpt / "a" / "rank0.pt"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) * 2 // 3])
    record_as_it_is(shard)
    message = refused(ckpt, "a", out, r"the frame at byte \d+ runs \d+ bytes past the end")
    assert f"shard {shard}:" in message and "damaged or was not written by twinflow" in message


def test_a_damaged_frame_length_is_refused_by_its_guard(copy, out: Path) -> None:
    """The head's length is stored with its complement: a bit flipped in either is caught before the length is
    used (meta.json made to match the damaged shard, the size as it was)."""
    ckpt = copy("int8_m24")
    shard = ckpt / "a" / "rank0.pt"
    data = bytearray(shard.read_bytes())
    data[len(MAGIC) + 8] ^= 1  # the complement of the head frame's length
    shard.write_bytes(bytes(data))
    record_as_it_is(shard)
    message = refused(ckpt, "a", out, f"the frame length at byte {len(MAGIC)} is damaged")
    assert f"shard {shard}:" in message and "damaged or was not written by twinflow" in message


@pytest.mark.parametrize("damage", ["truncated", "damaged_byte"])
def test_a_torch_save_shard_whose_size_and_hash_are_recorded_is_refused_naming_it(copy, out: Path, damage: str) -> None:
    """As a compact shard's structure is checked: a shard damaged before its meta.json was written."""
    ckpt = copy("fp32")
    shard = ckpt / "a" / "rank0.pt"
    data = bytearray(shard.read_bytes())
    if damage == "truncated":
        del data[len(data) * 2 // 3 :]
    else:
        data[400] ^= 0xFF
    shard.write_bytes(bytes(data))
    record_as_it_is(shard)
    message = refused(ckpt, "a", out, re.escape(str(shard)))
    if damage == "truncated":
        assert "cannot be memory-mapped" in message and "truncated or damaged" in message, message
    else:
        assert "cannot be read with torch.load" in message and "damaged or was not written by" in message, message


def held(path: Path) -> list[str]:
    """What of this process holds `path`: file descriptors open on it, memory mappings of it (Linux's /proc)."""
    real = os.path.realpath(path)
    fds = [f"fd {fd.name}" for fd in Path("/proc/self/fd").iterdir() if os.path.realpath(fd) == real]
    maps = [line for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(" " + real)]
    return fds + maps


LINUX_PROC = pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads Linux's /proc")


@LINUX_PROC
@pytest.mark.parametrize("kind", SHARD_KINDS)
def test_a_refused_shard_is_closed_while_the_error_is_still_held(copy, tmp_path: Path, kind: str) -> None:
    """The shard opened for its checks is closed when they refuse it, not when the traceback (holding the
    half-made reader) is let go: a caller that keeps the error, or a notebook showing it, holds no file open."""
    ckpt = copy(kind)
    shard = ckpt / "a" / "rank0.pt"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="has sha256") as caught:
        to_portable.to_portable(ckpt, "a", tmp_path / "out")
    assert caught.traceback and not held(shard)


@LINUX_PROC
def test_a_shard_refused_after_it_was_mapped_is_let_go(copy, tmp_path: Path) -> None:
    """A torch.save shard whose size and hash are right but which holds no model: refused once mapped, and let go
    at once, mapping and file."""
    ckpt = copy("fp32")
    shard = ckpt / "a" / "rank0.pt"
    torch.save({"optimizer": {}, "model": [torch.zeros(4096)]}, shard)  # a tensor, mapped; a list, no model
    record_as_it_is(shard)
    with pytest.raises(CheckpointError, match="holds no model state dict") as caught:
        to_portable.to_portable(ckpt, "a", tmp_path / "out")
    assert caught.traceback and not held(shard)


@LINUX_PROC
def test_the_ranks_read_before_a_refused_one_are_let_go(copy, tmp_path: Path) -> None:
    """Rank 1's shard refused: rank 0's, already verified and mapped, is closed and unmapped while the error is
    still held."""
    ckpt = Path(shutil.copytree(WRITTEN / "two_ranks_1_fp32" / "ckpt", tmp_path / "two" / "ckpt"))
    first, second = ckpt / "moved" / "rank0.pt", ckpt / "moved" / "rank1.pt"
    data = bytearray(second.read_bytes())
    data[100] ^= 1
    second.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"shard {re.escape(str(second))} has sha256") as caught:
        to_portable.to_portable(ckpt, "moved", tmp_path / "out")
    assert caught.traceback and not held(first) and not held(second)


@pytest.mark.parametrize("kind", SHARD_KINDS)
def test_a_size_mismatch_says_both_sizes(copy, out: Path, kind: str) -> None:
    ckpt = copy(kind)
    shard = ckpt / "a" / "rank0.pt"
    data = shard.read_bytes()
    assert data.startswith(SHARD_KINDS[kind])
    shard.write_bytes(data + b"x")
    n = len(data)
    refused(ckpt, "a", out, rf"shard {re.escape(str(shard))} is {n + 1} bytes, its meta.json records {n}: .*"
                            "truncated or corrupt")  # fmt: skip


@pytest.mark.parametrize("kind", SHARD_KINDS)
def test_a_hash_mismatch_says_both_hashes(copy, out: Path, kind: str) -> None:
    ckpt = copy(kind)
    shard = ckpt / "a" / "rank0.pt"
    recorded = json.loads((ckpt / "a" / "meta.json").read_text())["shards"]["rank0.pt"]["sha256"]
    data = bytearray(shard.read_bytes())
    assert data.startswith(SHARD_KINDS[kind])
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    found = hashlib.sha256(data).hexdigest()
    message = refused(ckpt, "a", out, f"shard {re.escape(str(shard))} has sha256 {found}, its meta.json records "
                                      f"{recorded}")  # fmt: skip
    assert f"(the size, {len(data)} bytes, matches)" in message and "corrupt or was replaced" in message


# ------------------------------------------------------------- meta.json, and a rank's shard


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
def test_a_bad_meta_json_names_the_file_and_key(copy, out: Path, damage, message: str) -> None:
    ckpt = copy("int8_m24")
    rewrite_meta(ckpt / "a", damage)
    found = refused(ckpt, "a", out, message)
    assert str(ckpt / "a" / "meta.json") in found and "damaged or was not written by" in found


def test_a_meta_json_that_is_not_json_names_the_file(copy, out: Path) -> None:
    ckpt = copy("int8_m24")
    (ckpt / "a" / "meta.json").write_text('{"world_size": 1,')
    refused(ckpt, "a", out, f"{re.escape(str(ckpt / 'a' / 'meta.json'))} is not valid JSON")


@pytest.mark.parametrize("how", ["file_gone", "not_listed"])
def test_a_missing_shard_of_two_ranks_is_named(copy, out: Path, how: str) -> None:
    ckpt = copy(TWO_RANKS)
    assert (ckpt / "latest").read_text() == "moved" and (ckpt / "moved" / "rank1.pt").is_file()
    if how == "file_gone":
        (ckpt / "moved" / "rank1.pt").unlink()
        match = rf"shard {re.escape(str(ckpt / 'moved' / 'rank1.pt'))} is missing \(meta.json records it\)"
    else:
        rewrite_meta(ckpt / "moved", lambda info: info["shards"].pop("rank1.pt"))
        match = r"has no shard rank1.pt, which a save by 2 ranks writes; its meta.json lists \['rank0.pt'\]"
    refused(ckpt, "moved", out, match)


def test_the_command_line_prints_the_refusal_naming_the_shard(copy, tmp_path: Path, capsys) -> None:
    ckpt = copy("fp32")
    shard = ckpt / "a" / "rank0.pt"
    shard.write_bytes(shard.read_bytes()[:-1])
    assert convert_main([str(ckpt), "latest", "--to-portable", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"shard {shard} is" in err and "truncated or corrupt" in err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------- where the checkpoint is: read_meta


def test_a_tag_folder_is_named_with_its_parent_and_tag(copy) -> None:
    ckpt = copy("int8_m24")
    with pytest.raises(CheckpointError, match="is a checkpoint tag folder; pass its parent") as info:
        read_meta(ckpt / "a")
    assert repr(str(ckpt)) in str(info.value) and "tag='a'" in str(info.value)


@pytest.mark.parametrize(("name", "kind"), [("rank0.pt", "shard"), ("meta.json", "metadata")])
def test_a_shard_file_is_named_with_the_directory_and_tag(copy, name: str, kind: str) -> None:
    ckpt = copy("int8_m24")
    with pytest.raises(CheckpointError, match=f"is a {kind} file of checkpoint 'a'; pass the checkpoint directory"):
        read_meta(ckpt / "a" / name)
    with pytest.raises(CheckpointError) as info:
        read_meta(ckpt / "a" / name)
    assert f"directory {str(ckpt)!r} and tag='a'" in str(info.value)


def saved_at(ckpt: Path, *tags: str) -> None:
    """The tags' meta.json written one second after another, in the order given (the hint lists them oldest first)."""
    for n, tag in enumerate(tags):
        os.utime(ckpt / tag / "meta.json", (1_700_000_000 + n, 1_700_000_000 + n))


def test_without_latest_the_tags_there_are_listed(tmp_path: Path) -> None:
    runs = Path(shutil.copytree(WRITTEN / "runs" / "exp1", tmp_path / "exp1"))  # tags step1 and step2
    (runs / "latest").unlink()
    saved_at(runs, "step2", "step1")  # by when they were saved, not by name
    with pytest.raises(CheckpointError, match=r"no 'latest' file.*\['step2', 'step1'\]; pass one as tag=, e.g. "
                                              r"tag='step1'"):  # fmt: skip
        read_meta(runs)
    tag, info = read_meta(runs, "step1")  # the fix works
    assert tag == "step1" and info["world_size"] == 1 and list(info["shards"]) == ["rank0.pt"]


def test_a_missing_tag_lists_the_tags_there(tmp_path: Path) -> None:
    runs = Path(shutil.copytree(WRITTEN / "runs" / "exp1", tmp_path / "exp1"))
    saved_at(runs, "step1", "step2")
    with pytest.raises(CheckpointError, match=r"no checkpoint 'x' in .*\['step1', 'step2'\]; pass one as tag="):
        read_meta(runs, "x")
    (runs / "latest").write_text("gone")
    with pytest.raises(CheckpointError, match=r"latest names 'gone', but there is no checkpoint 'gone' in .*tag="):
        read_meta(runs)
