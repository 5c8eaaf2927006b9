"""FSDP2 sharded training and sharded checkpoints with real torchrun processes (gloo, 127.0.0.1):
same math as DDP, exact resume after SIGKILL, resharding across world sizes and DDP <-> FSDP, a rank
killed mid-save, tampering, S3, consolidation, and digests old and new."""

from __future__ import annotations

import json
import os
import re
import signal
from collections import defaultdict

import pytest
import torch
from conftest import REPO, run_cli, tiny
from elastic_helpers import finish, rank_of, standalone, start_torchrun, worker_pids
from helpers import assert_tensors_equal, kill_group, wait_until
from test_elastic import make_images

from trainer.checkpoint import CheckpointStore
from trainer.checkpoint.format import new_digest

pytestmark = pytest.mark.slow

FSDP = "train.parallel=fsdp"


def full_state(root: str, step: int | None = None, storage_options=None) -> dict[str, dict[str, torch.Tensor]]:
    """Whole tensors of every part/kind of a checkpoint, whichever layout and world size wrote it."""
    store = CheckpointStore(root, storage_options)
    info = store.check(step) if step is not None else store.latest_valid()
    assert info is not None and info.valid, f"no valid checkpoint in {root}"
    out = {}
    for kind in ("model", "ema", "optimizer"):
        name = f"unet.{kind}.safetensors"
        view = store.view(info)
        out[kind] = view.read_weights(name if view.has(name) else f"unet.{kind}")
    return out


def assert_same_state(a: dict, b: dict) -> None:
    assert_tensors_equal(a, b)


def run_torchrun(tmp_path, name: str, nproc: int, args: list[str], **env: str) -> str:
    log = tmp_path / f"{name}.log"
    proc = start_torchrun(standalone(nproc, max_restarts=0), args, log, **env)
    assert finish(proc, log) == 0, log.read_text()[-4000:]
    return log.read_text()


def logged_losses(text: str) -> list[float]:
    return [float(v) for v in re.findall(r"step=\d+/\d+ unet/loss=([0-9.e+-]+)", text)]


def test_fsdp_matches_ddp_within_float_tolerance_and_writes_a_sharded_checkpoint(tmp_path):
    # Same data, RNG and per-rank chunks (accumulation + micro-batches, clipping on). The math is the
    # same, the float rounding is not: FSDP2 reduces flat gradient buffers and sums the clip norm over
    # shards, so gradients differ in the last bits (seen: ~1e-7 relative). Two bounds that follow:
    # - losses agree to float rounding (rel 1e-4 after 5 steps of relative perturbations ~1e-7);
    # - Adam moves a weight by at most lr * (1 - b1) / sqrt(1 - b2) per step (Kingma & Ba, sec. 2.1),
    #   and a parameter whose true gradient is ~0 (an attention key bias) follows its rounding noise, so
    #   weights may differ by up to twice that sum over steps, never more.
    steps, lr, warmup = 5, 2e-4, 2
    common = [
        "checkpoint.every_steps=0",
        "model.dropout=0.1",
        "train.grad_accum=2",
        "train.micro_batch_size=1",
        "train.max_grad_norm=0.5",
        f"train.lr={lr}",
        f"train.warmup_steps={warmup}",
        "train.lr_schedule=constant",
    ]
    ddp_text = run_torchrun(tmp_path, "ddp", 2, tiny(tmp_path / "ddp", *common, max_steps=steps))
    # FID at the end: sampling through the sharded UNet runs on both ranks together, 48 images = 3
    # chunks: rank 1 draws a throwaway chunk to keep step with rank 0's second.
    fsdp_args = tiny(
        tmp_path / "fsdp",
        *common,
        FSDP,
        f"eval.every_steps={steps}",
        "eval.num=48",
        "eval.kid_subset_size=32",
        max_steps=steps,
    )
    text = run_torchrun(tmp_path, "fsdp", 2, fsdp_args)
    assert "world_size=2 restart=0 parallel=fsdp" in text
    result = json.loads((tmp_path / f"fsdp/run/checkpoints/eval-{steps:09d}.json").read_text())
    assert result["num_generated"] == 48 and result["world_size"] == 2 and result["fid"] > 0
    a, b = logged_losses(ddp_text), logged_losses(text)
    assert len(a) == len(b) == steps
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-4, atol=0)

    ddp, fsdp = f"{tmp_path}/ddp/run/checkpoints", f"{tmp_path}/fsdp/run/checkpoints"
    wa, wb = full_state(ddp), full_state(fsdp)
    assert wa["model"].keys() == wb["model"].keys() and wa["optimizer"].keys() == wb["optimizer"].keys()
    lr_sum = sum(lr * min(1.0, (t + 1) / warmup) for t in range(steps))
    bound = 2 * lr_sum * (1 - 0.9) / (1 - 0.999) ** 0.5
    worst = max((wa["model"][k] - wb["model"][k]).abs().max().item() for k in wa["model"])
    assert worst <= bound, (worst, bound)

    info = CheckpointStore(fsdp).latest_valid()
    files = set(info.manifest.files)
    # Every rank wrote its own slices and RNG state; rank 0 the index and trainer.json; manifest lists all.
    for rank in (0, 1):
        assert {
            f"unet.model.rank-{rank:05d}.safetensors",
            f"unet.optimizer.rank-{rank:05d}.safetensors",
            f"unet.ema.rank-{rank:05d}.safetensors",
            f"rank-{rank:05d}.safetensors",
        } <= files
    assert {"shards.json", "trainer.json"} <= files and "unet.model.safetensors" not in files
    assert info.manifest.digest == "blake3" and info.manifest.parallel == "fsdp"
    assert all(len(e.blake3) == 64 for e in info.manifest.files.values())
    index = json.loads((tmp_path / f"fsdp/run/checkpoints/step-{steps:09d}/shards.json").read_text())
    chunks = index["tensors"]["unet.model"]["conv_in.weight"]["chunks"]
    assert [c["offsets"][0] for c in chunks] == [0, 4] and {c["file"] for c in chunks} == {
        "unet.model.rank-00000.safetensors",
        "unet.model.rank-00001.safetensors",
    }


