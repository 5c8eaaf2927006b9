"""DreamBooth (issue 50, deliver 5): instance and class images paired one for one in every batch, the loss
diffusers' instance + prior_loss_weight * class loss, a SIGKILLed run resuming bit-identically; `gentrain data
class-images` drawing the class images from the base pipeline exactly and resumably; `sample.prompts` drawn as rows
of the preview grid and sent to the trackers with their prompts. On the tiny SD pipeline (tests/tiny_pipelines.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO, clean_env, run_cli
from helpers import tracker_settings
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from safetensors.torch import load_file
from tiny_pipelines import captioned_images, folder_fixture

from trainer.data.datasets import Subset
from trainer.data.dreambooth import DreamBoothSet, Prompted
from trainer.data.sampler import StepBatchSampler
from trainer.errors import ConfigError
from trainer.registry import load_config
from trainer.task_types import Loss
from trainer.tasks.ddpm import prior_weighted

ENV = clean_env(PYTHONPATH=str(REPO / "tests"))  # probe_tasks: KillableDDPM dies where PROBE_TASK_KILL says
INSTANCE_PROMPT, CLASS_PROMPT = "a photo of sks dog", "a photo of dog"
PROMPTS = ["a photo of sks dog", "the red photo of a handwritten"]


def _set(instances: int, classes: int) -> DreamBoothSet:
    def side(n: int, prompt: str, prior: bool) -> Prompted:
        return Prompted(Subset(list(range(n)), np.arange(n), False, (3, 4, 4)), prompt, prior)

    return DreamBoothSet(side(instances, INSTANCE_PROMPT, False), side(classes, CLASS_PROMPT, True))


@settings(max_examples=40, derandomize=True, database=None, deadline=None)
@given(st.integers(1, 9), st.integers(1, 9), st.sampled_from([2, 4, 8]), st.integers(0, 2**32), st.integers(0, 6))
def test_each_batch_pairs_instance_and_class_images_each_side_once_per_its_epoch_at_any_world_size(
    n_instance, n_class, batch, seed, resume_step
):
    ds, steps = _set(n_instance, n_class), 12

    def global_batches(world: int, first: int = 0) -> list[list[tuple[int, int, int]]]:
        its = [iter(StepBatchSampler(ds.make_stream(seed), first * batch, batch, r, world)) for r in range(world)]
        return [[(x.index, x.position, x.aug_seed) for it in its for x in next(it)] for _ in range(first, steps)]

    one = global_batches(1)
    for world in (w for w in (2, 4) if batch % w == 0):  # the same global batches, whoever reads which slice
        assert global_batches(world) == one
    assert global_batches(2, resume_step) == one[resume_step:]  # a resume at any step continues the stream
    picks = [index for step in one for index, _, _ in step]
    inst = picks[0::2]  # even positions: instance slots; odd: class slots
    cls = [i - n_instance for i in picks[1::2]]
    assert all(i < n_instance for i in inst) and all(0 <= i < n_class for i in cls)
    for side, n in ((inst, n_instance), (cls, n_class)):  # every epoch of a side is one permutation of it
        for e in range(len(side) // n):
            assert sorted(side[e * n : (e + 1) * n]) == list(range(n))


def test_the_loss_is_the_instance_loss_plus_the_weighted_class_loss():
    per = torch.tensor([1.0, 4.0, 3.0, 8.0])
    prior = torch.tensor([0.0, 1.0, 0.0, 1.0])
    out = prior_weighted(Loss(per, {"mse": per}), prior, 0.5)
    # The engine's reduction: the per-sample losses averaged over the global batch.
    assert out.per_sample.mean().item() == pytest.approx((1 + 3) / 2 + 0.5 * (4 + 8) / 2)
    assert out.terms["instance_loss"].mean().item() == 2.0 and out.terms["prior_loss"].mean().item() == 6.0


def test_dreambooth_keys_are_checked(tmp_path):
    def load(*keys: str):
        return load_config("sd15-dreambooth", ["model.lora=null", *keys], {})

    with pytest.raises(ConfigError, match="data.class_images needs data.class_prompt"):
        load(f"data.instance={tmp_path}", f"data.class_images={tmp_path}")
    with pytest.raises(ConfigError, match="data.instance=.* and data.path=.*set one of them"):
        load(f"data.instance={tmp_path}", "data.path=/elsewhere")
    with pytest.raises(ConfigError, match="data.instance_prompt needs data.instance"):
        load("data.path=/x", "data.instance_prompt=a sks dog")
    cfg = load(f"data.instance={tmp_path}")
    assert cfg.data.path == str(tmp_path)  # data.instance is the run's image folder


def test_sample_prompts_need_a_caption_conditioned_model():
    with pytest.raises(
        ConfigError, match=r"sample.prompts=\['a seven'\]: this ddpm model is not conditioned on captions"
    ):
        load_config("digits-ddpm", ["sample.prompts=[a seven]"], {})
    assert load_config("digits-cascade-text", ["sample.prompts=[a seven]"], {}).sample.prompts == ["a seven"]


sd = folder_fixture("sd")


@pytest.fixture(scope="module")
def instance(tmp_path_factory):
    return captioned_images(tmp_path_factory.mktemp("instance"), 3)


def _keys(sd, instance, classes, root) -> list[str]:
    return [
        f"model.pretrained={sd}",
        f"data.instance={instance}",
        f"data.instance_prompt={INSTANCE_PROMPT}",
        f"data.class_images={classes}",
        f"data.class_prompt={CLASS_PROMPT}",
        "data.image_size=16",
        "sample.inference_steps=2",
        f"model.text.cache_dir={root}/text",
    ]


def _class_images(sd, instance, classes, root, *extra: str, env=None, command=None):
    args = ["data", "class-images", "sd15-dreambooth", *_keys(sd, instance, classes, root), *extra]
    if command is None:
        return run_cli(*args, "--num", "5", "--batch-size", "2", env=env or ENV)
    return subprocess.run(
        [sys.executable, "-c", command, *args, "--num", "5", "--batch-size", "2"],
        capture_output=True,
        text=True,
        env=env or ENV,
        cwd=REPO,
        timeout=900,
    )


@pytest.fixture(scope="module")
def classes(sd, instance, tmp_path_factory):
    root = tmp_path_factory.mktemp("classes")
    r = _class_images(sd, instance, root / "images", root)
    assert r.returncode == 0 and "5 written, 0 already there" in r.stdout, r.stderr[-3000:]
    return root / "images"


# The command, SIGKILLed right after the temporary file of its third image is written (before the rename): an
# exact point, not a race with a running process.
KILL_AT_THIRD = """
import os, signal, sys
import trainer.class_images as ci
from trainer.cli import main
real, calls = ci._atomic_write, []
def write(fs, root, name, data):
    if name.endswith(".png") and len(calls) == 2:
        fs.pipe_file(f"{root}/.{name}.tmp", data)
        os.kill(os.getpid(), signal.SIGKILL)
    calls.append(name) if name.endswith(".png") else None
    real(fs, root, name, data)
