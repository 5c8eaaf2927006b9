"""What a user types wrong ends in exit 2 and one paragraph, before any work; never a traceback (exit 1,
which torchrun and Kubernetes retry). Every path-taking flag and config key is walked with a file, a folder,
a missing parent, a path under a file and links; a re-export never leaves another export's index or card
beside its weights; URL credentials holding `@`, `/` and `:` are redacted whole; an HF split with no
readable image exits 2."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import pytest
from conftest import REPO, run_cli, tiny
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.config.redact import REDACTED, redact, redact_text, secret_values
from trainer.errors import ConfigError
from trainer.models.export import FAULT_EXPORT_AFTER_FOLDER, MARKER_NAME
from trainer.storage import check_output_file, check_output_folder

# Most of these start gentrain processes (the CLI's own exits); the rest are quick.
pytestmark = pytest.mark.slow

GOLDEN = REPO / "tests" / "golden"
DDPM = str(GOLDEN / "digits-ddpm" / "checkpoints")  # step 2, exports as a DDIMPipeline
CFG = str(GOLDEN / "digits-cfg" / "checkpoints")  # step 2, class-conditional: folders without model_index.json


@pytest.fixture
def paths(tmp_path) -> dict[str, Path]:
    """Every kind of path a user may give: a file, an empty and a non-empty folder, a missing parent, a path
    under a file, a link to a folder, a link to a file and a dangling link."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "folder").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    (tmp_path / "target").mkdir()
    os.symlink(tmp_path / "target", tmp_path / "link-to-folder")
    os.symlink(tmp_path / "file", tmp_path / "link-to-file")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    return {
        "file": tmp_path / "file",
        "folder": tmp_path / "folder",
        "full": tmp_path / "full",
        "missing-parent": tmp_path / "new" / "deeper" / "out",
        "under-a-file": tmp_path / "file" / "out",
        "link-to-folder": tmp_path / "link-to-folder",
        "link-to-file": tmp_path / "link-to-file",
        "dangling": tmp_path / "dangling",
    }


def assert_usage_error(r, *needles: str) -> None:
    """Exit 2, one `gentrain: ...` paragraph naming `needles`, no traceback."""
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    for needle in needles:
        assert needle in r.stderr, (needle, r.stderr[-3000:])


def assert_ok(r) -> None:
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]


# ---------------------------------------------------------------- the checks themselves


@pytest.mark.parametrize(
    "kind, refused",
    [
        ("file", "is a file, not a folder"),
        ("folder", None),
        ("full", None),
        ("missing-parent", None),
        ("under-a-file", "is a file, not a folder"),
        ("link-to-folder", None),
        ("link-to-file", "is a symbolic link to"),
        ("dangling", "is a symbolic link to"),
    ],
)
def test_an_output_folder_is_refused_where_a_file_or_link_stands_in_its_way(paths, kind, refused):
    if refused is None:
        check_output_folder(str(paths[kind]), "run.dir", "fix it")
        check_output_folder(f"file://{paths[kind]}", "run.dir", "fix it")
        return
    with pytest.raises(ConfigError, match=refused) as e:
        check_output_folder(str(paths[kind]), f"run.dir={str(paths[kind])!r}", "fix it")
    assert str(e.value).startswith(f"run.dir={str(paths[kind])!r} cannot be made a folder: ") and "; fix it" in str(e)


def test_an_output_folder_another_rank_makes_during_the_check_is_not_refused(tmp_path, monkeypatch):
    """The ranks on one machine check run.dir at once and one of them makes it: a folder that appears between
    two looks is not a file in the way (found under torchrun: exit 2, 'is a file, not a folder')."""
    run_dir, real_stat = tmp_path / "run", os.stat

    def racing_stat(path, *args, **kwargs):
        if os.fspath(path) == str(run_dir) and not os.path.lexists(run_dir):
            run_dir.mkdir()  # the other rank, right after this look found nothing
            raise FileNotFoundError(path)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", racing_stat)
    check_output_folder(str(run_dir), "run.dir", "fix it")
    assert run_dir.is_dir()


def test_remote_output_urls_are_left_to_the_store():
    check_output_folder("s3://bucket/file/x", "checkpoint.url", "fix it")  # no round trip, no refusal