def test_sigkilled_fsdp_rank_resumes_bit_identical_from_an_async_save(tmp_path):
    from test_multi_part_tasks import probe_args, train_ddpm

    encoder = train_ddpm(tmp_path / "ddpm")
    steps, common = 12, ("checkpoint.every_steps=4", FSDP)
    env = {"PYTHONPATH": str(REPO / "tests")}
    run_torchrun(tmp_path, "ref", 2, probe_args(tmp_path / "ref", encoder, *common, max_steps=steps), **env)

    # The killed run saves in the background (every rank's writer thread copies its local shards while
    # the next step's forward and backward run, then writes them; rank 0 commits); PROBE_TASK_OVERLAP
    # holds each copy until that step reaches its fence. Rank 1 dies in step 6 once the async save of
    # step 4 has committed.
    log = tmp_path / "killed.log"
    killed = tmp_path / "killed/run/checkpoints"
    proc = start_torchrun(
        standalone(2, max_restarts=3),
        probe_args(tmp_path / "killed", encoder, *common, "checkpoint.async=true", max_steps=steps),
        log,
        PROBE_TASK_KILL="1:6",
        PROBE_TASK_KILL_AFTER=str(killed / "step-000000004/manifest.json"),
        PROBE_TASK_OVERLAP="1",
        **env,
    )
    rc = finish(proc, log)
    text = log.read_text()
    assert rc == 0, text[-4000:]
    assert re.search(r"world_size=2 restart=1 parallel=fsdp .*resumed_from=\S+step-000000004", text), text[-3000:]
    # Steps 4 (first attempt) and 8 (after the restart), on both ranks: each copy overlapped the next step.
    assert text.count("probe: snapshot copy held until a fence") == 4, text[-3000:]
    assert "until an optimizer step" not in text and "checkpoint save failed" not in text

    def tensors(root: str, step: int) -> dict[str, dict[str, torch.Tensor]]:
        store = CheckpointStore(root)
        info = store.check(step)
        return {n: store.read_tensors(info, n) for n in info.manifest.files if n.endswith(".safetensors")}

    for step in (4, steps):  # the async-written checkpoint the restart read, and the end
        a, b = tensors(f"{tmp_path}/ref/run/checkpoints", step), tensors(str(killed), step)
        assert a.keys() == b.keys()
        assert {"generator.model.rank-00001.safetensors", "discriminator.optimizer.rank-00000.safetensors"} <= set(a)
        for name in a:  # every rank's slices of weights, EMA, both optimizers; every rank's RNG state
            for key in a[name]:
                assert torch.equal(a[name][key], b[name][key]), f"step {step} {name}:{key} differs"


