"""Fast, in-process tests of the engine's pieces with the real Part, build_parts, StepRunner, wrapping and
CheckpointManager on a two-part task of two small MLPs: accumulation, per-part max steps, no_sync, the lr
schedule and EMA per optimizer step, learns_now; the runtime and wrapping choices; frozen-part records
stored redacted and matched on resume. Last, through the CLI: a tracker whose package cannot be imported
exits 2 naming the extra."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math

import pytest
import torch
from conftest import REPO, clean_env, run_cli, tiny
from torch import nn

from trainer import __version__
from trainer.checkpoint.validity import FrozenRecord
from trainer.config.redact import REDACTED
from trainer.elastic import DistEnv
from trainer.engine.checkpoints import CheckpointManager
from trainer.engine.parts import ModuleView, Part, build_parts
from trainer.engine.progress import TrainProgress
from trainer.engine.runtime import Runtime, parallel_mode
from trainer.engine.step import StepRunner
from trainer.engine.wrap import DataParallel, FullySharded, OneProcess, wrapping_for
from trainer.errors import ConfigError
from trainer.metrics import TrainingMetrics
from trainer.registry import load_config
from trainer.tasks.base import Loss, Phase

D = 4  # features per sample (images of 1x2x2)
HIDDEN = 8
U32 = 2.0**-24  # float32 unit roundoff


class TwoPartTask:
    """What the step runner asks of a task: a generator regressing a fixed function of its input and a
    discriminator scoring the generator's detached output (second phase). No dropout: only how the step
    is chunked changes the numbers."""

    micro_batch_invariant = True

    def __init__(self, events: list | None = None):
        self.events = events  # a forward appends None; see RecordingAccelerator

    def phases(self, step, part_steps):
        return [Phase("generator", "generator"), Phase("discriminator", "discriminator")]

    def forward(self, modules, batch, step):
        if self.events is not None:
            self.events.append(None)
        return {"out": modules["generator"](batch.images.flatten(1))}

    def loss(self, phase, modules, batch, outputs, info):
        if phase.part == "generator":
            per_sample = ((outputs["out"] - target(batch.images.flatten(1))) ** 2).mean(1)
            return Loss(per_sample, {"mse": per_sample.detach()})
        return Loss((modules["discriminator"](outputs["out"]).squeeze(1) - 1) ** 2)


def target(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(3 * x)


def mlp(out: int) -> nn.Module:
    return nn.Sequential(nn.Linear(D, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, out))


def config(*overrides: str):
    """The probe task's config (its part names: generator, discriminator); the encoder is never loaded."""
    base = ["model.encoder_url=unused", "train.batch_size=8", "train.warmup_steps=2", "train.max_steps=10"]
    return load_config(str(REPO / "tests" / "probe.yaml"), [*base, *overrides])


def make_parts(cfg, *, runtime=None, wrapping=None, learning=("generator", "discriminator"), fence=None, seed=0):
    runtime = runtime or Runtime.local()
    wrapping = wrapping or OneProcess(runtime, cfg.train)
    torch.manual_seed(seed)
    modules = {"generator": mlp(D), "discriminator": mlp(1)}
    parts, frozen = build_parts(
        modules, frozen={}, learning=set(learning), cfg=cfg, device=runtime.device, wrapping=wrapping, fence=fence
    )
    assert frozen == {}
    return parts


def make_runner(cfg, parts, *, runtime=None, wrapping=None, task=None) -> StepRunner:
    runtime = runtime or Runtime.local()
    wrapping = wrapping or OneProcess(runtime, cfg.train)
    return StepRunner(
        task=task or TwoPartTask(),
        parts=parts,
        frozen={},
        cfg=cfg,
        runtime=runtime,
        no_sync=wrapping.no_sync,
    )


def make_batch(n: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "images": torch.randn(n, 1, 2, 2, generator=g),
        "labels": torch.full((n,), -1),
        "indices": torch.arange(n),
        "positions": list(range(n)),
        "valid": torch.ones(n),
        "skipped": 0,
    }


def state_of(part: Part) -> list[torch.Tensor]:
    """Copies of everything an optimizer step changes: parameters, EMA weights, optimizer state."""
    return [t.detach().clone() for t in part.stable_tensors()]