@pytest.mark.parametrize(
    "kind, refused",
    [
        ("file", None),  # overwritten
        ("folder", "is a folder, not a file name"),
        ("missing-parent", None),
        ("under-a-file", "is a file, not a folder"),
        ("link-to-folder", "is a folder, not a file name"),
        ("link-to-file", None),
        ("dangling", None),  # writing through it makes its target
    ],
)
def test_an_output_file_is_refused_where_it_is_a_folder_or_its_parent_cannot_be_one(paths, kind, refused):
    if refused is None:
        check_output_file(str(paths[kind]), "--out", "fix it")
        return
    with pytest.raises(ConfigError, match=refused):
        check_output_file(str(paths[kind]), "--out", "fix it")


# ---------------------------------------------------------------- the CLI, flag by flag and key by key

BAD_FOLDERS = ("file", "under-a-file", "link-to-file", "dangling")


@pytest.mark.parametrize("kind", BAD_FOLDERS)
@pytest.mark.parametrize(
    "key, extra",
    [
        ("run.dir", []),
        ("checkpoint.url", []),
        ("checkpoint.memory_dir", ["checkpoint.memory=true"]),
    ],
)
def test_train_refuses_an_output_folder_that_cannot_be_made_before_the_first_step(tmp_path, paths, key, extra, kind):
    r = run_cli("train", *tiny(tmp_path, *extra, f"{key}={paths[kind]}", max_steps=2))
    assert_usage_error(r, f"config error: {key}={str(paths[kind])!r}", "cannot be made a folder")
    assert "step=1" not in r.stderr  # refused at the start, not at the first save


def test_train_makes_missing_parents_and_follows_a_link_to_a_folder(tmp_path, paths):
    """The valid ones: run.dir through a link to a folder, checkpoint.url under parents that do not exist."""
    args = tiny(tmp_path, f"run.dir={paths['link-to-folder']}", f"checkpoint.url={paths['missing-parent']}")
    assert_ok(run_cli("train", *args, "train.max_steps=1"))
    assert (paths["missing-parent"] / "LATEST").exists() and (tmp_path / "target" / "samples").is_dir()


@pytest.mark.parametrize("kind", ["file", "folder", "missing-parent", "dangling"])
def test_data_path_and_model_urls_that_hold_no_data_or_checkpoint_exit_2(tmp_path, paths, kind):
    r = run_cli("train", *tiny(tmp_path, "data.source=folder", f"data.path={paths[kind]}", max_steps=1))
    assert_usage_error(r, f"data.path={str(paths[kind])!r}")
    r = run_cli("train", "digits-latent-dit", f"run.dir={tmp_path}/r", f"model.autoencoder.url={paths[kind]}")
    assert_usage_error(r, f"no valid checkpoint at {str(paths[kind])!r}")


@pytest.mark.parametrize(
    "kind, ok",
    [
        ("file", True),
        ("folder", False),
        ("missing-parent", True),
        ("under-a-file", False),
        ("link-to-folder", False),
    ],
)
def test_sample_out_must_name_a_file_it_can_write(paths, kind, ok):
    out = Path(f"{paths[kind]}.png") if kind == "missing-parent" else paths[kind]
    r = run_cli("sample", DDPM, "--num", "1", "--steps", "1", "--out", str(out))
    if ok:
        assert_ok(r)
        assert out.read_bytes()[:4] == b"\x89PNG"
    else:
        assert_usage_error(r, f"--out {str(out)!r}")