def roundtrip(tmp_path, name: str, nproc: int, src: str, out: str, *args: str) -> None:
    """Resume `src` at `nproc` ranks (resharding) and save the same step, untrained, under `out`."""
    log = tmp_path / f"{name}.log"
    args = [out, *tiny(tmp_path / name, f"checkpoint.url={src}", *args)]
    proc = start_torchrun(standalone(nproc), args, log, command=(), script=str(REPO / "tests" / "reshard_roundtrip.py"))
    assert finish(proc, log) == 0, log.read_text()[-4000:]


def test_resharding_2_to_3_and_1_and_ddp_fsdp_round_trips_are_exact(tmp_path):
    src = f"{tmp_path}/fsdp2/run/checkpoints"
    batch = "train.batch_size=6"  # global, split over 1, 2 and 3 ranks
    run_torchrun(tmp_path, "fsdp2", 2, tiny(tmp_path / "fsdp2", FSDP, batch, "checkpoint.every_steps=0", max_steps=3))
    saved = full_state(src)
    legs = [
        ("to-fsdp3", 3, src, [FSDP]),  # sharded at 2 -> at 3: conv_in's 8 rows saved 4/4, loaded 3/3/2
        ("to-one", 1, src, []),  # sharded -> one process, whole tensors
        ("to-ddp2", 2, src, []),  # FSDP -> DDP
        ("back-to-fsdp2", 2, f"{tmp_path}/to-ddp2/out", [FSDP]),  # DDP (one file per part) -> FSDP
    ]
    for name, nproc, source, args in legs:
        out = f"{tmp_path}/{name}/out"
        roundtrip(tmp_path, name, nproc, source, out, batch, *args)
        info = CheckpointStore(out).latest_valid()
        sharded = "shards.json" in info.manifest.files
        assert info.manifest.world_size == nproc and sharded == (bool(args) and nproc > 1)
        assert_same_state(saved, full_state(out))