ci._atomic_write = write
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_class_images_are_exact_resume_after_a_kill_and_a_rerun_draws_nothing(sd, instance, classes, tmp_path):
    names = [f"{i:06d}.png" for i in range(5)]
    assert sorted(p.name for p in classes.glob("*.png")) == names
    reference = {n: (classes / n).read_bytes() for n in names}
    settings = json.loads((classes / "class-images.json").read_text())
    assert (settings["prompt"], settings["pipeline_class"], settings["batch_size"]) == (
        CLASS_PROMPT,
        "StableDiffusionPipeline",
        2,
    )
    assert len(set(reference.values())) == 5  # each image its own seed
    # Killed mid-way: the images before are whole, the third only a temporary file; the rerun finishes with
    # the same bytes as the uninterrupted run (same machine, one process).
    out = tmp_path / "images"
    r = _class_images(sd, instance, out, tmp_path, command=KILL_AT_THIRD)
    assert r.returncode == -9, r.stderr[-3000:]
    assert sorted(p.name for p in out.glob("*.png")) == names[:2] and (out / ".000002.png.tmp").is_file()
    r = _class_images(sd, instance, out, tmp_path)
    assert r.returncode == 0 and "3 written, 2 already there" in r.stdout, r.stderr[-3000:]
    assert {n: (out / n).read_bytes() for n in names} == reference
    assert not list(out.glob(".*.tmp"))
    r = _class_images(sd, instance, out, tmp_path)  # finished: nothing drawn
    assert r.returncode == 0 and "0 written, 5 already there" in r.stdout, r.stderr[-3000:]
    # Other settings over the same folder: one line, exit 2, naming what differs.
    r = _class_images(sd, instance, out, tmp_path, "data.class_prompt=a photo of a cat")
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "prompt='a photo of a cat' (the folder's: 'a photo of dog')" in last, last


