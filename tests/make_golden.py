"""Write the golden checkpoints and their expected outputs under tests/golden/<case>/ (tests/test_golden.py reads them).

Each case is a shipped preset shrunk to a tiny model (a few thousand parameters, 8x8 images) and trained
2 steps in process, exactly as `gentrain train PRESET key=value ...` would. Then, from that checkpoint:

- `samples/ema`, `samples/raw`: what `gentrain sample` draws (EMA and --no-ema weights) for a fixed seed,
  sampler, step count and guidance scale, as float32 tensors in [0, 1] (not a PNG: exact values);
- `step3/<part>.model/<key>`: each part's weights one resumed step later (step 3; the EMA and optimizer
  state are not stored again, to keep the goldens small: the resumed step depends on them all).

Files per case:
    tests/golden/<case>/checkpoints/step-000000002/   the checkpoint as the trainer wrote it
    tests/golden/<case>/expected.safetensors          the tensors above, metadata: how they were made
    tests/golden/<case>/machine.json                  the CPU and torch build that computed them (`machine()`)

machine.json is what decides whether tests/test_golden.py may demand bit-identical tensors: float32
kernels give the same bits only on the same CPU (vendor, family, model, stepping, feature flags) with the
same torch build and thread count. torch's CPU capability alone ("AVX512") names an Intel Xeon and an AMD
EPYC alike, whose kernels sum in other orders. The goldens of commit 5a0b3da predate the file: their
machine.json says "unknown" for the CPU (see its note), so they are compared within bounds everywhere.

The goldens pin behaviour across code changes: they were written before the ddpm and cascade tasks moved
onto trainer/diffusion (issue 25), so tests/test_golden.py proves that checkpoints written before the move
still load, sample the same images for the same seed and resume to the same weights. Regenerate only
when a change of behaviour is intended (and say so in the commit):

    PYTHONPATH=$PWD python tests/make_golden.py [CASE ...]     # from the repository root; all cases by default

The run takes about 15 seconds on one CPU core.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden"
STEPS = 2  # trained steps in the golden checkpoint; the resume test trains one more

# Shared by every case: one thread, no validation, one checkpoint at the end, a tiny preview.
COMMON = [
    "data.image_size=8",
    "train.batch_size=4",
    "train.warmup_steps=2",
    "train.log_every_steps=1",
    "train.val_every_steps=0",
    "train.threads=1",
    "checkpoint.every_steps=0",
    "sample.every_steps=0",
    "sample.num=2",
    "sample.inference_steps=2",
]

_TINY_UNET = "block_out_channels: [8], norm_num_groups: 4, attention: false"


@dataclass(frozen=True)
class Case:
    preset: str
    overrides: list[str]
    # `gentrain sample` options: --num, --seed, --steps, --scheduler, --guidance-scale
    sample: dict = field(default_factory=dict)


CASES: dict[str, Case] = {
    # unconditional epsilon UNet, min-SNR weighting, DDIM
    "digits-ddpm": Case(
        "digits-ddpm",
        ["model.block_out_channels=[8]", "model.norm_num_groups=4"],
        {"num": 4, "seed": 5, "inference_steps": 3, "scheduler": "ddim", "guidance_scale": 1.0},
    ),
    # class-conditional v-prediction with attention, classifier-free guidance, DPM-Solver
    "digits-cfg": Case(
        "digits-cfg",
        ["model.block_out_channels=[8]", "model.norm_num_groups=4"],
        {"num": 4, "seed": 6, "inference_steps": 3, "scheduler": "dpm", "guidance_scale": 2.0},
    ),
    # the class-conditional cascade, three stages 4 -> 6 -> 8, one per objective family: v-prediction,
    # rectified flow, EDM; guided
    "digits-cascade": Case(
        "digits-cascade",
        [
            f"model.stages=[{{image_size: 4, {_TINY_UNET}, prediction_type: v_prediction}}, "
            f"{{image_size: 6, {_TINY_UNET}, prediction_type: flow, noise_aug_max: 0.3}}, "
            f"{{image_size: 8, {_TINY_UNET}, prediction_type: edm}}]"
        ],
        {"num": 4, "seed": 7, "inference_steps": 3, "scheduler": "dpm", "guidance_scale": 1.5},
    ),
}


def config(name: str, root: Path, max_steps: int):
    """The case's config, its run under `root` (checkpoints in root/checkpoints)."""
    # Imports torch and the engine: the module doc must stay importable cheaply by the test collector.
    from trainer.registry import load_config

    case = CASES[name]
    args = [*COMMON, *case.overrides, f"run.dir={root}", f"train.max_steps={max_steps}"]
    return load_config(case.preset, args, environ={})


def train(name: str, root: Path, max_steps: int) -> None:
    """`gentrain train` in process: a fresh run, or a resume of what root/checkpoints holds."""
    # The engine: only what trains imports it.
    from trainer.elastic import DistEnv
    from trainer.loop import Trainer

    assert Trainer(config(name, root, max_steps), DistEnv()).fit() == 0


