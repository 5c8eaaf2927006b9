"""A stop request cuts previews, validation and FID short: the emergency checkpoint lands at the step reached.

A preview grid of many sampler steps, a long validation or an FID evaluation used to run to its end
after SIGTERM; a 70 s preview outlasted the 25 s grace and the run exited 143 with every step since
the last checkpoint lost. Now samplers check the stop request between their steps, validation and FID
between their batches (trainer.elastic.StopCheck), and the loop goes to the emergency save at once.

The processes here are real `gentrain train` runs (and one under torchrun). The preview test signals
from outside once the log says the preview began (a 1000-step grid: seconds even on a fast machine);
the others use the failpoint GENTRAIN_FAULT_SIGTERM_DURING, which signals the process from inside the
work after its first step, so the signal lands inside it on any machine.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import clean_env, tiny
from elastic_helpers import standalone, start_torchrun
from helpers import final_weights, kill_group, start_cli, wait_for_log

from trainer.elastic import StopRequest, StopRequested
from trainer.tasks.base import TaskContext
from trainer.tasks.cascade import CascadeConfig, CascadeTask, StageConfig
from trainer.tasks.ddpm import DDPMTask, DiffusionModelConfig
from trainer.tasks.maskgit import MaskGITTask
from trainer.tasks.sampling import SampleRequest

CPU = torch.device("cpu")
GRACE_SECONDS = 10
# Bounds the interpreter's start-up of nothing: only the exit after the emergency save. Generous, so a
# loaded machine does not fail the test; the proof that the work was cut is the step and the log.
EXIT_MARGIN_SECONDS = 30
FAULT = "GENTRAIN_FAULT_SIGTERM_DURING"


# ------------------------------------------------------------------ samplers call the check between steps


class Calls:
    """A stop check that counts its calls and raises on call `stop_at` (never when None)."""

    def __init__(self, stop_at: int | None = None):
        self.n = 0
        self.stop_at = stop_at

    def __call__(self) -> None:
        self.n += 1
        if self.n == self.stop_at:
            raise StopRequested("a test's sample", agreed=True)


def _ddpm() -> tuple[DDPMTask, dict]:
    task = DDPMTask(DiffusionModelConfig(block_out_channels=[8, 16], norm_num_groups=4), TaskContext(8, 1, 0))
    torch.manual_seed(0)
    return task, {"unet": task.build({})["unet"].eval()}


def _cascade() -> tuple[CascadeTask, dict]:
    stages = [StageConfig(image_size=size, block_out_channels=[8, 16], norm_num_groups=4) for size in (4, 8)]
    task = CascadeTask(CascadeConfig(stages=stages), TaskContext(8, 1, 0))
    torch.manual_seed(0)
    built = task.build({})
    return task, {k: v.eval() for k, v in built.items()}


def _maskgit() -> tuple[MaskGITTask, dict]:
    """A MaskGIT task whose transformer and tokenizer are stand-ins: the decoding loop is under test."""
    from trainer.registry import load_config

    cfg = load_config("digits-maskgit", ["model.num_classes=null"], environ={})
    task = MaskGITTask(cfg.model_cfg, TaskContext(16, 1, 0))
    task.num_codes, task.grid = 8, 2

    def transformer(x, cond):
        return torch.zeros(*x.shape, task.num_codes)

    tokenizer = SimpleNamespace(decode_indices=lambda t: torch.zeros(len(t), 1, 4, 4))
    return task, {"transformer": transformer, "tokenizer": tokenizer}


@pytest.mark.parametrize(
    "build, steps_per_sample",
    [(_ddpm, lambda s: s), (_cascade, lambda s: 2 * s), (_maskgit, lambda s: s)],
    ids=["ddpm", "cascade-2-stages", "maskgit"],
)
def test_every_sampler_checks_for_a_stop_before_each_step_and_a_check_that_raises_abandons_it(build, steps_per_sample):
    task, modules = build()
    calls = Calls()
    task.sample(modules, SampleRequest(num=2, inference_steps=5, between_steps=calls), CPU)
    assert calls.n == steps_per_sample(5)
    stopping = Calls(stop_at=3)
    with pytest.raises(StopRequested):
        task.sample(modules, SampleRequest(num=2, inference_steps=5, between_steps=stopping), CPU)
    assert stopping.n == 3  # nothing ran after the check that raised


def test_a_local_check_raises_only_once_a_stop_was_requested_and_agreed_on_one_process():
    stop = StopRequest(grace_seconds=5)
    check = stop.checker("a preview at step 3", CPU)
    check()
    check.agree()
    stop._mark(signal.SIGTERM)
    with pytest.raises(StopRequested) as cut:
        check()
    assert cut.value.agreed and "a preview at step 3 cut short" in str(cut.value)
    with pytest.raises(StopRequested):
        check.agree()


# ------------------------------------------------------------------ real runs


def _stopped_run(tmp_path: Path, *extra: str, env: dict[str, str], signal_after: str | None = None):
    """`gentrain train` on the tiny model until stopped; SIGTERM from here once `signal_after` is logged.
    Returns (exit code, seconds from the signal to the exit (None: signalled by the failpoint), log)."""
    args = tiny(tmp_path, f"elastic.grace_seconds={GRACE_SECONDS}", "checkpoint.every_steps=2", *extra, max_steps=1000)
    log = tmp_path / "train.log"
    proc = start_cli("train", *args, env=clean_env(**env), log_path=log)
    took = None
    try:
        if signal_after is not None:
            wait_for_log(log, signal_after, proc)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=600)
        if signal_after is not None:
            took = time.monotonic() - signalled
    finally:
        kill_group(proc)
    return code, took, log.read_text()


def _assert_stopped_at(tmp_path: Path, text: str, code: int, step: int, work: str) -> None:
    assert code == 143, text[-4000:]
    assert f"stop requested: {work} at step {step} cut short" in text, text[-4000:]
    assert f"emergency checkpoint written at step {step}; exiting 143" in text, text[-4000:]
    assert "did not finish within elastic.grace_seconds" not in text
    assert final_weights(f"{tmp_path}/run/checkpoints")["step"] == step  # the step reached, not the last save's


@pytest.mark.slow
def test_sigterm_while_a_long_preview_is_drawn_saves_the_step_reached_within_the_grace(tmp_path):
    # 64 samples x 1000 DDIM steps: seconds on a fast machine, over a minute on a loaded one.
    code, took, text = _stopped_run(
        tmp_path,
        "sample.every_steps=3",
        "sample.num=64",
        "sample.inference_steps=1000",
        env={},
        signal_after="drawing previews at step 3",
    )
    _assert_stopped_at(tmp_path, text, code, 3, "preview")
    assert took <= GRACE_SECONDS + EXIT_MARGIN_SECONDS, f"exit came {took:.1f}s after SIGTERM:\n{text[-3000:]}"
    assert not list((tmp_path / "run" / "samples").glob("step-000000003*")), "the cut preview wrote a grid"


@pytest.mark.slow
def test_sigterm_during_validation_saves_the_step_reached(tmp_path):
    code, _, text = _stopped_run(tmp_path, "train.val_every_steps=3", env={FAULT: "validation"})
    _assert_stopped_at(tmp_path, text, code, 3, "validation")
    assert "validation step=3" not in text


@pytest.mark.slow
def test_sigterm_during_an_fid_evaluation_saves_the_step_reached(tmp_path):
    code, _, text = _stopped_run(tmp_path, "eval.every_steps=3", "eval.num=48", env={FAULT: "evaluation"})
    _assert_stopped_at(tmp_path, text, code, 3, "evaluation")
    assert not (tmp_path / "run" / "checkpoints" / "eval-000000003.json").exists()


@pytest.mark.slow
def test_sigterm_during_the_final_preview_exits_143_keeping_the_final_checkpoint(tmp_path):
    args = tiny(tmp_path, f"elastic.grace_seconds={GRACE_SECONDS}", "sample.inference_steps=50", max_steps=3)
    log = tmp_path / "train.log"
    proc = start_cli("train", *args, env=clean_env(**{FAULT: "preview"}), log_path=log)
    try:
        code = proc.wait(timeout=600)
    finally:
        kill_group(proc)
    text = log.read_text()
    assert code == 143, text[-4000:]
    assert "stop requested: preview at step 3 cut short" in text, text[-4000:]
    assert final_weights(f"{tmp_path}/run/checkpoints")["step"] == 3
    assert not list((tmp_path / "run" / "samples").glob("step-000000003*"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault, work, stop_step",
    [
        # Validation ends in an all-reduce: the ranks agree before it and stop at the step of the validation.
        ("validation:1", "validation", 3),
        # Rank 0 draws previews alone while rank 1 trains on: rank 0 leaves its preview, meets rank 1 in the
        # next step, and the per-step agreement stops both there.
        ("preview:0", "preview", 4),
    ],
    ids=["validation-rank-1", "preview-rank-0"],
)
def test_sigterm_to_one_rank_inside_its_work_stops_both_ranks_together(tmp_path, fault, work, stop_step):
    torchrun = standalone(2)
    args = tiny(
        tmp_path,
        f"elastic.grace_seconds={GRACE_SECONDS}",
        "checkpoint.every_steps=2",
        "train.val_every_steps=3",
        "sample.every_steps=3",
        "sample.inference_steps=50",
        max_steps=1000,
    )
    log = tmp_path / "torchrun.log"
    proc = start_torchrun(torchrun, args, log, **{FAULT: fault})
    try:
        proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"torchrun did not finish:\n{log.read_text()[-4000:]}") from None
    finally:
        kill_group(proc)
    text = log.read_text()
    assert f"stop requested: {work} at step 3 cut short" in text, text[-4000:]
    assert f"emergency checkpoint written at step {stop_step}; exiting 143" in text, text[-4000:]
    assert "did not finish within elastic.grace_seconds" not in text, text[-4000:]
    assert final_weights(f"{tmp_path}/run/checkpoints")["step"] == stop_step
    if work == "validation":
        assert not re.search(r"validation step=3 ", text)
    else:
        assert not list((tmp_path / "run" / "samples").glob("step-000000003*"))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-n", "0", "-q"]))