@pytest.mark.parametrize(
    "kind, ok",
    [
        ("file", False),
        ("folder", True),
        ("full", False),  # a folder of someone else's files: not an export to replace
        ("missing-parent", True),
        ("under-a-file", False),
        ("link-to-folder", True),
        ("link-to-file", False),
        ("dangling", False),
    ],
)
def test_export_out_must_be_a_new_or_empty_folder_or_a_previous_export(paths, kind, ok):
    r = run_cli("checkpoints", "export", DDPM, str(paths[kind]))
    if ok:
        assert_ok(r)
        assert (paths[kind] / "model_index.json").exists()
    else:
        assert_usage_error(r, f"OUT {str(paths[kind])!r}")
    assert (paths["full"] / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "command, kind, ok",
    [
        (["checkpoints", "consolidate", DDPM, "OUT"], "file", False),
        (["checkpoints", "consolidate", DDPM, "OUT"], "under-a-file", False),
        (["checkpoints", "consolidate", DDPM, "OUT"], "dangling", False),
        (["checkpoints", "consolidate", DDPM, "OUT"], "missing-parent", True),
        (["data", "pack", str(REPO / "tests"), "OUT", "--samples-per-shard", "4"], "file", False),
        (["data", "pack", str(REPO / "tests"), "OUT", "--samples-per-shard", "4"], "under-a-file", False),
    ],
)
def test_consolidate_and_pack_refuse_an_out_that_cannot_be_a_folder(paths, command, kind, ok):
    r = run_cli(*[str(paths[kind]) if a == "OUT" else a for a in command])
    if ok:
        assert_ok(r)
        assert any(p.name.startswith("step-") for p in paths[kind].iterdir())
    else:
        assert_usage_error(r, str(paths[kind]))


@pytest.mark.parametrize("kind", ["file", "folder", "missing-parent", "dangling"])
@pytest.mark.parametrize(
    "command, named",
    [
        (["sample", DDPM, "--num", "1", "--steps", "1", "--embeddings", "IN"], "--embeddings"),
        (["data", "pack", "IN", "OUT", "--samples-per-shard", "2"], "data pack"),
        (["data", "index", "IN"], "data index"),
        (["eval", DDPM, "--num", "2", "--steps", "1", "--features", "IN"], "eval.features="),
    ],
)
def test_input_paths_that_hold_nothing_readable_exit_2(tmp_path, paths, command, named, kind):
    """An empty file, an empty folder, a path under a missing folder and a dangling link, where a flag reads."""
    args = [str(paths[kind]) if a == "IN" else str(tmp_path / "out") if a == "OUT" else a for a in command]
    assert_usage_error(run_cli(*args), named)


@pytest.mark.parametrize(
    "args",
    [
        ["sample", DDPM],
        ["eval", DDPM],
        ["eval", DDPM, "--storage-options", "{}", "--data-storage-options"],
        ["checkpoints", "list", DDPM],
        ["checkpoints", "verify", DDPM],
        ["checkpoints", "export", DDPM, "out"],
        ["checkpoints", "consolidate", DDPM, "out"],
        ["data", "index", "x.tar"],
    ],
)
@pytest.mark.parametrize("value", ["[1]", '"s3"', "7", "{not json"])
def test_storage_options_that_are_not_a_json_object_exit_2(args, value):
    flag = [] if args[-1] == "--data-storage-options" else ["--storage-options"]
    r = run_cli(*args, *flag, value)
    assert_usage_error(r, "storage-options: the value is", "give a JSON object")


def test_eval_flags_out_of_range_exit_2_naming_the_flag_and_the_key():
    r = run_cli("eval", DDPM, "--num", "1", "--steps", "1")
    assert_usage_error(r, "--num 1 is not allowed", "eval.num")


