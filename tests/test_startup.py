"""Start-up imports only what the run uses (issue #37, docs/reliability.md).

Each check runs in a fresh interpreter and reads its `sys.modules`: the commands that only read configs
(`gentrain --help`, `gentrain presets`, `import trainer.config`) import neither torch nor diffusers, and a
digits-ddpm run (no captions, LoRA, DPM sampler, flow objective, FID or clips) trains its first step
without importing transformers, peft or scipy, though all are installed here: diffusers imports each
whenever it is installed from the modules gentrain now avoids (trainer/lazy_packages.py, trainer/ema.py). The replacements for diffusers' training helpers are checked against diffusers' own here.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, clean_env

# Runs `main()` of the CLI with ARGS in this interpreter, then writes the modules it imported to OUT: those
# imported by the first step's end (the start-up a restart pays), for a run, else all at exit.
_DRIVER = """
import json, sys
out, args = sys.argv[1], sys.argv[2:]
code, seen = 0, []
if args == ["import trainer.config"]:
    import trainer.config
else:
    if args[0] == "train":
        import trainer.elastic as elastic
        mark = elastic.StartupClock.mark

        def at_first_step(self, name, last=False):
            if name == "first_step":
                seen.append(sorted(sys.modules))
            return mark(self, name, last)

        elastic.StartupClock.mark = at_first_step
    sys.argv = ["gentrain", *args]
    from trainer.cli import main
    try:
        code = main()
    except SystemExit as e:
        code = e.code
with open(out, "w") as f:
    json.dump({"code": code, "modules": seen[0] if seen else sorted(sys.modules), "at_exit": sorted(sys.modules)}, f)
"""

# torchao too: every diffusers model module imports diffusers' quantizer registry, which imports it whenever
# installed (trainer/lazy_packages.py ON_FIRST_USE defers that registry).
OPTIONAL = ("transformers", "peft", "scipy", "sentence_transformers", "torchmetrics", "av", "torchao")


def _imports(tmp_path, *args: str, timeout: float = 600) -> set[str]:
    """The modules imported by the first step's end (a run) or by exit (else), with their packages."""
    return _modules(_driver(tmp_path, *args, timeout=timeout))


def _modules(result: dict, at_exit: bool = False) -> set[str]:
    modules = result["at_exit" if at_exit else "modules"]
    return {m.split(".")[0] for m in modules} | set(modules)


def _driver(tmp_path, *args: str, timeout: float = 600) -> dict:
    out = tmp_path / "modules.json"
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(out), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=clean_env(),
        cwd=REPO,
    )
    assert proc.returncode == 0 and out.exists(), proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["code"] in (0, None), proc.stderr[-4000:]
    return result


@pytest.mark.slow
@pytest.mark.parametrize("args", [["--help"], ["presets"], ["import trainer.config"]], ids=" ".join)
def test_config_only_commands_import_neither_torch_nor_diffusers(tmp_path, args):
    loaded = _imports(tmp_path, *args, timeout=120)
    assert "trainer" in loaded
    assert not {"torch", "diffusers"} & loaded, f"{' '.join(args)} imported {sorted({'torch', 'diffusers'} & loaded)}"