# ---------------------------------------------------------------------------------------------- the step


def per_sample_gradient_magnitudes(module: nn.Module, batch: dict, rank_batch: int) -> list[torch.Tensor]:
    """sum_i |g_i| per parameter entry, in float64: g_i the gradient of sample i's share of the loss."""
    ref = mlp(D).double()
    ref.load_state_dict(module.state_dict())
    x = batch["images"].flatten(1).double()
    total = [torch.zeros_like(p) for p in ref.parameters()]
    for i in range(len(x)):
        ref.zero_grad()
        loss = ((ref(x[i : i + 1]) - target(x[i : i + 1])) ** 2).mean() / rank_batch
        loss.backward()
        for t, p in zip(total, ref.parameters(), strict=True):
            t += p.grad.abs()
    return total


@pytest.mark.parametrize(
    "split, k",
    [
        (("train.grad_accum=4",), 4),
        (("train.micro_batch_size=2",), 4),
        (("train.grad_accum=2", "train.micro_batch_size=1"), 8),
    ],
    ids=["accum4", "micro2", "accum2-micro1"],
)
def test_k_chunks_accumulate_the_gradient_of_one_big_batch(split, k):
    batch = make_batch(8)
    grads, chunks = {}, {}
    for name, overrides in (("whole", ()), ("split", split)):
        cfg = config(*overrides)
        parts = make_parts(cfg)
        runner = make_runner(cfg, parts)
        runner.accumulate(batch, 0, TwoPartTask().phases(0, {}))
        grads[name] = [p.grad.clone() for p in parts["generator"].module.parameters()]
        chunks[name] = len(list(runner.chunks(batch)))
    assert chunks == {"whole": 1, "split": k}

    # The bound: every entry is a float32 sum of the 8 samples' gradients, each itself computed through
    # dot products of at most HIDDEN terms and a few elementwise steps; by the standard summation bound
    # (Higham, Accuracy and Stability, 3.1) each side is within gamma_n * sum_i |g_i| of the exact value,
    # n the longest chain of roundings (batch + HIDDEN + D + 8 for the elementwise ops), so the two sides
    # differ by at most twice that. Chunking changes only the order of these roundings.
    n = 8 + HIDDEN + D + 8
    gamma = n * U32 / (1 - n * U32)
    magnitudes = per_sample_gradient_magnitudes(make_parts(config())["generator"].module, batch, rank_batch=8)
    for whole, split_grad, mag in zip(grads["whole"], grads["split"], magnitudes, strict=True):
        bound = 2 * gamma * mag.float()
        assert torch.all((whole - split_grad).abs() <= bound), (whole - split_grad).abs().max()
        assert torch.all(whole != 0)  # the comparison is about real gradients


def test_a_part_past_its_own_max_steps_is_not_stepped():
    cfg = config("optim.discriminator.max_steps=1")
    parts = make_parts(cfg)
    runner = make_runner(cfg, parts)
    first = runner.run(make_batch(8), 0)
    assert "discriminator/loss" in first and parts["discriminator"].step == 1
    disc = parts["discriminator"]
    before, lr = state_of(disc), disc.lr

    logs = runner.run(make_batch(8, seed=1), 1)
    assert "generator/loss" in logs and not any(k.startswith("discriminator/") for k in logs)
    assert (parts["generator"].step, disc.step) == (2, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, state_of(disc), strict=True))
    assert disc.lr == lr and disc.lr_schedule.last_epoch == 1
    assert not disc.learns_now() and parts["generator"].learns_now()


class RecordingAccelerator:
    """accelerate's two calls DDP wrapping makes: the wrapper (a marker module) and no_sync (recorded)."""

    def __init__(self, events: list):
        self.events = events
        self.inside: set[nn.Module] = set()

    def prepare_model(self, module: nn.Module) -> nn.Module:
        return Wrapped(module)

    @contextlib.contextmanager
    def no_sync(self, wrapped: nn.Module):
        self.inside.add(wrapped)
        try:
            yield
        finally:
            self.inside.discard(wrapped)


