"""Config input hardening: whatever a file, a variable or a key=value holds, the answer is a Config or exit 2.

Each test below states one promise of issue 23 (config part); the fuzz tests at the end try
random override lists, GENTRAIN_* environments and config files against all of them at once.
"""

from __future__ import annotations

import json
import os
import shutil
import string
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainer.config import Config
from trainer.config.load import MAX_DEPTH
from trainer.errors import ConfigError
from trainer.registry import config_from_dict, load_config

DEEP = 20_000


def config_error(*args, environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(*args, environ=environ or {})
    return str(e.value)


# ---------------------------------------------------------------- optimizer hyper-parameters


@pytest.mark.parametrize(
    "override, key, typed",
    [
        ("train.betas=[2,-1]", "train.betas", "[2,-1]"),
        ("train.betas=[0.9, 1.0]", "train.betas", "[0.9, 1.0]"),
        ("optim.unet.betas=[2,-1]", "optim.unet.betas", "[2,-1]"),
        ("optim.unet.betas=[-0.1, 0.99]", "optim.unet.betas", "[-0.1, 0.99]"),
        ("train.weight_decay=-1", "train.weight_decay", "-1"),
        ("optim.unet.weight_decay=-0.5", "optim.unet.weight_decay", "-0.5"),
        ("optim.unet.eps=0", "optim.unet.eps", "0"),
        ("optim.unet.lr=-1e-4", "optim.unet.lr", "-1e-4"),
        ("train.lr=.nan", "train.lr", ".nan"),
        ("train.lr=.inf", "train.lr", ".inf"),
        ("train.max_grad_norm=.nan", "train.max_grad_norm", ".nan"),
        ("seed=18446744073709551616", "seed", "18446744073709551616"),
    ],
)
def test_optimizer_settings_torch_would_refuse_are_config_errors_naming_key_and_typed_value(override, key, typed):
    msg = config_error(None, [override])
    assert f"{key} = {typed} is not allowed" in msg


def test_betas_inside_zero_one_are_accepted_for_train_and_for_a_part():
    cfg = load_config(None, ["train.betas=[0, 0.5]", "optim.unet.betas=[0.5, 0.9]"], environ={})
    assert cfg.train.betas == (0.0, 0.5)
    assert cfg.optim["unet"].betas == (0.5, 0.9)


@pytest.mark.slow
def test_cli_bad_betas_exit_2_without_traceback(tmp_path):
    r = run_cli("train", "train.betas=[2,-1]", f"run.dir={tmp_path}", timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert "train.betas = [2,-1]" in r.stderr


# ---------------------------------------------------------------- the config file itself


def binary_file() -> str:
    """An executable: /bin/ls as in the issue, or the interpreter where there is no /bin/ls."""
    return "/bin/ls" if Path("/bin/ls").is_file() else os.path.realpath(sys.executable)


def test_binary_file_given_as_yaml_is_not_a_yaml_text_file():
    msg = config_error(binary_file())
    assert binary_file() in msg
    assert "not a YAML text file" in msg


def test_file_with_nul_bytes_is_not_a_yaml_text_file(tmp_path):
    f = tmp_path / "nul.yaml"
    f.write_bytes(b"name: a\x00b\n")
    assert "not a YAML text file" in config_error(str(f))


@pytest.mark.parametrize(
    "content, must_mention",
    [
        ("- a\n- b\n", "expected a mapping of config keys"),
        ("just a sentence\n", "expected a mapping of config keys"),
        ("train: [\n", "not valid YAML"),
        ("a: 1\n---\nb: 2\n", "not valid YAML"),
        ("name: !!python/object:os.system x\n", "not valid YAML"),
    ],
)
def test_yaml_file_that_is_not_a_mapping_of_keys_is_refused_in_one_line(tmp_path, content, must_mention):
    f = tmp_path / "cfg.yaml"
    f.write_text(content)
    msg = config_error(str(f))
    assert must_mention in msg and str(f) in msg
    assert "\n" not in msg


def test_directory_given_as_config_file_is_refused(tmp_path):
    msg = config_error(str(tmp_path))
    assert str(tmp_path) in msg and "is a directory" in msg


def test_missing_config_file_is_refused(tmp_path):
    assert "does not exist" in config_error(str(tmp_path / "absent.yaml"))


@pytest.mark.slow
def test_cli_binary_config_file_exits_2_with_one_paragraph_and_no_traceback():
    r = run_cli("train", binary_file(), timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    paragraphs = [p for p in r.stderr.strip().split("\n\n") if p.strip()]
    assert len(paragraphs) == 1, r.stderr
    assert binary_file() in r.stderr and "not a YAML text file" in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["directory", "list", "missing"])
def test_cli_unusable_config_file_exits_2(tmp_path, kind):
    # A long folder name: the message must carry the whole path, however deep the user's files lie.
    where = tmp_path / ("configs-" + "x" * 120)
    where.mkdir()
    target = {"directory": where, "list": where / "list.yaml", "missing": where / "none.yaml"}[kind]
    (where / "list.yaml").write_text("- 1\n")
    r = run_cli("train", str(target), timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and str(target) in r.stderr


# ---------------------------------------------------------------- nesting


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_value_nested_20000_deep_on_the_command_line_is_refused_with_the_limit():
    msg = config_error(None, [f"model.x={nested(DEEP)}"])
    assert f"nested more than {MAX_DEPTH} levels" in msg
    assert len(msg) < 500  # the 40,000-character value is cut, not echoed


def test_value_nested_20000_deep_in_the_environment_is_refused_with_the_limit():
    msg = config_error(None, [], environ={"GENTRAIN_MODEL__X": nested(DEEP)})
    assert "GENTRAIN_MODEL__X" in msg and f"nested more than {MAX_DEPTH} levels" in msg


def test_value_nested_20000_deep_in_a_file_is_refused_with_the_limit(tmp_path):
    f = tmp_path / "deep.yaml"
    f.write_text(f"model:\n  x: {nested(DEEP)}\n")
    assert f"nested more than {MAX_DEPTH} levels" in config_error(str(f))


def test_aliases_cannot_nest_deeper_or_expand_past_the_limits(tmp_path):
    chain = "a0: &a0 [1]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, 2 * MAX_DEPTH))
    f = tmp_path / "chain.yaml"
    f.write_text("model:\n" + "".join(f"  {line}\n" for line in chain.splitlines()))
    assert f"nested more than {MAX_DEPTH} levels" in config_error(str(f))
    bomb = "b0: &b0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
        f"b{i}: &b{i} [{', '.join([f'*b{i - 1}'] * 10)}]\n" for i in range(1, 9)
    )
    f.write_text("model:\n" + "".join(f"  {line}\n" for line in bomb.splitlines()))
    assert "more than" in config_error(str(f))
    assert "loop" in config_error(None, ["model.x=&a [*a]"])


def test_config_tree_from_a_manifest_nested_too_deep_is_refused():
    tree: dict = {"model": {}}
    node = tree["model"]
    for _ in range(MAX_DEPTH + 5):
        node["x"] = {}
        node = node["x"]
    with pytest.raises(ConfigError, match=f"nested more than {MAX_DEPTH} levels"):
        config_from_dict(tree)


# ---------------------------------------------------------------- sections are mappings

TRAIN_LR_OF_DIGITS_DDPM = 2e-3


@pytest.mark.parametrize(
    "overrides, environ, section, origin, typed",
    [
        (["train.max_steps=3"], {"GENTRAIN_TRAIN": "x"}, "train", "environment GENTRAIN_TRAIN", "'x'"),
        (["train.max_steps=3"], {"GENTRAIN_TRAIN": ""}, "train", "environment GENTRAIN_TRAIN", "''"),
        (["train=5", "train.max_steps=3"], {}, "train", "argument 'train=5'", "5"),
        (["train.max_steps=3", "train=5"], {}, "train", "argument 'train=5'", "5"),
        (["train=5"], {}, "train", "argument 'train=5'", "5"),
        ([], {"GENTRAIN_TRAIN": "x", "GENTRAIN_TRAIN__MAX_STEPS": "3"}, "train", "environment GENTRAIN_TRAIN", "'x'"),
        (["optim.unet=fast", "optim.unet.lr=1e-4"], {}, "optim.unet", "argument 'optim.unet=fast'", "'fast'"),
        (["model=[1]"], {}, "model", "argument 'model=[1]'", "[1]"),
        (["checkpoint.storage_options=5"], {}, "checkpoint.storage_options", "argument", "5"),
    ],
)
def test_section_set_to_a_value_is_refused_naming_section_value_and_origin(overrides, environ, section, origin, typed):
    msg = config_error(None, overrides, environ=environ)
    assert f"{section} is a section of config keys, not a value: {origin}" in msg
    assert f"sets it to {typed};" in msg


def test_section_in_a_file_set_to_a_value_is_refused_naming_the_line(tmp_path):
    f = tmp_path / "cfg.yaml"
    f.write_text("name: mine\ntrain: 5\n")
    msg = config_error(str(f), ["train.lr=1"])
    assert f"train is a section of config keys, not a value: {f}, line 2 sets it to 5" in msg


def test_section_given_as_a_mapping_merges_with_the_preset():
    cfg = load_config(None, ["train={max_steps: 3}"], environ={"GENTRAIN_TRAIN": "{batch_size: 8}"})
    assert (cfg.train.max_steps, cfg.train.batch_size) == (3, 8)
    assert cfg.train.lr == pytest.approx(TRAIN_LR_OF_DIGITS_DDPM)  # the preset's, not the default


def test_setting_a_key_inside_a_list_is_refused_naming_the_list():
    msg = config_error(None, ["model.block_out_channels.0=8"])
    assert "model.block_out_channels is a value, not a section" in msg


# ---------------------------------------------------------------- values as the user typed them


@pytest.mark.parametrize("how", ["argument", "environment", "file"])
@pytest.mark.parametrize("word", ["no", "fp16", "bf16"])
def test_precision_words_reach_a_bf16_preset_as_typed(tmp_path, how, word):
    overrides = ["data.path=/nonexistent-images"]
    environ = {}
    preset = "folder-ddpm"  # sets train.precision: bf16
    if how == "argument":
        overrides.append(f"train.precision={word}")
    elif how == "environment":
        environ["GENTRAIN_TRAIN__PRECISION"] = word
    else:
        src = Path(__file__).resolve().parents[1] / "trainer" / "presets" / "folder-ddpm.yaml"
        preset = str(tmp_path / "mine.yaml")
        Path(preset).write_text(src.read_text().replace("precision: bf16", f"precision: {word}"))
    cfg = load_config(preset, overrides, environ=environ)
    assert cfg.train.precision == word


@pytest.mark.parametrize(
    "override, attribute, expected",
    [
        ("name=123", "name", "123"),
        ("name=1e3", "name", "1e3"),
        ("name=0x10", "name", "0x10"),
        ("name=true", "name", "true"),
        ("name=off", "name", "off"),
        ("name=1:30", "name", "1:30"),
        ("name=2024-01-01", "name", "2024-01-01"),
        ("run.dir=2024", "run_dir", "2024"),
        ("checkpoint.url=007", "checkpoint_url", "007"),
        ("model.pretrained=2.50", "model_pretrained", "2.50"),
    ],
)
def test_string_fields_get_the_text_yaml_would_turn_into_a_number_or_boolean(override, attribute, expected):
    cfg = load_config(None, [override], environ={})
    value = cfg.model_cfg.pretrained if attribute == "model_pretrained" else getattr(cfg, attribute)
    assert value == expected


def test_string_lists_and_environment_values_keep_their_text_too():
    cfg = load_config(None, ["data.source=shards", "data.urls=[2024, 2025.0]"], environ={"GENTRAIN_NAME": "42"})
    assert cfg.data.urls == ["2024", "2025.0"]
    assert cfg.name == "42"


def test_numbers_and_booleans_stay_numbers_and_booleans_where_the_field_wants_them():
    cfg = load_config(
        None,
        ["train.lr=3e-4", "train.max_steps=10", "ema.enabled=no", "checkpoint.async=yes", "data.flip=on", "seed=010"],
        environ={"GENTRAIN_LOG__TENSORBOARD": "off"},
    )
    assert cfg.train.lr == pytest.approx(3e-4) and cfg.train.max_steps == 10
    assert cfg.ema.enabled is False and cfg.checkpoint.async_ is True and cfg.data.flip is True
    assert cfg.log.tensorboard is False
    assert cfg.seed == 10  # YAML 1.2: a leading zero is not octal


@pytest.mark.parametrize(
    "override, shown",
    [
        ("train.precision=false", "train.precision = 'false' is not allowed: one of 'no', 'fp16' or 'bf16'"),
        ("train.batch_size=0x0", "train.batch_size = 0x0 is not allowed"),
        ("train.lr=-1e-3", "train.lr = -1e-3 is not allowed"),
        ("ema.decay=1.0e0", "ema.decay = 1.0e0 is not allowed"),
        ("model.num_train_timesteps=1e1000", "model.num_train_timesteps = 1e1000 is not allowed"),
        ("data.channels=2", "data.channels = 2 is not allowed"),
    ],
)
def test_error_messages_show_the_value_as_typed(override, shown):
    assert shown in config_error(None, [override])


def test_resolved_config_round_trips_through_its_dict_with_string_numbers_and_words():
    cfg = load_config(
        "folder-ddpm", ["data.path=/nonexistent-images", "train.precision=no", "name=2024", "run.dir=007"], environ={}
    )
    again = config_from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again.to_dict() == cfg.to_dict()
    assert (again.name, again.run.dir, again.train.precision) == ("2024", "007", "no")


# ---------------------------------------------------------------- fuzzing

# Keys gentrain has (sections, leaves, a part, a task's model keys) and keys it has not.
REAL_KEYS = [
    "name",
    "seed",
    "run",
    "run.dir",
    "train",
    "train.lr",
    "train.betas",
    "train.precision",
    "train.max_steps",
    "train.batch_size",
    "train.weight_decay",
    "train.max_grad_norm",
    "train.parallel",
    "train.stages",
    "ema",
    "ema.enabled",
    "ema.decay",
    "checkpoint",
    "checkpoint.url",
    "checkpoint.async",
    "checkpoint.storage_options",
    "checkpoint.storage_options.anon",
    "sample.scheduler",
    "metrics.port",
    "elastic.grace_seconds",
    "data",
    "data.source",
    "data.urls",
    "data.path",
    "data.channels",
    "eval.features",
    "optim",
    "optim.unet",
    "optim.unet.lr",
    "optim.unet.betas",
    "optim.unet.eps",
    "optim.disc.lr",
    "model",
    "model.block_out_channels",
    "model.prediction_type",
    "model.pretrained",
    "model.lora",
    "model.lora.rank",
    "model.x",
]
JUNK_KEYS = ["", ".", "train.", ".lr", "train..lr", "nosuch", "train.lr.x", "name.x", "model.x.y.z", "é", "a b"]
# `task` only takes names whose import is harmless: a config may name any importable module by design.
TASK_VALUES = ["ddpm", "vqgan", "nosuch", "nosuch_mod_zz:X", ":x", ".x:y", "os:path", "trainer.config:Config", ""]

WORDS = ["yes", "no", "on", "off", "y", "n", "Yes", "NO", "true", "False", "~", "null", "", ".inf", "-.inf", ".nan"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
values = st.one_of(
    st.sampled_from(WORDS),
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.sampled_from(["9" * 5000, "1e999", "-1e-999", "0x" + "f" * 40, "0o777", "1_000", "1:30", "2024-01-01"]),
    st.floats().map(repr),
    st.text(max_size=30),
    st.text(alphabet=string.printable, max_size=30),
    st.binary(max_size=30).map(lambda b: b.decode("utf-8", "surrogateescape")),  # as argv holds undecodable bytes
    st.integers(min_value=1, max_value=300).map(nested),
    st.integers(min_value=1, max_value=120).map(lambda n: "{a: " * n + "1" + "}" * n),
    st.sampled_from(
        [nested(DEEP), "&a [*a]", "[&a [1], *a, *a]", "!!binary aGk=", "!!int x", "!!bool maybe", "{[1]: 2}"]
    ),
    st.sampled_from(["[2,-1]", "[0.9, 0.999]", "[0.5]", "{max_steps: 3}", "{lr: .nan}"]),
    json_values.map(json.dumps),
)
keys = st.one_of(st.sampled_from(REAL_KEYS), st.sampled_from(JUNK_KEYS), st.text(max_size=12))


@st.composite
def override(draw) -> str:
    key = draw(keys)
    if key.split(".")[0].strip() == "task" or key.strip() == "task":
        return f"task={draw(st.sampled_from(TASK_VALUES))}"
    return f"{key}={draw(values)}"


# Overrides that mostly make a valid config, so the fuzz also walks the paths that return one.
PLAUSIBLE = {
    "name": ["run1", "123", "no", "1e3", "2024-01-01"],
    "run.dir": ["2024", "/tmp/x", "off"],
    "train.precision": ["no", "fp16", "bf16", "off", "false"],
    "train.lr": ["3e-4", "1", ".inf", "0"],
    "train.betas": ["[0.9, 0.99]", "[0, 0]", "[1, 0.5]"],
    "train.max_steps": ["10", "1e3", "010"],
    "ema.enabled": ["yes", "no", "on", "off", "true", "y"],
    "checkpoint.async": ["on", "false"],
    "checkpoint.url": ["2024", "s3://b/r"],
    "optim.unet.lr": ["1e-4", "-1"],
    "model.block_out_channels": ["[8, 16]", "[8]"],
    "model.prediction_type": ["epsilon", "v_prediction", "yes"],
    "data.channels": ["1", "3", "2"],
}
plausible = st.sampled_from(sorted(PLAUSIBLE)).flatmap(lambda k: st.sampled_from(PLAUSIBLE[k]).map(f"{k}={{}}".format))


def env_name(key: str) -> str:
    return "GENTRAIN_" + "__".join(part.upper() for part in key.split("."))


@st.composite
def environment(draw) -> dict[str, str]:
    env: dict[str, str] = {}
    for key in draw(st.lists(keys, max_size=5)):
        if key.lower().replace("_", "").startswith("task"):
            continue  # see TASK_VALUES
        env[env_name(key)] = draw(values)
    if draw(st.booleans()):
        env["GENTRAIN_TASK"] = draw(st.sampled_from(TASK_VALUES))
    env["PATH"] = "/usr/bin"  # not gentrain's: ignored
    return env


def loads_or_refuses(*args, environ: dict[str, str]) -> None:
    """The fuzz property: a Config, or a ConfigError that says something; never any other exception."""
    try:
        cfg = load_config(*args, environ=environ)
    except ConfigError as e:
        assert str(e).strip(), "ConfigError without a message"
        return
    assert isinstance(cfg, Config)
    json.dumps(cfg.to_dict())  # what a checkpoint's manifest will hold


FUZZ = settings(derandomize=True, max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(
    args=st.lists(st.one_of(override(), plausible, plausible), max_size=6),
    preset=st.sampled_from([None, "digits-ddpm", "folder-ddpm"]),
)
def test_fuzz_random_overrides_give_a_config_or_a_config_error(args, preset):
    loads_or_refuses(preset, [*args, "data.path=/nonexistent-images"] if preset == "folder-ddpm" else args, environ={})


@FUZZ
@given(environ=environment(), args=st.lists(override(), max_size=3))
def test_fuzz_random_environments_give_a_config_or_a_config_error(environ, args):
    loads_or_refuses(None, args, environ=environ)


@FUZZ
@given(
    content=st.one_of(
        st.binary(max_size=200),
        st.lists(st.tuples(st.sampled_from(REAL_KEYS + JUNK_KEYS), values), max_size=6).map(
            lambda pairs: "".join(f"{k}: {v}\n" for k, v in pairs).encode("utf-8", "surrogateescape")
        ),
        json_values.map(lambda v: json.dumps(v).encode()),
    )
)
def test_fuzz_random_config_files_give_a_config_or_a_config_error(content):
    folder = tempfile.mkdtemp(prefix="gentrain-fuzz-")
    try:
        path = Path(folder) / "cfg.yaml"
        path.write_bytes(content)
        loads_or_refuses(str(path), [], environ={})
    finally:
        shutil.rmtree(folder)
