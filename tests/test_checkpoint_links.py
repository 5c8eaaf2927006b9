"""No link is followed and nothing outside a run is deleted, on the memory tier as on the durable tier (#35).

A link may stand at every level: `checkpoint.memory_dir` itself (the user's choice: followed, if it is
the user's own), the run's folder under it (a predictable name in a world-writable /dev/shm: refused),
a step folder and a payload or piece file (never written through; deleting removes the link only). The
durable tier's retention and clearing likewise. Each test puts something outside the run that a
followed link would change, and checks that it did not change.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import REPO, clean_env, run_cli, tiny

from trainer.checkpoint import CheckpointStore
from trainer.checkpoint.memory import INDEX, OWNER, MemoryTier, make_root, memory_root, scan
from trainer.elastic import DistEnv


def _tree(folder: Path) -> dict[str, bytes | str]:
    """Every entry under `folder` (links not followed) with its content or link target."""
    out: dict[str, bytes | str] = {}
    for dirpath, dirs, files in os.walk(folder):
        for name in dirs + files:
            p = Path(dirpath) / name
            out[str(p.relative_to(folder))] = (
                f"-> {os.readlink(p)}" if p.is_symlink() else (p.read_bytes() if p.is_file() else "dir")
            )
    return out


def _outside(tmp_path: Path) -> Path:
    """A folder outside every run that looks like a memory folder: step folders with payloads."""
    out = tmp_path / "outside"
    for step in (1, 2):
        d = out / f"step-{step:09d}"
        d.mkdir(parents=True)
        (d / "w.safetensors").write_bytes(b"not yours")
        (d / "piece-r00000.json").write_text("{}")
    return out


def _tier(root: str) -> MemoryTier:
    return MemoryTier(root, DistEnv(), sharded=False, timeout_seconds=30, origin="/x/run/checkpoints")


def _snapshot(tier: MemoryTier, step: int) -> None:
    tier.write(step, {"w.safetensors": {"w": torch.full((4,), float(step))}}, {OWNER: 0, INDEX: None, "task": "t"})


# ------------------------------------------------------------------ the memory tier


@pytest.mark.slow
def test_a_run_folder_that_is_a_link_is_refused_and_a_fresh_start_clears_nothing_it_points_to(tmp_path):
    # #35: <memory_dir>/<run key> a link (anyone can make it in /dev/shm): `resume=false` cleared, and
    # retention pruned, the step folders it points to, and snapshots were written there.
    outside = _outside(tmp_path)
    before = _tree(outside)
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    mem = Path(memory_root(str(shm), f"{tmp_path}/run/checkpoints"))
    mem.symlink_to(outside)
    args = tiny(
        tmp_path, "checkpoint.memory=true", f"checkpoint.memory_dir={shm}", "checkpoint.resume=false", max_steps=4
    )
    r = run_cli("train", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert "is a symbolic link; it is never followed" in r.stderr, r.stderr[-3000:]
    assert "continuing with the durable tier only" in r.stderr
    assert _tree(outside) == before, "the memory tier changed what its run folder's link points to"
    assert mem.is_symlink()
    assert CheckpointStore(f"{tmp_path}/run/checkpoints").latest_valid().step == 4


def test_make_root_refuses_a_link_a_file_and_a_folder_others_may_swap(tmp_path):
    outside = _outside(tmp_path)
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    link = shm / "run-0123"
    link.symlink_to(outside)
    with pytest.raises(OSError, match="is a symbolic link; it is never followed"):
        make_root(str(link))
    (shm / "file").write_text("x")
    with pytest.raises(OSError, match="is not a directory"):
        make_root(str(shm / "file"))
    # A memory_dir that others may write in without the sticky bit: they could rename the run's folder.
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(OSError, match="writable by others without the sticky bit"):
        make_root(str(open_dir / "run-0123"))
    open_dir.chmod(0o1777)  # as /dev/shm: others can add entries, not touch ours
    make_root(str(open_dir / "run-0123"))
    assert (open_dir / "run-0123").stat().st_mode & 0o777 == 0o700
    assert sorted(os.listdir(outside)) == ["step-000000001", "step-000000002"]


def test_a_memory_dir_that_is_the_users_own_link_is_followed(tmp_path):
    real = tmp_path / "real-shm"
    real.mkdir(mode=0o700)
    (tmp_path / "shm").symlink_to(real)
    root = memory_root(str(tmp_path / "shm"), "/x/run/checkpoints")
    tier = _tier(root)
    _snapshot(tier, 1)
    assert sorted(scan(root)) == [1]
    assert (real / os.path.basename(root) / "step-000000001" / "piece-r00000.json").is_file()


def test_no_snapshot_writes_through_a_step_folder_or_payload_that_is_a_link_and_deletes_remove_links_only(tmp_path):
    outside = _outside(tmp_path)
    before = _tree(outside)
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    root = memory_root(str(shm), "/x/run/checkpoints")
    tier = _tier(root)
    mem = Path(root)
    # A step folder that is a link: that snapshot fails, nothing is written or removed through it.
    (mem / "step-000000001").symlink_to(outside / "step-000000001")
    with pytest.raises(Exception, match="symbolic link"):
        _snapshot(tier, 1)
    # A payload file and a piece file that are links, in a real step folder: replaced, their targets kept.
    d = mem / "step-000000002"
    d.mkdir()
    (d / "w.safetensors").symlink_to(outside / "step-000000002" / "w.safetensors")
    (d / "piece-r00000.json").symlink_to(outside / "step-000000002" / "piece-r00000.json")
    _snapshot(tier, 2)
    assert not (d / "w.safetensors").is_symlink() and not (d / "piece-r00000.json").is_symlink()
    assert sorted(scan(root)) == [2]
    # A piece file that is a link is never read as a piece.
    d3 = mem / "step-000000003"
    d3.mkdir()
    (d3 / "piece-r00000.json").symlink_to(d / "piece-r00000.json")
    assert sorted(scan(root)) == [2]
    # Retention and clearing: step folders go, links go, nothing they point to.
    for step in (4, 5, 6):
        _snapshot(tier, step)
    assert sorted(scan(root)) == [5, 6]
    tier.clear()
    assert not any(mem.glob("step-*"))
    assert _tree(outside) == before, "the memory tier changed something outside its run folder"


@pytest.mark.slow
def test_a_failed_snapshot_leaves_no_empty_step_folder(tmp_path):
    # #35: a full /dev/shm left an empty step folder per failed snapshot. RLIMIT_FSIZE makes the kernel refuse
    # writes past 64 KiB, as a full disk would (EFBIG instead of ENOSPC).
    shm = tmp_path / "shm"
    script = textwrap.dedent(
        f"""
        import resource, signal, torch
        from trainer.checkpoint.memory import INDEX, OWNER, MemoryTier, memory_root
        from trainer.elastic import DistEnv
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        tier = MemoryTier(memory_root({str(shm)!r}, "/x/run/checkpoints"), DistEnv(), False, 30, "/x/run/checkpoints")
        meta = {{OWNER: 0, INDEX: None, "task": "t"}}
        tier.write(1, {{"w.safetensors": {{"w": torch.zeros(16)}}}}, meta)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
        for step in (2, 3, 4):
            try:
                tier.write(step, {{"a.safetensors": {{"w": torch.zeros(1 << 16)}}, "b.json": b"{{}}"}}, meta)
            except Exception as e:
                print("refused", type(e).__name__)
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, env=clean_env(), timeout=300
    )
    assert r.stdout.count("refused CheckpointError") == 3, r.stdout + r.stderr[-3000:]
    mem = Path(memory_root(str(shm), "/x/run/checkpoints"))
    assert sorted(p.name for p in mem.glob("step-*")) == ["step-000000001"]