class Wrapped(nn.Module):
    def __init__(self, module: nn.Module):
        super().__init__()
        self.inner = module

    def forward(self, *args):
        return self.inner(*args)


def ddp_runtime(accelerator) -> Runtime:
    return Runtime(DistEnv(rank=0, world_size=2), torch.device("cpu"), "no", "ddp", 0, accelerator)


def test_no_sync_wraps_every_chunk_but_the_steps_last_for_every_learning_part():
    cfg = config("train.grad_accum=2", "train.micro_batch_size=1")  # rank batch 4: four chunks of one
    events: list = []
    accelerator = RecordingAccelerator(events)
    runtime = ddp_runtime(accelerator)
    wrapping = wrapping_for(runtime, cfg.train)
    assert isinstance(wrapping, DataParallel)
    parts = make_parts(cfg, runtime=runtime, wrapping=wrapping)

    inside_per_forward = []

    class Task(TwoPartTask):
        def forward(self, modules, batch, step):
            inside_per_forward.append({n for n, p in parts.items() if p.wrapped in accelerator.inside})
            return super().forward(modules, batch, step)

    runner = make_runner(cfg, parts, runtime=runtime, wrapping=wrapping, task=Task())
    runner.run(make_batch(4), 0)  # this rank's half of the global batch of 8
    both = {"generator", "discriminator"}
    assert inside_per_forward == [both, both, both, set()]
    assert all(isinstance(p.wrapped, Wrapped) for p in parts.values())


def test_the_lr_schedule_and_ema_advance_once_per_optimizer_step_whatever_the_chunks():
    cfg = config("train.grad_accum=4", "train.warmup_steps=4")
    parts = make_parts(cfg)
    runner = make_runner(cfg, parts)
    for n in (1, 2, 3):
        runner.run(make_batch(8, seed=n), n - 1)
        for part in parts.values():
            assert part.step == n
            assert part.lr_schedule.last_epoch == n
            assert math.isclose(part.lr, part.settings.lr * n / 4, rel_tol=1e-12)  # linear warmup
            assert part.ema.optimization_step == n
            assert all(int(s["step"]) == n for s in part.optimizer.state.values())


def test_learns_now_and_parts_this_run_keeps():
    cfg = config("optim.generator.max_steps=2")
    runtime = ddp_runtime(RecordingAccelerator([]))
    wrapping = wrapping_for(runtime, cfg.train)
    parts = make_parts(cfg, runtime=runtime, wrapping=wrapping, learning=("generator",))
    gen, disc = parts["generator"], parts["discriminator"]
    # A kept part is never wrapped; a task sees the wrapper only for parts that learn in the phase.
    assert isinstance(gen.wrapped, Wrapped) and disc.wrapped is disc.module
    view = ModuleView(parts, {}, {"generator"})
    assert view["generator"] is gen.wrapped and view["discriminator"] is disc.module
    assert view.bare("generator") is gen.module

    assert (gen.learning, disc.learning) == (True, False)
    assert gen.learns_now() and not disc.learns_now()
    kept = state_of(disc)
    runner = make_runner(cfg, parts, runtime=runtime, wrapping=wrapping)
    for step in range(3):
        logs = runner.run(make_batch(4, seed=step), step)
        assert not any(k.startswith("discriminator/") for k in logs)
    assert gen.step == 2 and not gen.learns_now()  # its own max steps reached: stepped no more
    assert disc.step == 0 and all(p.grad is None for p in disc.module.parameters())
    assert all(torch.equal(a, b) for a, b in zip(kept, state_of(disc), strict=True))


def test_every_part_waits_on_the_fence_it_was_built_with_before_changing_state():
    cfg = config()
    calls = []
    parts = make_parts(cfg, fence=lambda: calls.append(1))
    make_runner(cfg, parts).run(make_batch(8), 0)
    assert len(calls) == 2  # one optimizer step per part
    assert make_parts(cfg)["generator"].fence() is None  # none given: nothing to wait for


# ---------------------------------------------------------------------------------------------- runtime, wrapping


