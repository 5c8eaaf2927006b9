"""Non-finite values never reach the weights or a checkpoint: a step whose loss or gradient norm is inf or NaN
is not applied (decided on the device), counted, and too many in a row stop the run with exit 2; an inf in a
stored sample is a skipped sample; a save of non-finite weights commits nothing; verify flags them."""

from __future__ import annotations

import io
import json
import re
import shutil
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_tamper import edit_tensors, read_tensors, step_dir
from conftest import REPO, clean_env, free_port, run_cli, tiny
from helpers import kill_group, start_cli, wait_for_log
from PIL import Image
from safetensors.torch import save as safetensors_save
from torch.overrides import TorchFunctionMode

from trainer.checkpoint import CheckpointStore
from trainer.checkpoint.format import FiniteScan, NonFiniteTensor
from trainer.checkpoint.quantized import plain_tensors
from trainer.checkpoint.validity import MAX_HEADER_BYTES, parse_safetensors_header
from trainer.data.datasets import read_embedding
from trainer.data.shards.encoded import EncodedSettings
from trainer.data.shards.latents import decode_encoded_sample
from trainer.engine.parts import nonfinite
from trainer.optim import step_unless

# lr 1e30: the first step with a learning rate (warmup: 5e29) moves every weight to about 5e29, which is finite,
# and every step after it overflows (loss and gradients NaN): a divergence, as a learning rate spike makes one.
DIVERGING = ["train.lr=1e30", "checkpoint.every_steps=2", "checkpoint.keep=2"]


def progress(root: Path, step: int) -> dict:
    return json.loads((step_dir(root, step) / "trainer.json").read_text())["progress"]


def counts(root: Path, step: int) -> dict:
    doc = progress(root, step)
    return {k: doc[k] for k in ("nonfinite_steps", "nonfinite_streak", "nonfinite_first")}


def finite(tensors: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point())


@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("diverged")
    r = run_cli("train", *tiny(tmp, *DIVERGING, "train.max_nonfinite_steps=4", max_steps=20))
    return tmp, r


@pytest.mark.slow
def test_a_diverging_run_applies_no_non_finite_step_keeps_finite_checkpoints_and_exits_2_naming_the_first(diverged):
    tmp, r = diverged
    root = tmp / "run" / "checkpoints"
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    # Steps 3, 4, 5, 6 were not finite: the stop comes at step 6, naming the first and what to look at.
    assert re.search(r"train\.max_nonfinite_steps=4: the last 4 steps \(from step 3 on\)", r.stderr), r.stderr[-3000:]
    assert "learning rate" in r.stderr and "fp16" in r.stderr and "corrupt sample" in r.stderr
    assert "step 3 not applied: its loss or gradient norm is inf or NaN (unet/loss=nan" in r.stderr
    # Retention kept the two newest (steps 4 and 6 were never saved: the stop came first at 6), all finite.
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000000002", "step-000000004"]
    for step in (2, 4):
        for name in ("unet.model.safetensors", "unet.ema.safetensors", "unet.optimizer.safetensors"):
            assert finite(read_tensors(root, step, name)), (step, name)
    # No non-finite step touched the weights: step 4's are step 2's (the EMA averaged in those unchanged ones).
    two, four = (read_tensors(root, s, "unet.model.safetensors") for s in (2, 4))
    assert all(torch.equal(two[k], four[k]) for k in two)
    assert counts(root, 4) == {"nonfinite_steps": 2, "nonfinite_streak": 2, "nonfinite_first": 3}
    assert progress(root, 2)["nonfinite_steps"] == 0
    assert run_cli("checkpoints", "verify", str(root)).returncode == 0


@pytest.mark.slow
def test_the_count_survives_a_resume_is_exported_and_0_never_stops(diverged, tmp_path):
    src, _ = diverged
    shutil.copytree(src / "run", tmp_path / "run")
    port = free_port()
    args = tiny(
        tmp_path,
        *DIVERGING,
        "train.max_nonfinite_steps=0",
        f"metrics.port={port}",
        "metrics.host=127.0.0.1",
        "metrics.linger_seconds=300",
        max_steps=8,
    )
    log = tmp_path / "train.log"
    proc = start_cli("train", *args, env=clean_env(GENTRAIN_METRICS_DIR=str(tmp_path / "mp")), log_path=log)
    try:
        wait_for_log(log, "checkpoint committed", proc)  # the resumed run's first save: step 6
        wait_for_log(log, "step-000000008", proc)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        kill_group(proc)
    # Resumed from step 4 (2 non-finite steps so far); steps 5 to 8 are non-finite too: this process counted 4.
    assert re.search(r"^gentrain_nonfinite_steps_total 4\.0$", text, re.M), text
    root = tmp_path / "run" / "checkpoints"
    assert counts(root, 8) == {"nonfinite_steps": 6, "nonfinite_streak": 6, "nonfinite_first": 3}
    assert finite(read_tensors(root, 8, "unet.model.safetensors")) and finite(
        read_tensors(root, 8, "unet.ema.safetensors")
    )