def test_a_metrics_port_in_use_or_a_host_not_of_this_machine_exits_2_before_the_first_step(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = run_cli("train", *tiny(tmp_path, f"metrics.port={port}", "metrics.host=127.0.0.1", max_steps=2))
    assert_usage_error(r, f"metrics.port={port}", "the port is in use", "set metrics.port to a free port")
    assert "step=1" not in r.stderr
    r = run_cli("train", *tiny(tmp_path, "metrics.port=1", "metrics.host=no-such-host.invalid", max_steps=2))
    assert_usage_error(r, "metrics.host='no-such-host.invalid'", "not a name or address of this machine")


# ---------------------------------------------------------------- exports are replaced whole


def _export(checkpoint: str, out: Path, **env: str):
    from conftest import clean_env

    return run_cli("checkpoints", "export", checkpoint, str(out), env=clean_env(**env))


def test_a_failed_re_export_leaves_no_index_or_card_of_the_previous_export_and_the_next_one_replaces_it(tmp_path):
    out = tmp_path / "export"
    assert_ok(_export(DDPM, out))
    assert (out / "model_index.json").exists() and "DDIMPipeline" in (out / "README.md").read_text()
    ddpm_weights = (out / "unet" / "diffusion_pytorch_model.safetensors").read_bytes()

    # The class-conditional model fails right after its UNet folder: the DDPM's index and card must be gone.
    r = _export(CFG, out, **{FAULT_EXPORT_AFTER_FOLDER: "unet"})
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "export to" in r.stderr and "run it again" in r.stderr
    assert not (out / "model_index.json").exists() and not (out / "README.md").exists()
    marker = json.loads((out / MARKER_NAME).read_text())
    assert marker["complete"] is False and marker["checkpoint"].endswith("digits-cfg/checkpoints/step-000000002")
    assert (out / "unet" / "diffusion_pytorch_model.safetensors").read_bytes() != ddpm_weights
    assert not (out / "scheduler").exists()  # the previous export's folders went before the new ones came

    # Run again: a complete export of the class-conditional model, with no model_index.json (it has none).
    assert_ok(_export(CFG, out))
    assert not (out / "model_index.json").exists()
    card = (out / "README.md").read_text()
    assert "no diffusers pipeline" in card and "- diffusers pipeline: `DDIMPipeline`" not in card
    assert json.loads((out / MARKER_NAME).read_text())["complete"] is True


def test_a_re_export_over_an_export_written_before_the_marker_replaces_it(tmp_path):
    """An export of an older gentrain (a gentrain card, no marker) is recognised and replaced whole."""
    out = tmp_path / "export"
    assert_ok(_export(DDPM, out))
    (out / MARKER_NAME).unlink()
    (out / "vae").mkdir()
    (out / "vae" / "config.json").write_text("{}")  # a folder the new export does not write
    assert_ok(_export(CFG, out))
    assert sorted(p.name for p in out.iterdir()) == ["README.md", MARKER_NAME, "scheduler", "unet"]


def test_an_export_into_a_folder_of_other_files_is_refused_and_touches_nothing(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "README.md").write_text("# my project\n")
    r = _export(DDPM, out)
    assert_usage_error(r, "holds other files and no gentrain export")
    assert [p.name for p in out.iterdir()] == ["README.md"] and (out / "README.md").read_text() == "# my project\n"


# ---------------------------------------------------------------- redaction

# Whatever a user pastes: credentials with @, / and : in them (the characters that end a URL's user info
# or its host in a parser are exactly those users do not escape).
_SECRET_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~!$*+,=@/:"
secrets = st.text(alphabet=_SECRET_CHARS, min_size=6, max_size=24)
_PARAMS = [
    "password",
    "passwd",
    "pwd",
    "pass",
    "token",
    "access_token",
    "jwt",
    "secret",
    "key",
    "api_key",
    "signature",
    "sig",
    "credential",
    "X-Amz-Credential",
    "X-Amz-Signature",
    "X-Amz-Security-Token",
    "X-Goog-Signature",
]
hosts = st.sampled_from(["example.com", "127.0.0.1:9000", "bucket", "s3.eu-west-1.amazonaws.com"])
schemes = st.sampled_from(["s3", "gs", "https", "http", "ftp", "sftp", "abfs"])
url_paths = st.sampled_from(["", "/", "/runs/a", "/runs/model@v2/ckpt", "/a:b/c"])


@st.composite
def leaky_urls(draw) -> tuple[str, str]:
    """(a text holding a URL with `secret` in a credential position, secret)."""
    secret = draw(secrets)
    scheme, host, path = draw(schemes), draw(hosts), draw(url_paths)
    where = draw(st.sampled_from(["password", "user-only", "query", "fragment"]))
    if where == "password":
        user = draw(st.sampled_from(["user", "AKIAXXXX", "me@corp.com", "a"]))
        url = f"{scheme}://{user}:{secret}@{host}{path}"
    elif where == "user-only":  # a bare token: one without a '/' (with one it is a path, see redact.py)
        secret = secret.replace("/", "")
        url = f"{scheme}://{secret}@{host}{path}"
    else:
        name = draw(st.sampled_from(_PARAMS))
        before = draw(st.sampled_from(["", "a=1&", "x=y&v=2&"]))
        after = draw(st.sampled_from(["", "&b=2", "&expires_in=3600"]))
        mark = "?" if where == "query" else "#"
        url = f"{scheme}://{host}{path}{mark}{before}{name}={secret}{after}"
    around = draw(st.sampled_from(["{}", "opening {} failed", "'{}'", "url={}, retry", "({})"]))
    return around.format(url), secret


@settings(max_examples=400, derandomize=True, deadline=None)
@given(leaky_urls())
def test_a_secret_in_any_credential_position_of_a_url_never_survives_redaction(case):
    text, secret = case
    clean = redact_text(text)
    assert secret not in clean, (text, clean)
    assert REDACTED in clean
    # The redacted value, not its JSON with the keys: a secret such as "checkp" is part of "checkpoint".
    assert secret not in json.dumps(redact({"checkpoint": {"url": text}})["checkpoint"]["url"])


@settings(max_examples=200, derandomize=True, deadline=None)
@given(secrets, hosts)
def test_the_log_filter_learns_a_url_password_that_holds_at_slash_and_colon(secret, host):
    assert secret in secret_values({"data": {"urls": [f"s3://user:{secret}@{host}/x"]}})


@pytest.mark.parametrize(
    "url",
    [
        "s3://bucket/runs/a@b/c",  # a path with '@'
        "gs://bucket/x:y/z@w",
        "https://example.com/a?b=c&max_tokens=3#section",
        "/local/path/with@at",
    ],
)
def test_urls_without_credentials_are_left_as_typed(url):
    assert redact_text(url) == url


# ---------------------------------------------------------------- an HF dataset of unreadable images


def _junk_dataset(root: Path, rows: int, good: int = 0) -> str:
    datasets = pytest.importorskip("datasets")
    import io

    from PIL import Image

    png = io.BytesIO()
    Image.new("L", (8, 8), 128).save(png, format="PNG")
    cells = [{"bytes": png.getvalue() if i < good else b"junk %d" % i, "path": None} for i in range(rows)]
    features = datasets.Features(image=datasets.Image(), text=datasets.Value("string"))
    datasets.Dataset.from_dict({"image": cells, "text": ["a"] * rows}, features=features).save_to_disk(str(root))
    return str(root)


def test_an_hf_dataset_whose_every_image_is_unreadable_exits_2_before_the_first_step(tmp_path):
    path = _junk_dataset(tmp_path / "junk", rows=40)
    r = run_cli("train", *tiny(tmp_path, "data.source=hf", f"data.path={path}", max_steps=2))
    assert_usage_error(r, f"data.path={path!r}", "no image in column 'image' can be read", "train on nothing")
    assert "step=1" not in r.stderr


def test_an_hf_dataset_with_one_readable_image_or_max_skipped_fraction_1_is_read(tmp_path):
    from trainer.data import build_splits
    from trainer.registry import load_config

    few_good = _junk_dataset(tmp_path / "some", rows=40, good=1)
    all_bad = _junk_dataset(tmp_path / "junk", rows=40)
    for path, extra in [(few_good, []), (all_bad, ["data.max_skipped_fraction=1"])]:
        cfg = load_config("digits-ddpm", ["data.source=hf", f"data.path={path}", "data.image_size=8", *extra], {})
        train, _, _ = build_splits(cfg)
        assert len(train) > 0
    cfg = load_config("digits-ddpm", ["data.source=hf", f"data.path={all_bad}", "data.image_size=8"], {})
    with pytest.raises(ConfigError, match="32 rows spread over its 40 tried"):
        build_splits(cfg)
    shutil.rmtree(tmp_path / "some")


# ---------------------------------------------------------------- read commands' flags and stores (#47)


@pytest.mark.parametrize("kind", ["file", "under-a-file", "dangling", "read-only"])
def test_data_encode_out_that_cannot_be_a_folder_exits_2_before_encoding(tmp_path, paths, kind):
    out = paths.get(kind)
    if kind == "read-only":
        (tmp_path / "ro").mkdir(mode=0o555)
        if os.access(tmp_path / "ro", os.W_OK):
            pytest.skip("this user (root) may write in a folder of mode 555")
        out = tmp_path / "ro" / "latents"
    r = run_cli("data", "encode", "digits-latent-dit", "--out", str(out), "--samples-per-shard", "4")
    assert_usage_error(r, f"--out {str(out)!r} cannot be made a folder")
    assert "encoded" not in r.stdout


DEEP = '{"a": ' * 5000 + "1" + "}" * 5000  # json.loads: RecursionError


@pytest.mark.parametrize("value", [DEEP, '{"a": ' * 40 + "1" + "}" * 40])
@pytest.mark.parametrize("args", [["sample", DDPM], ["eval", DDPM], ["checkpoints", "list", DDPM]])
def test_storage_options_nested_too_deep_exit_2(args, value):
    assert_usage_error(run_cli(*args, "--storage-options", value), "storage-options: the value nests deeper than")


@pytest.mark.parametrize(
    "args, flag",
    [
        (["sample", DDPM, "--num", str(2**64)], "--num"),
        (["sample", DDPM, "--seed", str(2**64)], "--seed"),
        (["sample", DDPM, "--seed", str(-(2**64))], "--seed"),
        (["sample", DDPM, "--steps", str(2**70)], "--steps"),
        (["eval", DDPM, "--num", str(2**64)], "--num"),
    ],
)
def test_counts_and_seeds_beyond_their_range_exit_2(args, flag):
    assert_usage_error(run_cli(*args), f"argument {flag}", "out of range")


@pytest.mark.parametrize("command", [["sample", DDPM, "--num", "1", "--out", "OUT"], ["eval", DDPM, "--num", "2"]])
def test_steps_above_the_models_timesteps_exit_2(tmp_path, command):
    r = run_cli(*[str(tmp_path / "grid.png") if a == "OUT" else a for a in command], "--steps", "5000")
    assert_usage_error(r, "--steps 5000", "cannot sample that many steps")


def test_sample_out_a_dangling_link_into_a_missing_folder_exits_2(tmp_path):
    link = tmp_path / "grid.png"
    link.symlink_to(tmp_path / "gone" / "deeper" / "grid.png")
    r = run_cli("sample", DDPM, "--num", "1", "--steps", "1", "--out", str(link))
    assert_usage_error(r, f"--out {str(link)!r} cannot be written", "symbolic link", "whose folder does not exist")


@pytest.mark.parametrize(
    "command",
    [
        ["sample", "s3://bucket/run", "--num", "1"],
        ["checkpoints", "list", "s3://bucket/run"],
        ["checkpoints", "verify", "s3://bucket/run"],
    ],
)
def test_an_unreachable_store_is_one_line_and_exit_1(tmp_path, command):
    from conftest import free_port

    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    options = {
        "endpoint_url": endpoint,
        "key": "AKIDEXAMPLE",
        "secret": "s3cr3t-never-printed",
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    out = ["--out", str(tmp_path / "grid.png")] if command[0] == "sample" else []
    r = run_cli(*command, *out, "--storage-options", json.dumps(options))
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "s3cr3t-never-printed" not in r.stderr, r.stderr[-3000:]
    said = [line for line in r.stderr.splitlines() if "127.0.0.1" in line]
    assert len(said) == 1 and said[0].startswith("gentrain: checkpoint error: cannot "), r.stderr[-3000:]
    assert "s3://bucket/run" in said[0] and "EndpointConnectionError" in said[0], said


@pytest.mark.parametrize("bad", ["unet.model.safetensors", "unet.ema.safetensors"])
def test_verify_names_the_file_whose_tensor_has_the_wrong_shape(tmp_path, bad):
    from ckpt_tamper import edit_tensors, step_dir

    root = tmp_path / "checkpoints"
    shutil.copytree(DDPM, root)
    key = ""

    def reshape(tensors: dict) -> dict:
        nonlocal key
        key = sorted(k for k, t in tensors.items() if t.ndim == 4)[0]
        tensors[key] = tensors[key].reshape(tensors[key].shape[0], -1).contiguous()
        return tensors

    edit_tensors(root, 2, bad, reshape)
    r = run_cli("checkpoints", "verify", str(step_dir(root, 2)))
    assert r.returncode == 1, r.stdout + r.stderr[-2000:]
    other = ({"unet.model.safetensors", "unet.ema.safetensors"} - {bad}).pop()
    assert f"{bad}: {key} has shape [" in r.stdout and other not in r.stdout, r.stdout
