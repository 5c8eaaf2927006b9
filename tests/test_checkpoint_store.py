"""CheckpointStore on local disk, memory://, S3 (moto server) and GCS (fake-gcs-server): commit, discovery, faults, retention."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import wait_until
from safetensors.torch import load as st_load

from trainer.checkpoint import (
    CheckpointCorrupt,
    CheckpointStore,
    join_tensors,
    split_tensors,
    write_safetensors,
)
from trainer.checkpoint.validity import InputRecord


def payload(step: int) -> dict:
    return {
        "weights.safetensors": {"w": torch.full((64, 64), float(step)), "b": torch.arange(5)},
        "state.json": json.dumps({"step": step}).encode(),
    }


def write(store: CheckpointStore, step: int):
    return store.write(step, payload(step), {"world_size": 1})


# ---------------------------------------------------------------- format


def test_streamed_safetensors_load_with_the_safetensors_library():
    import io

    tensors = {
        "f32": torch.randn(3, 4),
        "bf16": torch.randn(7).to(torch.bfloat16),
        "f16": torch.randn(2, 2).half(),
        "i64": torch.arange(10),
        "u8": torch.randint(0, 255, (9,), dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(4, 6)[:, ::2],
    }
    buf = io.BytesIO()
    n = write_safetensors(buf, tensors, lambda b: None)
    assert n == len(buf.getvalue())
    back = st_load(buf.getvalue())
    assert back.keys() == tensors.keys()
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k


def test_optimizer_state_round_trips_through_tensors_and_json():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    tensors, skeleton = split_tensors(opt.state_dict())
    skeleton = json.loads(json.dumps(skeleton))
    restored = join_tensors(skeleton, tensors)
    opt2 = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=0.5)
    opt2.load_state_dict(restored)
    assert opt2.state_dict()["param_groups"][0]["lr"] == 0.1
    for k in (0, 1):
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt2.state_dict()["state"][k][name], opt.state_dict()["state"][k][name])


# ---------------------------------------------------------------- every store


def test_commit_then_discover_newest(store_url):
    url, so = store_url
    store = CheckpointStore(url, so, keep=5)
    assert store.latest_valid() is None
    write(store, 100)
    res = write(store, 200)
    assert res.info.valid and res.total_bytes > 64 * 64 * 4
    assert store.latest_hint() == 200
    latest = store.latest_valid()
    assert latest.step == 200
    assert store.read_tensors(latest, "weights.safetensors")["w"][0, 0] == 200.0
    m = latest.manifest
    assert m.format_version == 2 and m.step == 200 and m.world_size == 1 and m.time_utc
    assert set(m.files) == {"weights.safetensors", "state.json"}
    assert m.digest == "blake3" and all(len(e.blake3) == 64 for e in m.files.values())


def test_a_manifest_is_written_from_its_model_as_the_json_it_always_was_and_a_bad_one_is_never_committed(tmp_path):
    """The store builds the Manifest and dumps it (issue 51): the keys in the order the run gave them, nothing
    added; a record that is not a manifest is refused before the commit (CheckpointCorrupt naming the field)."""
    store = CheckpointStore(str(tmp_path / "root"))
    frozen = {"ae": {"url": "/ae/step-000000003", "step": 3, "file": "g.ema.safetensors", "digest": "blake3:0"}}
    # The inputs of each kind, made as their readers make them and dumped as the engine does: their keys in the
    # order the tasks always wrote them (a folder's digest before its files, a pipeline's after), pin last.
    files = {"model_index.json": {"blake3": "0" * 64, "bytes": 3}}
    records = {
        "pipeline": InputRecord(url="/sd", family="sd", files=files, digest="blake3:1").pinned(),
        "unet.pretrained": InputRecord(url="/sd/unet", digest="blake3:2", files=["config.json"]).pinned(),
        "text_encoder": InputRecord(source="/sd/clip", digest="blake3:3", pin=True),
    }
    inputs = {name: record.dump() for name, record in records.items()}
    assert [list(r) for r in inputs.values()] == [
        ["url", "family", "files", "digest", "pin"],
        ["url", "digest", "files", "pin"],
        ["source", "digest", "pin"],
    ]
    meta = {"world_size": 1, "parallel": "ddp", "config": {"seed": 7}, "frozen": frozen, "inputs": inputs}
    meta["run"] = "ab" * 4
    info = store.write(1, payload(1), meta).info
    raw = (tmp_path / "root" / "step-000000001" / "manifest.json").read_bytes()
    doc = json.loads(raw)
    assert raw == json.dumps(doc, indent=1).encode()
    assert list(doc) == ["format_version", "step", "time_utc", "digest", *meta, "files"]
    assert {k: doc[k] for k in meta} == meta and info.manifest.frozen["ae"].digest == "blake3:0"
    assert [list(r) for r in doc["inputs"].values()] == [list(r) for r in inputs.values()]
    pinned = info.manifest.inputs["pipeline"].files
    assert {rel: f.model_dump() for rel, f in pinned.items()} == files and info.manifest.inputs["text_encoder"].pin
    assert {name: r.dump() for name, r in info.manifest.inputs.items()} == inputs  # read back, written again
    with pytest.raises(CheckpointCorrupt, match="world_size"):
        store.write(2, payload(2), {"world_size": 0})
    assert store.steps() == [1] or not (tmp_path / "root" / "step-000000002" / "manifest.json").exists()


def test_truncated_payload_is_skipped_for_the_previous_checkpoint(store_url):
    url, so = store_url
    store = CheckpointStore(url, so, keep=5)
    write(store, 1)
    write(store, 2)
    path = f"{store.root}/step-000000002/weights.safetensors"
    store.fs.pipe_file(path, store.fs.cat_file(path)[:100])
    info = store.check(2)
    assert not info.valid and "weights.safetensors has 100 bytes" in info.reason
    assert store.latest_valid().step == 1


def test_missing_manifest_means_no_checkpoint(store_url):
    url, so = store_url
    store = CheckpointStore(url, so, keep=5)
    write(store, 1)
    write(store, 2)
    store.fs.rm_file(f"{store.root}/step-000000002/manifest.json")
    assert "no manifest.json" in store.check(2).reason
    assert store.latest_valid().step == 1


def test_wrong_digest_is_caught_on_read_and_by_verify(store_url):
    url, so = store_url
    store = CheckpointStore(url, so, keep=5)
    write(store, 1)
    path = f"{store.root}/step-000000001/weights.safetensors"
    data = bytearray(store.fs.cat_file(path))
    data[-1] ^= 0xFF  # same size, different content
    store.fs.pipe_file(path, bytes(data))
    info = store.latest_valid()  # sizes match: looks committed
    with pytest.raises(CheckpointCorrupt, match="blake3"):
        store.read_tensors(info, "weights.safetensors")
    problems = store.verify(info)
    assert len(problems) == 1 and "weights.safetensors" in problems[0]


def test_stale_or_broken_latest_hint_falls_back_to_listing(store_url):
    url, so = store_url
    store = CheckpointStore(url, so, keep=5)
    write(store, 1)
    write(store, 2)
    store.fs.pipe_file(f"{store.root}/LATEST", b"step-000000001")  # crash before LATEST update
    assert store.latest_valid().step == 2
    store.fs.pipe_file(f"{store.root}/LATEST", b"step-000000099")  # points at nothing
    assert store.latest_valid().step == 2
    store.fs.pipe_file(f"{store.root}/LATEST", b"\xff\xfe garbage")
    assert store.latest_valid().step == 2
    store.fs.rm_file(f"{store.root}/LATEST")
    assert store.latest_valid().step == 2


def test_retention_keeps_newest_and_milestones_and_removes_debris(store_url):
    url, so = store_url
    store = CheckpointStore(url, so, keep=2, keep_every_steps=20)
    for step in (10, 20, 30):
        write(store, step)
    # An interrupted save: payload without manifest, older than what comes next.
    store.fs.makedirs(f"{store.root}/step-000000035", exist_ok=True)
    store.fs.pipe_file(f"{store.root}/step-000000035/weights.safetensors", b"partial")
    for step in (40, 50):
        res = write(store, step)
    assert 35 in res.deleted or 35 not in store.steps()
    assert store.steps() == [20, 40, 50]  # 2 newest + milestones 20 and 40
    assert [i.step for i in store.list() if i.valid] == [20, 40, 50]


def test_background_pruning_deletes_after_the_commit_returns_and_before_the_next_commit(store_url):
    url, so = store_url
    store = CheckpointStore(url, so, keep=1)
    store.prune_in_background = True  # as training runs use it
    write(store, 1)
    res = write(store, 2)
    assert res.info.valid and res.deleted == []  # the commit did not wait for deletes
    assert store.wait_pruned() == [1] and store.steps() == [2]
    write(store, 3)
    write(store, 4)  # the next commit first waits for the pruning the previous one started
    store.close()
    assert store.steps() == [4] and [i.step for i in store.list() if i.valid] == [4]


# ---------------------------------------------------------------- local-only faults


def test_retention_never_leaves_zero_valid_checkpoints(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=1)
    write(store, 1)
    write(store, 2)
    # The newest becomes corrupt on disk: the older one must survive the next prune.
    store.fs.pipe_file(f"{store.root}/step-000000002/manifest.json", b"{not json")
    write(store, 1)  # already committed: nothing rewritten
    assert store.apply_retention() == []
    assert [i.step for i in store.list() if i.valid] == [1]
    write(store, 3)
    assert [i.step for i in store.list() if i.valid] == [3]


@pytest.mark.slow
def test_failed_delete_is_logged_and_retried_later(tmp_path, caplog):
    import shutil

    if not shutil.which("chattr"):
        pytest.skip("needs chattr to make a file undeletable")
    store = CheckpointStore(str(tmp_path), keep=1)
    write(store, 1)
    pinned = tmp_path / "step-000000001" / "manifest.json"
    if subprocess.run(["chattr", "+i", str(pinned)], capture_output=True).returncode != 0:
        pytest.skip("this filesystem does not support the immutable attribute")
    try:
        res = write(store, 2)  # the save succeeds even though pruning step 1 fails
        assert res.info.valid and res.deleted == []
        assert "could not delete old checkpoint" in caplog.text
        assert store.steps() == [1, 2]
    finally:
        subprocess.run(["chattr", "-i", str(pinned)], check=True)
    write(store, 3)  # retried after the next save
    assert store.steps() == [3]


WRITER = r"""
import sys, torch
from trainer.checkpoint import CheckpointStore
store = CheckpointStore(sys.argv[1])
store.write(1, {"small.json": b"{}"}, {})
big = {"w": torch.ones(96 * 1024 * 1024 // 4)}
# Four big files: the writer is killed while writing them, before the manifest.
store.write(2, {f"part{i}.safetensors": big for i in range(4)}, {})
"""


@pytest.mark.slow
def test_process_killed_between_payload_and_manifest(tmp_path):
    root = tmp_path / "ckpts"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root)])
    try:
        written = (root / "step-000000002" / "part0.safetensors").exists
        wait_until(written, "the writer's first payload file of step 2", 60, [proc], interval=0.005)
        proc.kill()  # SIGKILL
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    store = CheckpointStore(str(root))
    assert not (root / "step-000000002" / "manifest.json").exists()
    assert not store.check(2).valid
    assert store.latest_valid().step == 1
    assert store.latest_hint() == 1