@pytest.mark.slow
def test_verify_flags_non_finite_weights_whose_digests_were_recomputed_and_a_resume_falls_back_past_them(
    diverged, tmp_path
):
    src, _ = diverged
    shutil.copytree(src / "run", tmp_path / "run")
    root = tmp_path / "run" / "checkpoints"

    def poison(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        name = sorted(tensors)[0]
        tensors[name] = (
            tensors[name].clone().view(-1).index_fill(0, torch.tensor([0]), float("nan")).view_as(tensors[name])
        )
        return tensors

    edit_tensors(root, 4, "unet.model.safetensors", poison)  # the manifest's size and digest made to agree
    r = run_cli("checkpoints", "verify", str(step_dir(root, 4)))
    assert r.returncode == 1 and "inf or NaN" in r.stdout + r.stderr, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    # A resume skips it for the finite step 2, and its save of step 4 replaces it.
    r = run_cli("train", *tiny(tmp_path, "checkpoint.every_steps=2", "checkpoint.keep=2", max_steps=4))
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"step-000000004 cannot be loaded .*inf or NaN.*trying the previous one", r.stderr), r.stderr[
        -3000:
    ]
    assert "resumed_from=" in r.stderr and re.search(r"resumed_from=\S+step-000000002", r.stderr)
    assert finite(read_tensors(root, 4, "unet.model.safetensors"))


def test_a_save_of_non_finite_weights_commits_nothing_and_prunes_nothing(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"), keep=1)
    store.write(1, {"w.safetensors": {"w": torch.ones(3)}}, {})
    bad = torch.tensor([1.0, float("inf"), 2.0])
    with pytest.raises(NonFiniteTensor, match=r"w\.safetensors: tensor 'w' holds inf or NaN"):
        store.write(2, {"w.safetensors": {"w": bad}}, {})
    assert store.steps() == [1] and store.latest_valid().step == 1  # kept (keep=1 would have pruned it)
    assert not (tmp_path / "ckpt" / "step-000000002").exists()


class _VerdictReads(TorchFunctionMode):
    """Records every host read (the calls that wait for a device) of the verdict or of a tensor computed from it:
    what every op makes from a tracked tensor is tracked too. The optimizers' own reads (torchao compiles, a
    per-tensor AdamW reads its step count) are not the verdict's and do not count."""

    READS = {"item", "tolist", "__bool__", "__float__", "__int__", "numpy"}

    def __init__(self, verdict: torch.Tensor):
        super().__init__()
        self.tracked = [verdict]
        self.reads: list[str] = []

    def _is_tracked(self, x) -> bool:
        return isinstance(x, torch.Tensor) and any(x is t for t in self.tracked)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [*args, *kwargs.values()]
        flat += [x for a in flat if isinstance(a, list | tuple) for x in a]
        tainted = any(self._is_tracked(x) for x in flat)
        if tainted and getattr(func, "__name__", "") in self.READS:
            self.reads.append(func.__name__)
        out = func(*args, **kwargs)
        if tainted:
            self.tracked += [
                o for o in (out if isinstance(out, list | tuple) else [out]) if isinstance(o, torch.Tensor)
            ]
        return out


def state_tensors(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t for p in params for v in opt.state[p].values() if torch.is_tensor(v) for t in plain_tensors(v)]


def _optimizers():
    yield "fused adamw", lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1, fused=True)
    yield "per-tensor adamw", lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1, foreach=False)
    try:
        from torchao.optim import AdamW8bit
    except ImportError:
        return
    yield "adamw8bit", lambda ps: AdamW8bit(ps, lr=0.1, weight_decay=0.1)


