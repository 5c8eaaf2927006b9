"""`accelerate launch`'s environment: accelerate never takes precision, accumulation or compilation from
it (gentrain passes its own), and the plugins it would wrap the parts with are refused (exit 2).

The end-to-end check runs in tests/test_elastic.py: its killed 2-rank DDP run has
ACCELERATE_MIXED_PRECISION=bf16 in its environment and still equals the reference run bit for bit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DynamoBackend
from conftest import clean_env, free_port, tiny
from torch import nn

from trainer.accelerate_env import REFUSED_PLUGINS, check_accelerate_env
from trainer.cli import main as cli_main
from trainer.engine.runtime import accelerator_kwargs

LAUNCH_ENV = {
    "ACCELERATE_MIXED_PRECISION": "bf16",
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4",
    "ACCELERATE_DYNAMO_BACKEND": "INDUCTOR",
}


@pytest.fixture
def fresh_accelerate_state():
    """accelerate's state is a process-wide singleton: start from none, leave none behind."""
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


class _SeesAutocast(nn.Linear):
    """Records whether its forward ran under autocast (accelerate casts the output back to float32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.autocast = torch.is_autocast_enabled("cpu")
        return super().forward(x)


def _prepared_forward_autocasts(accelerator: Accelerator) -> bool:
    model = accelerator.prepare_model(_SeesAutocast(4, 4))
    model(torch.randn(2, 4))
    return model.autocast


def test_accelerate_launch_settings_in_the_environment_do_not_reach_the_accelerator(
    monkeypatch, fresh_accelerate_state
):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    # What a bare Accelerator does with that environment: autocast every prepared forward.
    bare = Accelerator(cpu=True)
    assert bare.mixed_precision == "bf16" and bare.gradient_accumulation_steps == 4
    assert _prepared_forward_autocasts(bare)
    AcceleratorState._reset_state(reset_partial_state=True)

    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")  # the bare one would compile (slow)
    ours = Accelerator(**accelerator_kwargs(use_cpu=True))
    assert ours.mixed_precision == "no"
    assert ours.gradient_accumulation_steps == 1
    assert ours.state.dynamo_plugin.backend == DynamoBackend.NO
    assert not _prepared_forward_autocasts(ours)
    warnings = check_accelerate_env(dict(LAUNCH_ENV), cuda=False)
    assert [w.split("=")[0] for w in warnings] == list(LAUNCH_ENV)
    assert "train.precision decides" in warnings[0]


def test_accelerate_launch_defaults_pass_without_a_warning():
    # What `accelerate launch` sets with no config: nothing gentrain would act on differently.
    env = {
        "ACCELERATE_MIXED_PRECISION": "no",
        "ACCELERATE_DYNAMO_BACKEND": "NO",
        "ACCELERATE_USE_CPU": "False",
        "ACCELERATE_USE_FSDP": "false",
    }
    assert check_accelerate_env(env, cuda=True) == []


@pytest.mark.parametrize("key", sorted(REFUSED_PLUGINS))
def test_each_accelerate_plugin_is_refused_by_name(key):
    with pytest.raises(ValueError, match=rf"{key}=true .*torchrun or gentrain launch, or unset them"):
        check_accelerate_env({key: "true"}, cuda=False)


def test_a_cpu_or_device_override_is_refused_only_where_it_would_change_the_device():
    assert check_accelerate_env({"ACCELERATE_USE_CPU": "1"}, cuda=False) == []
    with pytest.raises(ValueError, match="ACCELERATE_USE_CPU=1 on a machine with CUDA"):
        check_accelerate_env({"ACCELERATE_USE_CPU": "1"}, cuda=True)
    with pytest.raises(ValueError, match="ACCELERATE_TORCH_DEVICE=cuda:1"):
        check_accelerate_env({"ACCELERATE_TORCH_DEVICE": "cuda:1"}, cuda=False)


def test_an_mpi_launch_without_torchruns_world_size_is_refused():
    with pytest.raises(ValueError, match="OMPI_COMM_WORLD_SIZE=2 without WORLD_SIZE"):
        check_accelerate_env({"OMPI_COMM_WORLD_SIZE": "2"}, cuda=False)
    assert check_accelerate_env({"PMI_SIZE": "1"}, cuda=False) == []
    assert check_accelerate_env({"PMI_SIZE": "2", "WORLD_SIZE": "2"}, cuda=False) == []


@pytest.mark.parametrize("command", [["train", "digits-ddpm"], ["launch", "--nproc-per-node=1", "--", "digits-ddpm"]])
def test_train_and_launch_exit_2_naming_the_plugin_before_starting(command, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert cli_main([*command, f"run.dir={tmp_path}", "train.max_steps=1"]) == 2
    err = capsys.readouterr().err
    assert "ACCELERATE_USE_FSDP=true" in err and "ACCELERATE_USE_DEEPSPEED=true" in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
def test_accelerate_launch_runs_gentrain_as_torchrun_does(tmp_path):
    """`accelerate launch --multi_gpu` runs torchrun's agent: two ranks train together (DDP, gloo on CPU, as
    gentrain passes cpu=True there), and its --mixed_precision bf16 reaches the workers only as a warning."""
    accelerate = str(Path(sys.executable).parent / "accelerate")
    launch = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    launch += ["--main_process_port", str(free_port()), "--mixed_precision", "bf16", "--dynamo_backend", "no"]
    env = clean_env(HF_HOME=str(tmp_path / "hf"))  # no accelerate config file of the user's
    r = subprocess.run(
        [*launch, "-m", "trainer", "train", *tiny(tmp_path, "sample.num=2", max_steps=2)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    assert "world_size=2" in log and "parallel=ddp" in log, log[-4000:]
    assert "ACCELERATE_MIXED_PRECISION=bf16 is ignored" in log
    assert (tmp_path / "run" / "checkpoints" / "step-000000002").is_dir()