def test_parallel_mode_and_the_wrapping_it_picks():
    assert parallel_mode("fsdp", 1) == "none" and parallel_mode("ddp", 1) == "none"
    assert parallel_mode("ddp", 4) == "ddp" and parallel_mode("fsdp", 4) == "fsdp"
    cfg = config()
    cpu = torch.device("cpu")
    kinds = {"none": OneProcess, "ddp": DataParallel, "fsdp": FullySharded}
    for parallel, kind in kinds.items():
        runtime = Runtime(DistEnv(world_size=1 if parallel == "none" else 2), cpu, "no", parallel, 0)
        assert type(wrapping_for(runtime, cfg.train)) is kind
        assert runtime.sharded == (parallel == "fsdp")
    with pytest.raises(dataclasses.FrozenInstanceError):
        Runtime.local().seed = 1


def test_fsdp_refuses_what_it_cannot_shard_by_name():
    cfg = config()
    runtime = Runtime(DistEnv(world_size=2), torch.device("cpu"), "no", "fsdp", 0)
    wrapping = FullySharded(runtime, cfg.train)
    modules = {"generator": mlp(D)}

    class Refusing:
        def fsdp_refusal(self):
            return "a loss computed from a whole chunk's gradients"

    class Fine:
        def fsdp_refusal(self):
            return None

    with pytest.raises(ConfigError, match="^train.parallel=fsdp: a loss computed"):
        wrapping.check_supported(Refusing(), modules, ["generator"])
    wrapping.check_supported(Fine(), modules, ["generator"])
    # LoRA adapters on a sharded base train (tests/test_pipeline_fsdp.py): no refusal; LoRA-trained text
    # encoders (children of the part called on their own) are refused, naming the key
    peft = pytest.importorskip("peft")
    adapted = peft.inject_adapter_in_model(peft.LoraConfig(r=2, target_modules=["0"]), mlp(D))
    wrapping.check_supported(Fine(), {"generator": adapted}, ["generator"])
    adapted.add_module("text_encoder", mlp(D))
    with pytest.raises(ConfigError, match=r"^model.lora.text_encoder=true \(LoRA on text_encoder\) is not supported"):
        wrapping.check_supported(Fine(), {"generator": adapted}, ["generator"])
    wrapping.check_supported(Fine(), {"generator": adapted}, [])  # a part this run does not train is not sharded


# ---------------------------------------------------------------------------------------------- frozen records

SECRET = "hunter2-secret"
STORE = "store.example:9000"


def frozen_record(digest: str = "ab") -> FrozenRecord:
    """What load_frozen records for a part whose source URL carries credentials."""
    return FrozenRecord(
        url=f"s3://alice:{SECRET}@{STORE}/bucket/encoder/step-000000003",
        step=3,
        file="unet.ema.safetensors",
        digest="blake3:" + digest * 32,
    )


def checkpoint_manager(cfg, digest: str = "ab", seed: int = 0):
    runtime = Runtime.local()
    metrics = TrainingMetrics(env=runtime.env, port=0, host="127.0.0.1", task=cfg.task, version=__version__)
    manager = CheckpointManager(cfg, runtime, metrics)
    parts = make_parts(cfg, fence=manager.fence, seed=seed)
    progress = TrainProgress(batch_size=8, epoch_size=100, world_size=1, seed=cfg.seed)
    manager.attach(progress, parts, {"encoder": frozen_record(digest)})
    return manager, parts, progress