def sample(name: str, checkpoints: Path, use_ema: bool) -> torch.Tensor:
    """What `gentrain sample CHECKPOINTS` computes for the case's options (before it writes a PNG)."""
    # The checkpoint layer loads the task: torch-heavy, as in trainer/cli.py.
    from trainer.checkpoint import resolve_checkpoint
    from trainer.runs import load_for_inference
    from trainer.tasks.sampling import SampleRequest

    view = resolve_checkpoint(str(checkpoints), {})
    assert view is not None, f"{checkpoints}: no valid checkpoint"
    _, task, modules = load_for_inference(view, use_ema, torch.device("cpu"))
    request = SampleRequest(**CASES[name].sample, part_steps=view.part_steps())
    return task.sample(modules, request, torch.device("cpu"))


def weight_files(checkpoints: Path, step: int) -> dict[str, dict[str, torch.Tensor]]:
    """Each part's model weights (not its EMA or optimizer state) in the checkpoint at `step`."""
    # The checkpoint layer: torch-heavy, as above.
    from trainer.checkpoint import CheckpointStore

    store = CheckpointStore(str(checkpoints))
    info = store.check(step)
    assert info.valid, info.reason
    names = [n for n in info.manifest.files if n.endswith(".model.safetensors")]
    return {n.removesuffix(".safetensors"): store.read_tensors(info, n) for n in names}


MACHINE_JSON = "machine.json"
UNKNOWN = "unknown"


def machine() -> dict[str, str | int]:
    """What decides the bits of a float32 result on CPU: the processor (from /proc/cpuinfo on Linux;
    "unknown" elsewhere, which never counts as the same machine), torch's build and kernel choice, and
    the intra-op thread count."""
    cpu = {"vendor_id": UNKNOWN, "model name": UNKNOWN, "cpu family": UNKNOWN, "model": UNKNOWN}
    cpu |= {"stepping": UNKNOWN, "flags": ""}
    with contextlib.suppress(OSError):
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]  # the first logical processor
        for line in first.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in cpu:
                cpu[key.strip()] = value.strip()
    flags = " ".join(sorted(set(cpu["flags"].split())))
    return {
        "cpu_vendor": cpu["vendor_id"],
        "cpu_model_name": cpu["model name"],
        "cpu_family_model_stepping": f"{cpu['cpu family']}/{cpu['model']}/{cpu['stepping']}",
        # the instruction sets the kernels may dispatch on (a VM may hide some from a model it names)
        "cpu_flags_sha256": hashlib.sha256(flags.encode()).hexdigest()[:16] if flags else UNKNOWN,
        "machine": platform.machine() or UNKNOWN,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def recorded_machine(name: str, root: Path = GOLDEN) -> dict:
    """The machine.json of a case (missing: an unknown machine)."""
    path = root / name / MACHINE_JSON
    return json.loads(path.read_text()) if path.is_file() else {"cpu_model_name": UNKNOWN}


@contextlib.contextmanager
def _cwd(path: str):
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def make(name: str, root: Path = GOLDEN) -> None:
    out = root / name
    with tempfile.TemporaryDirectory() as tmp, _cwd(tmp):
        run = Path("run")  # relative: the manifest's run.dir names no temporary folder
        train(name, run, STEPS)
        if out.exists():
            shutil.rmtree(out)
        (out / "checkpoints").mkdir(parents=True)
        step_dir = f"step-{STEPS:09d}"
        shutil.copytree(run / "checkpoints" / step_dir, out / "checkpoints" / step_dir)
        expected = {f"samples/{w}": sample(name, out / "checkpoints", w == "ema") for w in ("ema", "raw")}
        resumed = Path("resumed")
        shutil.copytree(out / "checkpoints", resumed / "checkpoints")
        train(name, resumed, STEPS + 1)
        for file, tensors in weight_files(resumed / "checkpoints", STEPS + 1).items():
            expected.update({f"step{STEPS + 1}/{file}/{k}": v.contiguous() for k, v in tensors.items()})
    meta = {
        "case": name,
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "recipe": json.dumps({"preset": CASES[name].preset, "overrides": [*COMMON, *CASES[name].overrides]}),
        "sample": json.dumps(CASES[name].sample),
    }
    save_file(expected, str(out / "expected.safetensors"), metadata=meta)
    (out / MACHINE_JSON).write_text(json.dumps(machine(), indent=1) + "\n")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"{name}: {len(expected)} tensors, {size / 1024:.0f} KiB in {out}")


def expected(name: str, root: Path = GOLDEN) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The stored tensors of a case and their metadata."""
    path = root / name / "expected.safetensors"
    # safe_open's metadata: the machine and recipe that wrote the goldens
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    return load_file(str(path)), meta


if __name__ == "__main__":
    torch.set_num_threads(1)
    for case_name in sys.argv[1:] or list(CASES):
        make(case_name)
