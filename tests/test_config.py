"""Config: layers, precedence, and clear errors with exit code 2."""

from __future__ import annotations

import pytest
from conftest import clean_env, run_cli

from trainer.config import parse_overrides
from trainer.errors import ConfigError
from trainer.registry import config_from_dict, load_config


def test_no_preset_means_digits_ddpm():
    cfg = load_config(None, [], environ={})
    assert cfg.name == "digits-ddpm"
    assert cfg.data.source == "digits"
    assert cfg.run_dir == "runs/digits-ddpm"
    assert cfg.checkpoint_url == "runs/digits-ddpm/checkpoints"


def test_values_are_parsed_as_yaml():
    tree = parse_overrides(
        [
            "train.lr=3e-4",
            "model.block_out_channels=[32,64]",
            'checkpoint.storage_options={"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}',
            "ema.enabled=false",
        ]
    )
    assert tree["train"]["lr"] == pytest.approx(3e-4)
    assert tree["model"]["block_out_channels"] == [32, 64]
    assert tree["checkpoint"]["storage_options"]["client_kwargs"]["endpoint_url"] == "http://127.0.0.1:9000"
    assert tree["ema"]["enabled"] is False


def test_precedence_file_then_env_then_arguments(tmp_path):
    f = tmp_path / "my.yaml"
    f.write_text("name: mine\ntrain:\n  lr: 0.1\n  max_steps: 7\ncheckpoint:\n  every_steps: 3\n")
    env = {"GENTRAIN_TRAIN__LR": "0.2", "GENTRAIN_CHECKPOINT__URL": "s3://bucket/run", "GENTRAIN_NAME": "env-name"}
    cfg = load_config(str(f), ["train.lr=0.3"], environ=env)
    assert cfg.train.lr == pytest.approx(0.3)  # argument beats env beats file
    assert cfg.checkpoint.url == "s3://bucket/run"  # env beats default
    assert cfg.name == "env-name"
    assert cfg.train.max_steps == 7  # file beats preset default
    assert cfg.checkpoint.every_steps == 3


def test_async_key_keeps_its_name():
    cfg = load_config(None, ["checkpoint.async=true"], environ={})
    assert cfg.checkpoint.async_ is True
    assert cfg.to_dict()["checkpoint"]["async"] is True


@pytest.mark.parametrize(
    "override, must_mention",
    [
        ("train.lrr=1", ["unknown config key 'train.lrr'", "Known keys in train", "lr"]),
        ("nosuch.key=1", ["unknown config key 'nosuch'"]),
        ("train.lr=fast", ["train.lr", "'fast'", "valid number"]),
        ("train.batch_size=0", ["train.batch_size", "0", "greater than or equal to 1"]),
        ("train.precision=fp8", ["train.precision", "'fp8'", "'no', 'fp16' or 'bf16'"]),
        ("model.prediction_type=x0", ["model.prediction_type", "'x0'", "epsilon"]),
        ("model.unet_size=3", ["unknown config key 'model.unet_size'", "block_out_channels"]),
        ("data.source=folder", ["data.path"]),
        ("task=gan9000", ["task", "gan9000", "ddpm"]),
    ],
)
def test_bad_values_name_key_value_and_what_is_allowed(override, must_mention):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override], environ={})
    for text in must_mention:
        assert text in str(e.value)


def test_bad_environment_variable_is_an_error():
    with pytest.raises(ConfigError, match="unknown config key 'train.nope'"):
        load_config(None, [], environ={"GENTRAIN_TRAIN__NOPE": "1"})
    # Test failpoints, the test suite's settings and what gentrain sets for its workers share the prefix
    # but are no config keys.
    env = {"GENTRAIN_FAULT_STALL_SAVE": "8:1", "GENTRAIN_TEST_FORK": "0", "GENTRAIN_METRICS_DIR": "/tmp/m"}
    assert load_config(None, [], environ=env) == load_config(None, [], environ={})


def test_missing_yaml_file_is_a_clear_error():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("nope.yaml", [], environ={})