def _train(sd, instance, classes, root, *extra: str, env=None):
    args = [
        "train",
        "sd15-dreambooth",
        *_keys(sd, instance, classes, root),
        "train.max_steps=4",
        "train.lr=1e-2",
        "train.num_workers=0",
        "checkpoint.every_steps=2",
        "sample.every_steps=2",
        "sample.num=2",
        f"sample.prompts={json.dumps(PROMPTS)}",
        "data.ledger=true",
        f"run.dir={root}",
        "task=probe_tasks:KillableDDPM",
        *extra,
    ]
    return run_cli(*args, env=env or ENV)


@pytest.fixture(scope="module")
def runs(sd, instance, classes, tmp_path_factory):
    """A DreamBooth run reporting to every tracker installed, and the same run SIGKILLed in step 3, resumed."""
    root = tmp_path_factory.mktemp("runs")
    tracking, tracker_env, trackers = tracker_settings(root / "straight")
    r = _train(sd, instance, classes, root / "straight", *tracking, env={**ENV, **tracker_env})
    assert r.returncode == 0, r.stderr[-3000:]
    r = _train(
        sd, instance, classes, root / "killed", env=clean_env(PYTHONPATH=str(REPO / "tests"), PROBE_TASK_KILL="0:3")
    )
    assert r.returncode == -9, r.stderr[-3000:]
    r = _train(sd, instance, classes, root / "killed")
    assert r.returncode == 0 and "resumed_from=" in r.stderr, r.stderr[-3000:]
    return {"straight": root / "straight", "killed": root / "killed", "trackers": trackers}


@pytest.mark.slow
def test_a_sigkilled_dreambooth_run_resumes_bit_identically_on_paired_batches(runs):
    a, b = (runs[k] / "checkpoints" / "step-000000004" for k in ("straight", "killed"))
    files = sorted(p.name for p in a.glob("*.safetensors"))
    assert "unet.optimizer.safetensors" in files and files == sorted(p.name for p in b.glob("*.safetensors"))
    for name in files:  # adapters, EMA, optimizer, RNG
        x, y = load_file(a / name), load_file(b / name)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), name
    # Every step: one instance image (indices 0..2) and one class image (3..7), each side once per its epoch.
    steps = [json.loads(line) for line in (runs["straight"] / "ledger" / "rank-0.jsonl").read_text().splitlines()]
    pairs = [s["indices"] for s in steps]
    assert [len(p) for p in pairs] == [2] * 4 and all(i < 3 <= c < 8 for i, c in pairs)
    assert sorted(i for i, _ in pairs[:3]) == [0, 1, 2] and len({c for _, c in pairs}) == 4


@pytest.mark.slow
def test_sample_prompts_are_rows_of_the_preview_and_the_trackers_get_them_as_captions(runs, monkeypatch):
    run = runs["straight"]
    grid = np.asarray(Image.open(run / "samples" / "step-000000004.png").convert("RGB"))
    cell = 16 * 4 + 1  # 16 px upscaled 4x, one pixel of padding
    assert grid.shape[:2] == (2 * cell + 1, 2 * cell + 1)  # two prompts (rows) of sample.num=2
    rows = [grid[1 + r * cell : (r + 1) * cell] for r in range(2)]
    assert not np.array_equal(rows[0], rows[1])  # the same noise per column: the prompt changes the row
    trackers = runs["trackers"]
    if "tensorboard" in trackers:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(next(run.rglob("events.out.tfevents.*")).parent))
        acc.Reload()
        texts = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("samples/prompts/text_summary")]
        assert len(texts) == 2 and all(f"row {i}: {p}" in texts[-1] for i, p in enumerate(PROMPTS)), texts
    if "mlflow" in trackers:
        from mlflow.tracking import MlflowClient

        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 wants a database; the run wrote files
        client = MlflowClient(tracking_uri=f"file://{run}/mlruns")
        (found,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
        path = client.download_artifacts(found.info.run_id, "samples/samples-step-4-prompts.json", str(run))
        assert json.loads(open(path).read())["prompts"] == PROMPTS
    if "wandb" in trackers:  # one image per row, its prompt the caption, in the offline run's history
        (start,) = (run / "wandb").glob("offline-run-*")
        history = next(start.glob("run-*.wandb")).read_bytes()
        assert all(p.encode() in history for p in PROMPTS) and b"captions" in history
        assert len(list(start.glob("files/media/images/samples_*.png"))) == 4  # 2 rows x 2 previews