# ------------------------------------------------------------------ the durable tier (local disk)


def test_durable_retention_and_clearing_remove_links_in_a_step_dir_never_their_targets(tmp_path):
    outside = _outside(tmp_path)
    before = _tree(outside)
    root = tmp_path / "root"
    store = CheckpointStore(str(root), keep=1)
    store.write(1, {"w.safetensors": {"w": torch.zeros(4)}}, {})
    # Links inside a committed step dir (a payload's neighbour, the manifest's name for an invalid one):
    d1 = root / "step-000000001"
    (d1 / "extra").symlink_to(outside / "step-000000001" / "w.safetensors")
    d3 = root / "step-000000003"  # an invalid step whose manifest and payload are links
    d3.mkdir()
    (d3 / "manifest.json").symlink_to(outside / "step-000000002" / "piece-r00000.json")
    (d3 / "w.safetensors").symlink_to(outside / "step-000000002" / "w.safetensors")
    store.write(2, {"w.safetensors": {"w": torch.ones(4)}}, {})  # keep=1: step 1 is pruned
    store.write(3, {"w.safetensors": {"w": torch.ones(4)}}, {})  # the invalid step 3 is cleared, then saved
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "step-000000003"]
    assert store.check(3).valid and not (d3 / "w.safetensors").is_symlink()
    assert _tree(outside) == before, "the durable tier changed something outside its root"


def test_durable_writes_never_open_a_payload_through_a_link(tmp_path):
    outside = _outside(tmp_path)
    before = _tree(outside)
    store = CheckpointStore(str(tmp_path / "root"))
    d = tmp_path / "root" / "step-000000005"
    d.mkdir(parents=True)
    (d / "w.safetensors").symlink_to(outside / "step-000000001" / "w.safetensors")
    # What a sharded save's other ranks do: write into the step dir rank 0 cleared (here, a link planted after).
    with pytest.raises(OSError):
        store.write_files(5, {"w.safetensors": {"w": torch.zeros(4)}})
    assert _tree(outside) == before
