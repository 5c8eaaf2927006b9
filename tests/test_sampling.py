"""The sampling contract (trainer/tasks/sampling.py): each task family declares the request options its
`sample` reads, from its config, and `check_request` is the one refusal (exit 2) naming the user's flags and
what the checkpoint accepts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, run_cli

from trainer.errors import ConfigError
from trainer.registry import load_config, task_class
from trainer.tasks import base_maskgit, cascade, ddpm
from trainer.tasks.base import TaskContext
from trainer.tasks.sampling import OPTIONS, SampleRequest, check_request

GOLDEN = REPO / "tests" / "golden"

EVERY_OPTION = {
    "inference_steps": 3,
    "scheduler": "dpm",
    "guidance_scale": 2.0,
    "labels": torch.zeros(2, dtype=torch.long),
    "prompts": ["a seven"],
    "image_embeds": torch.zeros(64),
    "stop_at_stage": 1,
    "frames": 1,
    "temperature": 0.5,
    "batch_size": 1,
    "height": 16,
    "width": 16,
    "choice_temperature": 1.0,
}


@pytest.fixture(autouse=True)
def _no_text_encoder(monkeypatch):
    """Declarations come from the config alone: a stand-in for the (slow to load) sentence encoder."""
    for module in (ddpm, cascade, base_maskgit):
        monkeypatch.setattr(module, "TextEncoder", lambda cfg, storage_options=None: SimpleNamespace(cfg=cfg))


def task_of(preset: str, *overrides: str):
    """The task of a preset's config (not built: `sample_accepts` reads the config only)."""
    cfg = load_config(preset, list(overrides), environ={})
    d = cfg.data
    return task_class(cfg.task)(cfg.model_cfg, TaskContext(d.image_size, d.channels, 0, num_frames=d.num_frames))


def refusal(task, what: str, **options) -> str:
    with pytest.raises(ConfigError) as e:
        check_request(SampleRequest(num=2, **options), task.sample_accepts(), what)
    return str(e.value)


def test_every_request_option_has_a_flag_and_a_field():
    fields = set(SampleRequest.__dataclass_fields__)
    assert set(OPTIONS) <= fields and set(EVERY_OPTION) == set(OPTIONS)
    request = SampleRequest(num=2, **EVERY_OPTION)
    assert request.given() == list(OPTIONS)
    assert SampleRequest(num=2).given() == []


def test_an_unconditional_ddpm_takes_the_sampler_settings_only():
    task = task_of("digits-ddpm")
    assert task.sample_accepts() == {"inference_steps", "scheduler"}
    check_request(SampleRequest(num=2, inference_steps=3, scheduler="dpm"), task.sample_accepts(), "ddpm")
    message = refusal(task, "ddpm", labels=torch.zeros(2, dtype=torch.long))
    assert message.startswith("--class: this ddpm checkpoint is unconditional and does not take it; ")
    assert "it accepts --steps, --scheduler " in message
    assert refusal(task, "ddpm", temperature=1.0).startswith("--temperature: this ddpm checkpoint is unconditional")
    # Guidance mixes a conditional and an unconditional prediction: nothing to guide here.
    assert refusal(task, "ddpm", guidance_scale=3.0).startswith("--guidance-scale: ")
    # Every refused flag at once, in the parser's order.
    assert refusal(task, "ddpm", frames=2, batch_size=4, prompts=["x"]).startswith(
        "--prompt, --frames, --batch-size: this ddpm checkpoint is unconditional and does not take them; "
    )


def test_a_class_conditional_ddpm_takes_classes_and_guidance_but_no_temperature():
    task = task_of("digits-cfg")
    assert task.sample_accepts() == {"inference_steps", "scheduler", "guidance_scale", "labels"}
    check_request(SampleRequest(num=2, labels=torch.full((2,), 7), guidance_scale=3.0), task.sample_accepts(), "ddpm")
    message = refusal(task, "ddpm", temperature=1.0)
    assert message.startswith("--temperature: this ddpm checkpoint is conditioned on class labels")
    assert "it accepts --steps, --scheduler, --guidance-scale, --class " in message
    assert refusal(task, "ddpm", prompts=["a seven"]).startswith("--prompt: ")