@pytest.mark.slow
def test_a_digits_ddpm_run_imports_no_optional_stack_it_does_not_use(tmp_path):
    installed = [m for m in ("transformers", "peft", "scipy") if importlib.util.find_spec(m) is not None]
    if not installed:
        pytest.skip("none of transformers, peft, scipy is installed: nothing could pull them in")
    args = (
        "train",
        "digits-ddpm",
        "train.max_steps=1",
        "train.threads=1",
        f"run.dir={tmp_path}/run",
        "checkpoint.lease=false",
        "sample.every_steps=0",
        "sample.num=1",
        "sample.inference_steps=1",
        "train.val_every_steps=0",
    )
    result = _driver(tmp_path, *args)
    loaded = _modules(result)
    assert {"torch", "diffusers", "trainer.tasks.ddpm"} <= loaded  # it did train a step
    assert set(OPTIONAL) & loaded == set(), f"a digits-ddpm run imported {sorted(set(OPTIONAL) & loaded)}"
    # nor by its end, with the DDIM preview drawn: diffusers' DDIMScheduler.from_config would import every
    # scheduler it lists as compatible, scipy with them (trainer/diffusion/objectives.py _same_schedule)
    ended = _modules(result, at_exit=True)
    assert "trainer.engine.preview" in ended and "scipy" not in ended, "the preview imported scipy"
    # one UNet class, not diffusers' hundred models
    assert "diffusers.models.unets.unet_2d" in loaded
    assert not {"diffusers.models.unets.unet_2d_condition", "diffusers.models.transformers.transformer_flux"} & loaded


@pytest.mark.parametrize("objective", ["epsilon", "v_prediction"])
def test_the_ddim_sampler_is_what_diffusers_from_config_builds(objective):
    """objectives._same_schedule (DDIM without the import of every compatible scheduler) builds the sampler
    diffusers' DDIMScheduler.from_config builds from the training scheduler: the same config, the same
    schedule, the same timesteps for a sampling run."""
    from diffusers.schedulers.scheduling_ddim import DDIMScheduler
    from diffusers.schedulers.scheduling_ddpm import DDPMScheduler

    from trainer.diffusion.objectives import _same_schedule

    train = DDPMScheduler(
        num_train_timesteps=200, beta_schedule="squaredcos_cap_v2", prediction_type=objective, clip_sample=False
    )
    ours, theirs = _same_schedule(DDIMScheduler, train.config), DDIMScheduler.from_config(train.config)
    public = lambda c: {k: v for k, v in c.items() if not k.startswith("_")}  # noqa: E731
    assert public(ours.config) == public(theirs.config) and ours.config.prediction_type == objective
    assert torch.equal(ours.alphas_cumprod, theirs.alphas_cumprod)
    ours.set_timesteps(7)
    theirs.set_timesteps(7)
    assert torch.equal(ours.timesteps, theirs.timesteps)


def test_ema_matches_diffusers_bit_for_bit():
    """trainer.ema.EMAModel (gentrain's EMA) is diffusers' EMAModel: the same shadow weights after
    warm-up steps, a frozen parameter copied, the same state, the same refusals of a bad state."""
    from diffusers.training_utils import EMAModel as DiffusersEMA

    from trainer.ema import EMAModel

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    kwargs = dict(decay=0.999, min_decay=0.1, update_after_step=1, use_ema_warmup=True, inv_gamma=1.0, power=0.75)
    for foreach in (True, False):
        ours = EMAModel([*params, frozen], foreach=foreach, **kwargs)
        theirs = DiffusersEMA([*params, frozen], foreach=foreach, **kwargs)
        for step in range(6):
            with torch.no_grad():
                for p in [*params, frozen]:
                    p.add_(torch.randn_like(p))
            ours.step([*params, frozen])
            theirs.step([*params, frozen])
            assert ours.cur_decay_value == theirs.cur_decay_value, step
        for a, b in zip(ours.shadow_params, theirs.shadow_params, strict=True):
            assert torch.equal(a, b)
        mine, ref = ours.state_dict(), theirs.state_dict()
        assert mine.keys() == ref.keys()
        assert {k: v for k, v in mine.items() if k != "shadow_params"} == {
            k: v for k, v in ref.items() if k != "shadow_params"
        }
    for bad in ({"decay": 5.0}, {"min_decay": 0}, {"optimization_step": 1.5}, {"use_ema_warmup": 1}, {"power": "x"}):
        errors = []
        for cls in (EMAModel, DiffusersEMA):
            try:
                cls([torch.nn.Parameter(torch.zeros(1))]).load_state_dict(bad)
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        assert errors[0] is not None and errors[0] == errors[1], bad