@pytest.mark.parametrize(("kind", "make"), list(_optimizers()), ids=[k for k, _ in _optimizers()])
def test_a_skipped_step_leaves_weights_and_state_as_they_were_and_reads_nothing_on_the_host(kind, make):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(64))]
    opt = make(params)

    def step(grads: list[torch.Tensor]) -> torch.Tensor:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        verdict = nonfinite(norm)
        with _VerdictReads(verdict) as mode:
            step_unless(opt, verdict)
        assert mode.reads == [] and len(mode.tracked) > 1, (kind, mode.reads)
        return norm

    nan = [torch.full_like(p, float("nan")) for p in params]
    step(nan)  # a first step that is skipped: no state built from NaN either
    assert all(torch.isfinite(p).all() for p in params)
    step([torch.randn_like(p) for p in params])
    before = [p.detach().clone() for p in params]
    state = [t.clone() for t in state_tensors(opt, params)]  # moments (8-bit: codes, scales) and step counts
    grads = [torch.randn_like(p) for p in params]
    grads[1][3] = float("inf")
    step(grads)
    assert all(torch.equal(a, p) for a, p in zip(before, params, strict=True)), kind
    assert all(torch.equal(a, b) for a, b in zip(state, state_tensors(opt, params), strict=True)), kind
    step([torch.randn_like(p) for p in params])
    assert not all(torch.equal(a, p) for a, p in zip(before, params, strict=True)), kind  # finite steps apply


def test_an_inf_in_a_stored_posterior_or_embedding_is_a_corrupt_sample():
    def npy(a: np.ndarray) -> bytes:
        buf = io.BytesIO()
        np.save(buf, a)
        return buf.getvalue()

    mean = np.zeros((4, 2, 2), np.float32)
    std = np.ones((4, 2, 2), np.float32)
    encoded = EncodedSettings.model_construct(latent_shape=(4, 2, 2), text=None, buckets=None)
    assert decode_encoded_sample({"mean.npy": npy(mean), "std.npy": npy(std)}, encoded, False, 0)[0].shape[0] == 8
    mean[1, 0, 1] = np.inf
    with pytest.raises(ValueError, match="inf or NaN"):
        decode_encoded_sample({"mean.npy": npy(mean), "std.npy": npy(std)}, encoded, False, 0)
    with pytest.raises(ValueError, match="inf or NaN"):
        read_embedding(io.BytesIO(npy(np.array([1.0, np.nan], np.float32))))


@pytest.mark.slow
def test_an_image_embedding_holding_inf_is_skipped_and_counted_and_the_weights_stay_finite(tmp_path):
    rng = np.random.default_rng(0)
    data = tmp_path / "images"
    data.mkdir()
    for i in range(8):
        Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8)).save(data / f"{i}.png")
        np.save(data / f"{i}.npy", rng.normal(size=6).astype(np.float32))
    np.save(data / "5.npy", np.array([0, 1, np.inf, 0, 0, 0], np.float32))
    r = run_cli(
        "train",
        str(REPO / "tests" / "cascade.yaml"),
        f"run.dir={tmp_path}/run",
        "train.max_steps=2",
        "checkpoint.every_steps=2",
        "data.source=folder",
        f"data.path={data}",
        "data.channels=1",
        "data.val_fraction=0",
        "model.num_classes=null",
        "model.image_embed_dim=6",
        "model.context_dim=16",
        env=clean_env(PYTHONPATH=str(REPO / "tests")),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "5.npy" in r.stderr and "inf or NaN" in r.stderr, r.stderr[-3000:]
    root = tmp_path / "run" / "checkpoints"
    assert progress(root, 2)["skipped_samples"] == 2  # one a step: each step's batch of 8 holds every image
    assert progress(root, 2)["nonfinite_steps"] == 0
    for name in sorted(p.name for p in step_dir(root, 2).glob("*.safetensors")):
        assert finite(read_tensors(root, 2, name)), name


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 1 << 20])
def test_the_scan_on_the_hashed_bytes_finds_each_non_finite_tensor_whatever_the_chunks(chunk):
    tensors = {
        "a": torch.arange(10, dtype=torch.float32),
        "b": torch.ones(5, dtype=torch.bfloat16),
        "c": torch.arange(7, dtype=torch.float64),
        "d": torch.arange(6, dtype=torch.int64),
        "e": torch.ones(3, dtype=torch.float16),
    }
    tensors["b"][3] = float("inf")
    tensors["c"][6] = float("nan")  # the file's last bytes
    raw = safetensors_save(tensors)

    def scan(data: bytes) -> list[str]:
        s = FiniteScan(
            lambda prefix: parse_safetensors_header(lambda o, n: prefix[o : o + n], len(data), "f"), MAX_HEADER_BYTES
        )
        for i in range(0, len(data), chunk):
            s.update(memoryview(data)[i : i + chunk])
        assert not s.skipped
        return sorted(s.bad)

    assert scan(raw) == ["b", "c"]
    tensors["b"][3], tensors["c"][6] = 1.0, 1.0
    assert scan(safetensors_save(tensors)) == []