def test_world_size_changes_under_fsdp_use_every_sample_once_per_epoch(tmp_path):
    n, batch = 30, 6
    data = tmp_path / "imgs"
    make_images(data, n)
    base = tiny(
        tmp_path,
        FSDP,
        "data.source=folder",
        f"data.path={data}",
        "data.channels=1",
        "data.val_fraction=0",
        "data.ledger=true",
        f"train.batch_size={batch}",
        "checkpoint.every_steps=0",
    )
    previous = 0
    for i, (world, until) in enumerate([(2, 7), (1, 16), (3, 27)]):
        text = run_torchrun(tmp_path, f"leg{i}", world, [*base, f"train.max_steps={until}"])
        if previous:
            assert f"step={previous} cursor={previous * batch}" in text
        previous = until
    per_step: dict[int, dict[int, list[int]]] = defaultdict(dict)
    for f in (tmp_path / "run" / "ledger").glob("rank-*.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            per_step[rec["step"]][rec["rank"]] = rec["indices"]
    assert sorted(per_step) == list(range(1, 28))
    stream = [i for s in sorted(per_step) for r in sorted(per_step[s]) for i in per_step[s][r]]
    for epoch in range(len(stream) // n):
        assert sorted(stream[epoch * n : (epoch + 1) * n]) == list(range(n)), f"epoch {epoch}"


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_and_a_tampered_shard_is_refused(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    step8 = root / "step-000000008"
    log = tmp_path / "kill.log"
    # Rank 1 writes its files of step 8's save, then stops before reporting them (the failpoint, first
    # attempt only): it is stuck mid-save when it is killed. No sleeps: we wait for the line it logs.
    proc = start_torchrun(
        standalone(2, max_restarts=1),
        tiny(tmp_path, FSDP, "checkpoint.every_steps=4", max_steps=10),
        log,
        GENTRAIN_FAULT_STALL_SAVE="8:1",
    )
    try:
        stalled = lambda: "stalling the save of step 8 on rank 1" in log.read_text()  # noqa: E731
        wait_until(stalled, "rank 1's stalled save of step 8", 120, [proc], [log], interval=0.05)
        assert (step8 / "unet.model.rank-00001.safetensors").exists() and (step8 / "rank-00001.json").exists()
        assert not (step8 / "manifest.json").exists()
        victims = [p for p in worker_pids(proc.pid) if rank_of(p) == 1]
        os.kill(victims[0], signal.SIGKILL)
        assert finish(proc, log) == 0, log.read_text()[-4000:]
    finally:
        kill_group(proc)
    text = log.read_text()
    assert re.search(r"world_size=2 restart=1 parallel=fsdp .*resumed_from=\S+step-000000004", text), text[-3000:]
    assert CheckpointStore(str(root)).latest_valid().step == 10

    # Flip one byte of one rank's shard (same size): verify names it and exits 1, and a resume skips it.
    shard = root / "step-000000010" / "unet.optimizer.rank-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    r = run_cli("checkpoints", "verify", str(root / "step-000000010"))
    assert r.returncode == 1 and "unet.optimizer.rank-00001.safetensors" in r.stdout and "blake3" in r.stdout
    text = run_torchrun(tmp_path, "resume", 2, tiny(tmp_path, FSDP, "checkpoint.every_steps=0", max_steps=11))
    assert "step-000000010 cannot be loaded" in text and "rank 1:" in text
    assert re.search(r"resumed_from=\S+step-000000008", text), text[-3000:]


def test_sharded_checkpoints_on_s3_consolidate_and_sample_the_same_images(tmp_path, s3_server):
    url = f"s3://{s3_server.make_bucket()}/run/ckpts"
    options = json.dumps(s3_server.storage_options())
    args = [f"checkpoint.url={url}", f"checkpoint.storage_options={options}", FSDP, "checkpoint.every_steps=2"]
    run_torchrun(tmp_path, "s3", 2, tiny(tmp_path, *args, max_steps=3))
    text = run_torchrun(tmp_path, "s3-resume", 2, tiny(tmp_path, *args, max_steps=4))
    assert re.search(r"resumed_from=s3://\S+step-000000003", text), text[-3000:]
    r = run_cli("checkpoints", "verify", url, "--storage-options", options)
    assert r.returncode == 0 and "blake3 checked" in r.stdout, r.stdout + r.stderr

    out = str(tmp_path / "consolidated")
    r = run_cli("checkpoints", "consolidate", url, out, "--storage-options", options)
    assert r.returncode == 0, r.stderr[-3000:]
    files = set(CheckpointStore(out).latest_valid().manifest.files)
    assert files == {"unet.model.safetensors", "unet.ema.safetensors"}
    grids = []
    for source, extra in ((url, ["--storage-options", options]), (out, [])):
        grid = tmp_path / f"grid-{len(grids)}.png"
        r = run_cli("sample", source, "--num", "4", "--out", str(grid), *extra)
        assert r.returncode == 0, r.stderr[-3000:]
        grids.append(grid.read_bytes())
    assert grids[0] == grids[1]


def test_blake3_is_named_in_the_manifest_and_old_sha256_checkpoints_verify_and_resume(tmp_path):
    r = run_cli("train", *tiny(tmp_path, "checkpoint.every_steps=2", max_steps=2))
    assert r.returncode == 0, r.stderr[-3000:]
    step_dir = tmp_path / "run" / "checkpoints" / "step-000000002"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert manifest["digest"] == "blake3" and manifest["format_version"] == 2
    for name, entry in manifest["files"].items():
        h = new_digest("blake3")
        h.update((step_dir / name).read_bytes())
        assert entry["blake3"] == h.hexdigest() and "sha256" not in entry

    # What gentrain wrote before this change: format 1, sha256 entries, no digest field.
    for name, entry in manifest["files"].items():
        h = new_digest("sha256")
        h.update((step_dir / name).read_bytes())
        manifest["files"][name] = {"bytes": entry["bytes"], "sha256": h.hexdigest()}
    manifest["format_version"] = 1
    del manifest["digest"]
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    r = run_cli("checkpoints", "verify", str(step_dir))
    assert r.returncode == 0 and "sha256 checked" in r.stdout, r.stdout + r.stderr
    # It loads into a sharded run too (whole files, sliced per rank) and still refuses a changed byte.
    text = run_torchrun(tmp_path, "fsdp", 2, tiny(tmp_path, FSDP, "checkpoint.every_steps=0", max_steps=3))
    assert re.search(r"resumed_from=\S+step-000000002", text), text[-3000:]
    weights = step_dir / "unet.model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    r = run_cli("checkpoints", "verify", str(step_dir))
    assert r.returncode == 1 and "sha256" in r.stdout