def test_a_captioned_ddpm_takes_prompts_not_classes():
    backbone = "model.backbone={kind: pixart, num_layers: 1, num_attention_heads: 2, attention_head_dim: 8, caption_channels: 384}"
    task = task_of("digits-ddpm", backbone, "model.text={}", "model.num_classes=null")
    assert task.sample_accepts() == {"inference_steps", "scheduler", "guidance_scale", "prompts"}
    assert "conditioned on captions" in refusal(task, "ddpm", labels=torch.zeros(2, dtype=torch.long))


def test_maskgit_takes_temperature_and_its_conditions_but_no_scheduler_or_frames():
    task = task_of("digits-maskgit")
    accepts = task.sample_accepts()
    assert accepts == {"inference_steps", "temperature", "choice_temperature", "guidance_scale", "labels"}
    check_request(SampleRequest(num=2, temperature=0.5, labels=torch.full((2,), 3)), accepts, "maskgit")
    assert refusal(task, "maskgit", frames=3).startswith("--frames: this maskgit checkpoint is conditioned on")
    assert refusal(task, "maskgit", scheduler="dpm").startswith("--scheduler: ")
    captioned = task_of("digits-maskgit", "model.num_classes=null", "model.text={max_tokens: 4}")
    assert captioned.sample_accepts() == accepts - {"labels"} | {"prompts"}


def test_video_maskgit_takes_frames():
    task = task_of("moving-digits")
    assert {"frames", "temperature", "prompts", "guidance_scale"} <= task.sample_accepts()
    assert "labels" not in task.sample_accepts() and "scheduler" not in task.sample_accepts()


def test_a_cascade_takes_stages_chunks_and_the_conditions_it_was_trained_on():
    base = {"inference_steps", "scheduler", "stop_at_stage", "batch_size", "guidance_scale"}
    assert task_of("digits-cascade").sample_accepts() == base | {"labels"}
    assert task_of("digits-cascade-text").sample_accepts() == base | {"prompts"}
    decoder = task_of("digits-decoder")
    assert decoder.sample_accepts() == base | {"image_embeds"}
    message = refusal(decoder, "cascade", labels=torch.zeros(2, dtype=torch.long), temperature=1.0)
    assert message.startswith("--class, --temperature: this cascade checkpoint is conditioned on image embeddings")
    assert "--stop-at-stage, --batch-size" in message and "--embeddings" in message


@pytest.mark.parametrize("preset", ["digits-vqgan", "digits-autoencoder", "moving-digits-tokenizer"])
def test_tokenizers_and_autoencoders_take_no_sampling_options(preset):
    task = task_of(preset)
    assert task.sample_accepts() == frozenset()
    message = refusal(task, preset, inference_steps=3)
    assert "it accepts none of the sampling options" in message


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("temperature", 0.0, "--temperature 0.0: must be greater than 0"),
        ("inference_steps", 0, "--steps 0: must be at least 1"),
        ("guidance_scale", -1.0, "--guidance-scale -1.0: must be at least 0"),
        ("batch_size", 0, "--batch-size 0: must be at least 1"),
        ("frames", 0, "--frames 0: must be at least 1"),
        ("stop_at_stage", 0, "--stop-at-stage 0: must be at least 1"),
        ("num", 0, "--num 0: must be at least 1"),
    ],
)
def test_values_out_of_range_are_refused_by_the_contract(option, value, message):
    request = SampleRequest(**{"num": 2, option: value})
    with pytest.raises(ConfigError, match=f"^{message}$"):
        check_request(request, set(OPTIONS), "any")


def test_defaults_fill_only_what_the_request_leaves_out():
    request = SampleRequest(num=2, inference_steps=7).with_defaults(inference_steps=50, scheduler="ddim")
    assert (request.inference_steps, request.scheduler, request.guidance_scale) == (7, "ddim", None)
    assert request.option("guidance_scale", 1.0) == 1.0 and request.option("inference_steps", 50) == 7


@pytest.mark.slow
def test_sample_refuses_an_option_the_checkpoint_does_not_take_naming_the_flag_and_what_it_accepts(tmp_path):
    """An unconditional DDPM checkpoint (the golden one: no training here) and --temperature: exit 2, one
    line naming the flag and the options this checkpoint accepts, no traceback, nothing written."""
    out = tmp_path / "grid.png"
    r = run_cli("sample", str(GOLDEN / "digits-ddpm" / "checkpoints"), "--temperature", "1", "--out", str(out))
    assert r.returncode == 2, r.stderr[-3000:]
    assert "--temperature: this ddpm checkpoint is unconditional" in r.stderr
    assert "it accepts --steps, --scheduler" in r.stderr
    assert "Traceback" not in r.stderr and not out.exists()