def test_frozen_records_are_stored_redacted_and_a_resume_matches_them_by_digest(tmp_path):
    cfg = config(f"run.dir={tmp_path}/run")
    manager, parts, progress = checkpoint_manager(cfg)
    make_runner(cfg, parts).run(make_batch(8), 0)
    progress.advance(0)
    assert manager.save(1, sync=True)
    manager.close()
    step_dir = tmp_path / "run" / "checkpoints" / "step-000000001"
    for name in ("trainer.json", "manifest.json"):
        assert SECRET not in (step_dir / name).read_text(), name
    stored = json.loads((step_dir / "trainer.json").read_text())["frozen"]["encoder"]
    assert stored == {**frozen_record().model_dump(), "url": f"s3://{REDACTED}@{STORE}/bucket/encoder/step-000000003"}

    # The pinned record gets the credentials this run's config gives for the same store (for opening
    # the pinned step when the source run has moved on); another store's are not handed over.
    again, resumed, _ = checkpoint_manager(cfg, seed=1)
    pinned = again.pinned_frozen_sources({"encoder": f"s3://alice:rotated@{STORE}/bucket/encoder"})
    assert pinned["encoder"].url == f"s3://alice:rotated@{STORE}/bucket/encoder/step-000000003"
    assert pinned["encoder"].digest == frozen_record().digest
    elsewhere = again.pinned_frozen_sources({"encoder": f"s3://bob:{SECRET}@other.example/bucket/encoder"})
    assert elsewhere["encoder"].url == stored["url"]

    # Same frozen weights (the record as loaded, credentials and all): the checkpoint is resumed.
    assert again.resume() == str(step_dir)
    for saved, loaded in zip(parts.values(), resumed.values(), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(state_of(saved), state_of(loaded), strict=True))
    again.close()

    # Other frozen weights: the checkpoint does not fit, nothing is resumed.
    other, _, _ = checkpoint_manager(cfg, digest="cd")
    assert other.resume() is None
    other.close()


# ---------------------------------------------------------------------------------------------- trackers


@pytest.mark.slow
@pytest.mark.parametrize(
    ("setting", "tracker"), [("log.tensorboard=true", "tensorboard"), ("log.report_to=wandb", "wandb")]
)
def test_a_tracker_whose_package_cannot_be_imported_exits_2_naming_the_extra(tmp_path, setting, tracker):
    # A package that is found (find_spec, the metadata of a real install may even exist) but fails to
    # import, like a broken or half-installed one: accelerate would drop the tracker without a word.
    shadow = tmp_path / "shadow" / tracker
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("broken install (shadowed by the test)")\n')
    env = clean_env(PYTHONPATH=str(tmp_path / "shadow"))
    r = run_cli("train", *tiny(tmp_path, setting, max_steps=2), env=env)
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert f"log.report_to names {tracker}" in last and "pip install 'gentrain[trackers]'" in last, r.stderr[-3000:]
    assert "broken install" in last and "Traceback" not in r.stderr
    assert "step=" not in r.stderr and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(
    ("value", "names"),
    [
        ("[]", []),
        ("tensorboard", ["tensorboard"]),
        ("[mlflow, tensorboard, mlflow]", ["tensorboard", "mlflow"]),
        ("wandb,mlflow", ["wandb", "mlflow"]),
        ("none", []),
    ],
)
def test_report_to_takes_a_name_or_a_list_and_the_old_switches_are_aliases(value, names):
    assert load_config(None, [f"log.report_to={value}"]).log.trackers == names
    both = load_config(None, ["log.report_to=mlflow", "log.tensorboard=true", "log.wandb=true"]).log
    assert both.trackers == ["tensorboard", "wandb", "mlflow"] and not both.all_installed
    with pytest.raises(ConfigError, match="comet"):
        load_config(None, ["log.report_to=[tensorboard, comet]"])


def test_a_missing_tracker_is_refused_by_name_and_all_takes_those_installed(monkeypatch):
    import trainer.engine.report as report

    installed = {"tensorboard"}

    def fake_import(module):
        if module.split(".")[0] not in installed and "tensorboard" not in module:
            raise ImportError(f"No module named {module!r}")

    cfg = load_config(None, ["log.report_to=[tensorboard, mlflow]"]).log
    every = load_config(None, ["log.report_to=all"]).log
    monkeypatch.setattr(report.importlib, "import_module", fake_import)  # importlib's own: configs loaded first
    monkeypatch.setattr(report, "get_available_trackers", lambda: sorted(installed))
    monkeypatch.setattr(report, "_check_mlflow_store", lambda: None)  # the next test's: it imports mlflow
    with pytest.raises(ConfigError, match=r"names mlflow.*No module named 'mlflow'.*gentrain\[trackers\]"):
        report.tracker_names(cfg)
    assert report.tracker_names(every) == ["tensorboard"]
    installed.add("mlflow")
    assert report.tracker_names(cfg) == ["tensorboard", "mlflow"]
    # Importable but without the metadata accelerate looks for: accelerate would drop it silently.
    monkeypatch.setattr(report, "get_available_trackers", lambda: ["tensorboard"])
    with pytest.raises(ConfigError, match="accelerate does not find it installed"):
        report.tracker_names(cfg)