@pytest.mark.slow
def test_cli_config_error_exits_2_without_traceback(tmp_path):
    r = run_cli("train", "train.lr=fast", "foo=1", f"run.dir={tmp_path}", timeout=60)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert "train.lr = 'fast'" in r.stderr
    assert "unknown config key 'foo'" in r.stderr


@pytest.mark.slow
def test_cli_env_error_exits_2(tmp_path):
    r = run_cli("train", f"run.dir={tmp_path}", env=clean_env(GENTRAIN_CHECKPOINT__EVERY_STEPS="often"), timeout=60)
    assert r.returncode == 2
    assert "checkpoint.every_steps" in r.stderr


@pytest.mark.slow
def test_cli_presets_lists_each_with_a_line():
    r = run_cli("presets", timeout=60)
    assert r.returncode == 0
    lines = r.stdout.strip().splitlines()
    assert any(line.startswith("digits-ddpm") and "digits" in line[12:] for line in lines)
    assert all(len(line.split(None, 1)) == 2 for line in lines)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("train.batch_size=100000000000000000000000", "train.batch_size"),
        ("model.block_out_channels=[32,100000000000000000000000]", "model.block_out_channels.1"),
        ("seed=-9223372036854775809", "seed"),
    ],
)
def test_an_integer_beyond_64_bits_is_refused_naming_its_key(override, key):
    # Such a value once ended as an OverflowError traceback in a model constructor, or a sampler that never
    # finished; a checkpoint manifest's config (config_from_dict) is held to the same rule.
    with pytest.raises(ConfigError, match=rf"{key} = -?\d+ is not allowed: config integers fit in 64 bits"):
        load_config("digits-ddpm", [override])
    tree = load_config("digits-ddpm").model_dump(mode="json", by_alias=True)
    tree["train"]["max_steps"] = 2**5000
    with pytest.raises(ConfigError, match=r"train.max_steps = \(a 5001-bit integer\) is not allowed"):
        config_from_dict(tree)
    assert load_config("digits-ddpm", ["seed=18446744073709551615"]).seed == 2**64 - 1  # torch takes uint64 seeds


def test_a_model_too_large_for_memory_is_a_config_error_and_frees_the_lease(tmp_path):
    from trainer.elastic import DistEnv
    from trainer.loop import Trainer

    cfg = load_config("digits-ddpm", [f"run.dir={tmp_path}/run", "model.block_out_channels=[32,1000000000000000]"])
    with pytest.raises(ConfigError, match=r"does not fit in memory on cpu: .*can't allocate memory.*smaller model"):
        Trainer(cfg, DistEnv())
    assert not list((tmp_path / "run").rglob("*lease*")), "the refused run left its lease behind"


@pytest.mark.parametrize(
    ("preset", "overrides", "key"),
    [
        ("digits-ddpm", ["sample.inference_steps=1001"], "sample.inference_steps"),
        ("digits-ddpm", ["model.num_train_timesteps=20", "sample.scheduler=dpm"], "sample.inference_steps"),
        ("digits-ddpm", ["sample.inference_steps=10", "eval.inference_steps=1001"], "eval.inference_steps"),
        ("digits-cascade", ["sample.inference_steps=1001"], "sample.inference_steps"),
    ],
)
def test_sampler_settings_a_preview_or_evaluation_cannot_use_are_refused_when_the_config_is_read(
    preset, overrides, key
):
    # #47: they trained, committed the checkpoint, then crashed in the preview (exit 1, at every restart).
    with pytest.raises(ConfigError, match=rf"^{key}=\d+: the .* cannot sample that many steps .*set {key} lower"):
        load_config(preset, overrides)
    load_config("digits-ddpm", ["sample.inference_steps=1000", "eval.inference_steps=1000"])  # the schedule's all
    load_config("digits-ddpm", ["sample.inference_steps=5000", "model.prediction_type=flow"])  # flow has no cap


@pytest.mark.slow
def test_train_with_more_preview_steps_than_timesteps_exits_2_before_the_first_step(tmp_path):
    from conftest import tiny

    r = run_cli("train", *tiny(tmp_path, "model.num_train_timesteps=8", "sample.inference_steps=9"), timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "sample.inference_steps=9" in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before any work