def test_loss_weights_match_diffusers():
    """min-SNR's SNR and SD3's weights, computed here, equal diffusers.training_utils' to the bit."""
    from diffusers import DDPMScheduler
    from diffusers.training_utils import compute_loss_weighting_for_sd3 as ref_sd3
    from diffusers.training_utils import compute_snr as ref_snr

    from trainer.diffusion.objectives import compute_loss_weighting_for_sd3, compute_snr

    sched = DDPMScheduler(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2")
    t = torch.tensor([0, 1, 17, 500, 999])
    assert torch.equal(compute_snr(sched, t), ref_snr(sched, t))
    sigmas = torch.rand(7, 1, 1, 1) * 0.98 + 0.01
    for scheme in ("sigma_sqrt", "cosmap", "logit_normal"):
        assert torch.equal(compute_loss_weighting_for_sd3(scheme, sigmas), ref_sd3(scheme, sigmas)), scheme


_LAZY = """
import sys
import trainer
from diffusers.models.unets.unet_2d import UNet2DModel
alone = "diffusers.models.unets.unet_2d_condition" not in sys.modules and "peft" not in sys.modules
import diffusers.models.unets as unets
from diffusers import UNet2DConditionModel
from diffusers.models.transformers import DiTTransformer2DModel
from accelerate import Accelerator
config_alone = "accelerate.commands.config.sagemaker" not in sys.modules
from accelerate.commands.config import get_config_parser  # defined in the package's own __init__
print(alone, unets.UNet2DModel is UNet2DModel, unets.UNet2DConditionModel is UNet2DConditionModel,
      DiTTransformer2DModel.__name__, config_alone, get_config_parser.__module__)
"""


@pytest.mark.slow
def test_a_lazy_package_imports_one_module_and_still_offers_every_name():
    """trainer/lazy_packages.py: importing one UNet module imports no other UNet (nor peft), accelerate does not
    import its `config` command's questions (boto3); asking the package for any name it offers runs its
    `__init__` then, so every name is still there."""
    proc = subprocess.run(
        [sys.executable, "-c", _LAZY], capture_output=True, text=True, timeout=300, env=clean_env(), cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [
        "True",
        "True",
        "True",
        "DiTTransformer2DModel",
        "True",
        "accelerate.commands.config",
    ]


# diffusers' availability flags and versions, as its import_utils computed them when imported (with
# `import trainer` first: under the deferred package table; without: as diffusers alone does).
_FLAGS = """
import importlib.metadata, json, re, sys
if sys.argv[1] == "trainer":
    import trainer
import diffusers.utils.import_utils as iu
flags = {k: v for k, v in vars(iu).items() if re.fullmatch(r"_\\w+_(available|version)", k) and isinstance(v, (bool, str))}
table = iu._package_map
deferred = type(table).__name__ == "_PackageMap" and table._table is None
same = dict(table) == importlib.metadata.packages_distributions()
back = importlib.metadata.packages_distributions.__module__ == "importlib.metadata"
print(json.dumps({"flags": flags, "deferred": deferred, "same_table": same, "real_function_back": back}))
"""


@pytest.mark.slow
def test_diffusers_package_table_is_read_on_first_use_and_every_flag_is_unchanged():
    """trainer/lazy_packages.py PACKAGE_MAP_ON_FIRST_USE: diffusers' import_utils gets a table that is built when
    first read (not at import: 0.19 s of every start), equal to packages_distributions() once read, and every
    availability flag and version it computed is what diffusers computes without gentrain."""

    def flags(mode: str) -> dict:
        proc = subprocess.run(
            [sys.executable, "-c", _FLAGS, mode], capture_output=True, text=True, timeout=300, env=clean_env(), cwd=REPO
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    hooked, plain = flags("trainer"), flags("plain")
    assert hooked["deferred"] and not plain["deferred"]
    assert hooked["same_table"] and plain["same_table"] and hooked["real_function_back"]
    assert len(hooked["flags"]) > 40 and hooked["flags"] == plain["flags"]