def test_tracker_run_ids_travel_in_the_progress_state_and_only_ids_are_taken_back():
    progress = TrainProgress(batch_size=4, epoch_size=16, world_size=1, seed=0)
    progress.trackers = {"wandb": "0123abcd", "mlflow": "d8d1e070b11c4f7287f1fb0fed057ed2"}
    state = json.loads(json.dumps(progress.state_dict()))
    again = TrainProgress(batch_size=4, epoch_size=16, world_size=1, seed=0)
    again.load_state_dict(state)
    assert again.trackers == progress.trackers
    state["trackers"] = {"wandb": "../../etc", "mlflow": ["x"], "comet": "abc"}
    again.load_state_dict(state)
    assert again.trackers == {}
    del state["trackers"]  # a checkpoint written before they were recorded
    again.load_state_dict(state)
    assert again.trackers == {}


def test_an_mlflow_tracking_store_that_cannot_be_opened_is_refused_at_start(monkeypatch, tmp_path):
    pytest.importorskip("mlflow")
    import trainer.engine.report as report

    cfg = load_config(None, ["log.report_to=mlflow"]).log
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "bogus://nowhere")
    with pytest.raises(ConfigError, match="tracking store 'bogus://nowhere' cannot be opened.*MLFLOW_TRACKING_URI"):
        report.tracker_names(cfg)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path}/mlruns")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert report.tracker_names(cfg) == ["mlflow"]


# ---------------------------------------------------------------------------------------------- run.dir upload


def test_run_dir_is_copied_beside_the_checkpoints_new_and_changed_files_only(tmp_path):
    from trainer.engine.upload import RunDirUploader, run_dir_uploader

    run = tmp_path / "run"
    (run / "samples").mkdir(parents=True)
    (run / "samples" / "step-000000002.png").write_bytes(b"png")
    (run / "ledger").mkdir()
    (run / "ledger" / "rank-0.jsonl").write_text('{"step": 1}\n')
    dest = tmp_path / "bucket" / "ckpts"
    up = RunDirUploader(str(run), f"file://{dest}")
    assert up.sync() == 2 and up.sync() == 0
    (run / "ledger" / "rank-0.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    assert up.sync() == 1
    assert (dest / "run" / "ledger" / "rank-0.jsonl").read_text().count("step") == 2
    assert (dest / "run" / "samples" / "step-000000002.png").read_bytes() == b"png"
    up.close()  # the last copy, in its thread: nothing new
    # Off by default; with the checkpoints inside run.dir there is nothing to copy them to.
    assert run_dir_uploader(load_config(None, [f"run.dir={run}"])) is None
    assert run_dir_uploader(load_config(None, [f"run.dir={run}", "log.upload_run_dir=true"])) is None
    on = run_dir_uploader(load_config(None, [f"run.dir={run}", "log.upload_run_dir=true", f"checkpoint.url={dest}"]))
    assert on is not None and on.dest.endswith("ckpts/run")


def test_a_preview_prompts_with_the_held_out_captions_cycled_to_its_number_of_samples():
    from contextlib import nullcontext

    from trainer.tasks.base import Batch, PreviewContext

    def context(captions: list[str] | None, num: int) -> PreviewContext:
        n = len(captions or [1])
        images, labels = torch.zeros(n, 1, 2, 2), torch.zeros(n, dtype=torch.long)
        batch = Batch(images, labels, torch.arange(n), list(range(n)), captions=captions)
        return PreviewContext(batch, num, 0, torch.device("cpu"), {}, True, lambda ema: nullcontext())

    assert context(["a 1", "a 2"], 5).held_out_prompts() == ["a 1", "a 2", "a 1", "a 2", "a 1"]
    assert context(None, 3).held_out_prompts() is None
    assert (
        PreviewContext(None, 3, 0, torch.device("cpu"), {}, True, lambda ema: nullcontext()).held_out_prompts() is None
    )
