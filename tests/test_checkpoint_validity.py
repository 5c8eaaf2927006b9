"""A checkpoint root holds whatever anyone with write access put there: discovery, verify, resume, sampling,
retention and re-saves agree on what is valid, fall back past anything else, and never lose a valid one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from ckpt_tamper import edit_json, edit_tensors, flip_byte, manifest, read_tensors, replace_file, step_dir
from conftest import REPO, TINY, clean_env, run_cli, tiny
from helpers import assert_tensors_equal

from trainer.checkpoint import CheckpointStore
from trainer.checkpoint.format import DTYPE_NAMES
from trainer.checkpoint.layout import eval_result_name
from trainer.checkpoint.validity import FrozenRecord
from trainer.errors import CheckpointCorrupt, ConfigError
from trainer.registry import load_config, task_class
from trainer.runs import fit_problems
from trainer.tasks.base import FrozenWeights, TaskContext

STEPS = ("unet.model.safetensors", "unet.ema.safetensors", "unet.optimizer.safetensors")


@pytest.fixture(scope="module")
def run4(tmp_path_factory) -> tuple[Path, list[str]]:
    """A real 4-step digits-ddpm run with checkpoints at steps 2 and 4; its args rerun it."""
    base = tmp_path_factory.mktemp("run4")
    args = tiny(base, "checkpoint.every_steps=2", "checkpoint.keep=10", max_steps=4)
    r = run_cli("train", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return base / "run" / "checkpoints", args


@pytest.fixture
def root(run4, tmp_path) -> Path:
    """A private copy of the run's checkpoint root (tests tamper with it)."""
    out = tmp_path / "run" / "checkpoints"
    shutil.copytree(run4[0], out)
    return out


def rerun(root: Path, *extra: str, max_steps: int = 4) -> subprocess.CompletedProcess:
    args = tiny(root.parent.parent, "checkpoint.every_steps=2", "checkpoint.keep=10", *extra, max_steps=max_steps)
    return run_cli("train", *args)


def no_traceback(r: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in r.stderr + r.stdout, (r.stdout + r.stderr)[-3000:]


def assert_same_step(root: Path, reference: Path, step: int) -> None:
    for name in STEPS:
        assert_tensors_equal(
            read_tensors(root, step, name), read_tensors(reference, step, name), f"{name} vs uninterrupted"
        )


# ------------------------------------------------------------------ 1. a re-save replaces an invalid step


@pytest.mark.slow
def test_retrained_step_replaces_the_corrupt_checkpoint_it_fell_back_from(root, run4):
    flip_byte(root, 4, "unet.ema.safetensors")
    r = rerun(root)
    assert r.returncode == 0, r.stderr[-3000:]
    no_traceback(r)
    assert "trying the previous one" in r.stderr
    assert "is invalid" in r.stderr and "replacing it" in r.stderr
    assert run_cli("checkpoints", "verify", str(step_dir(root, 4))).returncode == 0
    assert_same_step(root, run4[0], 4)  # resumed at step 2, re-trained 3-4 exactly


def test_retention_counts_only_valid_checkpoints(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=2)
    for step in (2, 4):
        store.write(step, {"w.safetensors": {"w": torch.full((64,), float(step))}}, {})
    flip_byte(tmp_path, 4, "w.safetensors")  # step 4 keeps its size: only its digest tells
    store2 = CheckpointStore(str(tmp_path), keep=2)  # a new process: nothing verified yet
    store2.write(6, {"w.safetensors": {"w": torch.full((64,), 6.0)}}, {})
    assert store2.steps() == [2, 6], "the corrupt step 4 must not count; step 2 is one of the 2 valid ones"


# ------------------------------------------------------------------ 2. malformed entries anywhere in the root


MALFORMED = {
    "files-is-a-list": lambda m: {**m, "files": list(m["files"])},
    "bytes-is-text": lambda m: {**m, "files": {k: {**v, "bytes": "abc"} for k, v in m["files"].items()}},
    "bytes-missing": lambda m: {**m, "files": {k: {"blake3": v["blake3"]} for k, v in m["files"].items()}},
    "top-level-list": lambda m: [m],
    "path-escape": lambda m: {**m, "files": {"../../x.json": next(iter(m["files"].values()))}},
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_manifest_in_an_older_step_is_one_invalid_candidate(root, case):
    path = step_dir(root, 2) / "manifest.json"
    path.write_text(json.dumps(MALFORMED[case](manifest(root, 2))))
    infos = CheckpointStore(str(root)).list()
    assert [(i.step, i.valid) for i in infos] == [(2, False), (4, True)]
    assert infos[0].reason


@pytest.mark.slow
def test_list_verify_sample_and_train_survive_a_stray_file_and_a_malformed_manifest(root, tmp_path):
    (root / "step-000000009").write_text("not a checkpoint")
    path = step_dir(root, 2) / "manifest.json"
    path.write_text(json.dumps(MALFORMED["bytes-is-text"](manifest(root, 2))))
    listed = run_cli("checkpoints", "list", str(root))
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert "INVALID" in listed.stdout and "valid (LATEST)" in listed.stdout
    verified = run_cli("checkpoints", "verify", str(root))
    assert verified.returncode == 0 and "step 4" in verified.stdout, verified.stdout + verified.stderr
    sampled = run_cli("sample", str(root), "--num", "2", "--out", str(tmp_path / "g.png"), "--steps", "2")
    assert sampled.returncode == 0, sampled.stderr[-2000:]
    trained = rerun(root, max_steps=6)
    assert trained.returncode == 0, trained.stderr[-3000:]
    for r in (listed, verified, sampled, trained):
        no_traceback(r)
    assert (root / "step-000000009").read_text() == "not a checkpoint"  # not ours to delete


# ------------------------------------------------------------------ 3. digest-consistent but malformed payloads


def _header_too_long(root):
    data = bytearray((step_dir(root, 4) / "unet.ema.safetensors").read_bytes())
    data[:8] = (2**62).to_bytes(8, "little")
    replace_file(root, 4, "unet.ema.safetensors", bytes(data))


def _header_not_json(root):
    data = bytearray((step_dir(root, 4) / "unet.model.safetensors").read_bytes())
    data[8:12] = b"}}}}"
    replace_file(root, 4, "unet.model.safetensors", bytes(data))


def _header_dtype_list(root):
    """Found by the fuzz suite: a dtype that is a JSON list made the header check raise TypeError."""
    data = (step_dir(root, 4) / "unet.model.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    key = next(k for k in header if k != "__metadata__")
    header[key]["dtype"] = ["F32"]
    raw = json.dumps(header).encode()
    replace_file(root, 4, "unet.model.safetensors", len(raw).to_bytes(8, "little") + raw + data[8 + n :])


def _progress(edit):
    def tamper(root):
        edit_json(root, 4, "trainer.json", lambda d: {**d, "progress": edit(d["progress"])})

    return tamper


def _ema_wrong_shape(root):
    def edit(t):
        key = sorted(k for k in t if t[k].ndim == 4)[0]
        t[key] = torch.zeros(t[key].shape[0] + 1, *t[key].shape[1:])
        return t

    edit_tensors(root, 4, "unet.ema.safetensors", edit)


def _rewrite_header(root, name, edit, encoding="utf-8"):
    """Rewrite a safetensors file's header with `edit(header)`, encoded as `encoding`, data unchanged."""
    data = (step_dir(root, 4) / name).read_bytes()
    n = int.from_bytes(data[:8], "little")
    raw = json.dumps(edit(json.loads(data[8 : 8 + n]))).encode(encoding)
    replace_file(root, 4, name, len(raw).to_bytes(8, "little") + raw + data[8 + n :])


def _header_utf16(root):
    """#35: Python's json reads a UTF-16 header, the safetensors library does not (verify said valid, then
    resume, sample and export crashed)."""
    _rewrite_header(root, "unet.ema.safetensors", lambda h: h, encoding="utf-16")


def _header_dim_2_64(root):
    """#35: a zero-size tensor with a dimension of 2^64: Python's arithmetic takes it, the library does not."""
    _rewrite_header(root, "rank-00000.safetensors", lambda h: {**h, "pad": _empty_at_end(h, [2**64, 0])})


def _header_dim_2_63(root):
    """The library takes 2^63 (an unsigned 64-bit size), torch does not (its sizes are signed)."""
    _rewrite_header(root, "rank-00000.safetensors", lambda h: {**h, "pad": _empty_at_end(h, [2**63, 0])})


def _empty_at_end(header, shape):
    end = max(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__")
    return {"dtype": "U8", "shape": shape, "data_offsets": [end, end]}


def _rng_python_position(root):
    """#35: Python's Mersenne Twister position 1000 fits the schema (< 2^32); `random.setstate` refuses it."""

    def edit(doc):
        doc["rng"]["python"][1][-1] = 1000
        return doc

    edit_json(root, 4, "rank-00000.json", edit)


def _rng_torch_short(root):
    """A torch CPU RNG state of the right dtype and rank but the wrong length: `torch.set_rng_state` refuses it."""
    edit_tensors(root, 4, "rank-00000.safetensors", lambda t: {**t, "torch_cpu": t["torch_cpu"][:10].clone()})


def _ema_decay(root):
    """An EMA decay of 5: the right type, but diffusers' EMAModel.load_state_dict refuses it."""

    def edit(doc):
        doc["parts"]["unet"]["ema"]["decay"] = 5.0
        return doc

    edit_json(root, 4, "trainer.json", edit)


def _schedule_without_lambdas(root):
    """A learning-rate schedule state without its `lr_lambdas`: LambdaLR.load_state_dict raises KeyError."""

    def edit(doc):
        del doc["parts"]["unet"]["lr_schedule"]["lr_lambdas"]
        return doc

    edit_json(root, 4, "trainer.json", edit)


def _optimizer_setting(key, value):
    """An optimizer setting of the wrong type (#47): torch's Optimizer.load_state_dict takes it as it is, and
    the first fused AdamW step after the resume crashed (exit 1, at every restart)."""

    def tamper(root):
        def edit(doc):
            doc["parts"]["unet"]["optimizer"]["param_groups"][0][key] = value
            return doc

        edit_json(root, 4, "trainer.json", edit)

    return tamper


# Loader-refused payloads (#35): each passed verify before, then crashed the loader that reads it.
LOADER_REFUSED = {
    "optimizer-lr-string": _optimizer_setting("lr", "high"),
    "optimizer-betas-one": _optimizer_setting("betas", [0.9]),
    "safetensors-header-utf16": _header_utf16,
    "safetensors-dim-2^64": _header_dim_2_64,
    "safetensors-dim-2^63": _header_dim_2_63,
    "rng-python-position": _rng_python_position,
    "rng-torch-short": _rng_torch_short,
    "ema-decay-out-of-range": _ema_decay,
    "lr-schedule-no-lambdas": _schedule_without_lambdas,
}


PAYLOADS = {
    "safetensors-header-2^62": _header_too_long,
    "safetensors-header-not-json": _header_not_json,
    "safetensors-dtype-list": _header_dtype_list,
    "trainer-json-list": lambda root: edit_json(root, 4, "trainer.json", lambda d: [d]),
    "step-null": _progress(lambda p: {**p, "step": None}),
    "cursor-negative": _progress(lambda p: {**p, "cursor": -64}),
    "rng-string": lambda root: edit_json(root, 4, "rank-00000.json", lambda d: {"rng": "abc"}),
    "ema-wrong-shape": _ema_wrong_shape,
    **LOADER_REFUSED,
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(PAYLOADS))
def test_verify_finds_digest_consistent_malformed_payloads(root, case):
    PAYLOADS[case](root)
    store = CheckpointStore(str(root))
    info = store.check(4)
    assert info.valid, "sizes and digests agree: only the structure is wrong"
    assert store.verify(info), f"{case} passed verify"
    assert store.latest_valid(deep=True).step == 2


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", ["safetensors-header-2^62", "cursor-negative", "ema-wrong-shape", "rng-string", *sorted(LOADER_REFUSED)]
)
def test_resume_falls_back_past_a_malformed_payload_and_ends_bit_identical(root, run4, case):
    PAYLOADS[case](root)
    r = rerun(root)
    assert r.returncode == 0, r.stderr[-3000:]
    no_traceback(r)
    assert "trying the previous one" in r.stderr
    assert_same_step(root, run4[0], 4)


@pytest.mark.slow
def test_verify_sample_and_export_refuse_a_header_only_python_can_read_without_a_traceback(root, tmp_path):
    # #35: the EMA weights' header in UTF-16. verify said valid; sample and export then crashed in the
    # safetensors library with a traceback. Now verify, sample and export of that step say why (exit 1),
    # and on the root all three use step 2, the newest the loaders accept.
    _header_utf16(root)
    named = str(step_dir(root, 4))
    for args in (
        ["checkpoints", "verify", named],
        ["sample", named, "--num", "1", "--steps", "1", "--out", str(tmp_path / "a.png")],
        ["checkpoints", "export", named, str(tmp_path / "export-4")],
    ):
        r = run_cli(*args)
        no_traceback(r)
        assert r.returncode == 1 and "unreadable safetensors header" in r.stdout + r.stderr, (r.stdout + r.stderr)[
            -2000:
        ]
    verified = run_cli("checkpoints", "verify", str(root))
    assert verified.returncode == 0 and "(step 2," in verified.stdout, verified.stdout + verified.stderr[-2000:]
    sampled = run_cli("sample", str(root), "--num", "1", "--steps", "1", "--out", str(tmp_path / "b.png"))
    assert sampled.returncode == 0 and "(step 2)" in sampled.stdout, sampled.stderr[-2000:]
    exported = run_cli("checkpoints", "export", str(root), str(tmp_path / "export"))
    assert exported.returncode == 0, exported.stderr[-2000:]
    no_traceback(exported)


def test_trainer_json_is_written_from_its_model_as_the_json_it_always_was_and_a_bad_one_is_refused():
    """A save builds trainer.json as a TrainerState (issue 51): the progress' keys in the order its state_dict
    gives them, a LoRA part's "weights" first, nothing added; read back and written again, the same bytes; a
    state that is not one is CheckpointCorrupt naming the field, before anything is written."""
    from trainer.checkpoint.validity import PartState, parse_trainer_json, trainer_json

    progress = {"step": 3, "cursor": 6, "epoch": 0, "skipped_samples": 0, "skipped_files": [], "world_size": 1}
    progress |= {"seed": 7, "time_unix": 1.5, "trackers": {}, "rng_stream": 2}
    group = {"params": [0], "lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    part = PartState(
        weights="trainable",
        step=3,
        optimizer={"state": {}, "param_groups": [group]},
        optimizer_name="adamw",
        lr_schedule=None,
        scaler=None,
        ema=None,
    )
    frozen = {"ae": FrozenRecord(url="/ae/step-000000003", step=3, file="g.ema.safetensors", digest="blake3:0")}
    raw = trainer_json(progress, {"unet": part}, frozen)
    doc = json.loads(raw)
    assert raw == json.dumps(doc, indent=1).encode() and list(doc) == ["progress", "parts", "frozen"]
    assert doc["progress"] == progress and list(doc["progress"]) == list(progress)
    keys = ["weights", "step", "optimizer", "optimizer_name", "lr_schedule", "scaler", "ema"]  # as it always was
    assert list(doc["parts"]["unet"]) == keys
    state = parse_trainer_json(raw, 3)
    assert state.parts["unet"].weights == "trainable" and state.frozen["ae"].digest == "blake3:0"
    assert trainer_json(state.progress.dump(), state.parts, state.frozen) == raw
    with pytest.raises(CheckpointCorrupt, match="trainer.json .*progress.world_size"):
        trainer_json({**progress, "world_size": 0}, {"unet": part}, frozen)


def test_verify_accepts_exactly_the_rng_states_the_setters_accept():
    import random

    import numpy as np

    from trainer.checkpoint.validity import check_rank_tensors, parse_rank_json
    from trainer.randomness import rng_state

    tensors, values = rng_state()
    before = (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state())
    parse_rank_json(json.dumps({"rng": values}).encode())
    check_rank_tensors(tensors, "rank-00000.safetensors")
    for edit in (
        lambda v: v["python"][1].__setitem__(-1, 625),  # the position past the 624 words
        lambda v: v["python"].__setitem__(0, 7),  # a state version Python does not know
        lambda v: v["numpy"].__setitem__(0, "PCG64"),  # numpy's legacy setter takes MT19937 only
        lambda v: v["numpy"].__setitem__(3, 2**70),  # has_gauss past a C long
    ):
        bad = json.loads(json.dumps(values))
        edit(bad)
        with pytest.raises(CheckpointCorrupt, match="cannot be set"):
            parse_rank_json(json.dumps({"rng": bad}).encode())
    with pytest.raises(CheckpointCorrupt, match="cannot be set"):
        check_rank_tensors({"torch_cpu": tensors["torch_cpu"][:-1].clone()}, "rank-00000.safetensors")
    # The checks set scratch generators only: the process's own streams are where they were.
    assert random.getstate() == before[0] and np.random.get_state()[1].tolist() == before[1]
    assert torch.equal(torch.get_rng_state(), before[2])


# ------------------------------------------------------------------ 4. sample / eval on a corrupt newest


@pytest.mark.slow
def test_sample_reads_only_what_it_loads_and_a_root_skips_a_newest_whose_weights_fail_their_digest(root, tmp_path):
    # #51, read what you load: the optimizer state (never read by sampling) fails its digest. `verify` checks
    # every file and says invalid; `sample` of that step reads the EMA weights and trainer.json only and draws.
    flip_byte(root, 4, "unet.optimizer.safetensors")
    verified = run_cli("checkpoints", "verify", str(step_dir(root, 4)))
    assert verified.returncode == 1 and "unet.optimizer.safetensors" in verified.stdout, verified.stdout
    drawn = run_cli("sample", str(step_dir(root, 4)), "--num", "1", "--out", str(tmp_path / "a.png"), "--steps", "1")
    assert drawn.returncode == 0 and "(step 4)" in drawn.stdout, drawn.stderr[-2000:]
    # The EMA weights it does load fail theirs: the step dir is refused naming the file (exit 1), the root
    # falls back to the newest checkpoint whose loaded files pass, with a warning naming the one skipped.
    flip_byte(root, 4, "unet.ema.safetensors")
    r = run_cli("sample", str(root), "--num", "2", "--out", str(tmp_path / "g.png"), "--steps", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    no_traceback(r)
    assert "(step 2)" in r.stdout and "skipping checkpoint" in r.stderr and "step-000000004" in r.stderr
    named = run_cli("sample", str(step_dir(root, 4)), "--num", "2", "--out", str(tmp_path / "h.png"))
    assert named.returncode == 1 and "does not match" in named.stderr, named.stderr[-2000:]
    assert "unet.ema.safetensors" in named.stderr
    no_traceback(named)


@pytest.mark.slow
def test_eval_on_a_root_whose_newest_fails_its_digest_evaluates_the_newest_valid(root, tmp_path):
    flip_byte(root, 4, "unet.ema.safetensors")  # the weights eval loads (EMA): it reads what it loads only
    r = run_cli("eval", str(root), "--num", "8", "--steps", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    no_traceback(r)
    assert (root / eval_result_name(2)).is_file() and not (root / eval_result_name(4)).exists()
    assert json.loads(r.stdout.splitlines()[0])["step"] == 2


@pytest.mark.slow
def test_sample_says_which_weights_do_not_fit_the_model_when_model_and_ema_agree_on_a_wrong_shape(root, tmp_path):
    # Digest-consistent and self-consistent (model and EMA alike), so only building the model tells.
    def grow(t):
        key = sorted(k for k in t if t[k].ndim == 4)[0]
        t[key] = torch.zeros(t[key].shape[0] + 1, *t[key].shape[1:])
        return t

    for name in ("unet.model.safetensors", "unet.ema.safetensors"):
        edit_tensors(root, 4, name, grow)
    r = run_cli("sample", str(step_dir(root, 4)), "--num", "1", "--out", str(tmp_path / "g.png"), "--steps", "1")
    assert r.returncode == 1, r.stderr[-2000:]
    no_traceback(r)
    assert "gentrain: checkpoint error:" in r.stderr and "do not fit its model" in r.stderr, r.stderr[-2000:]
    assert "unet.ema.safetensors" in r.stderr


def _grow(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The first 4-d weight one output channel wider: the same edit in model and EMA keeps them consistent."""
    key = sorted(k for k in tensors if tensors[k].ndim == 4)[0]
    tensors[key] = torch.zeros(tensors[key].shape[0] + 1, *tensors[key].shape[1:])
    return tensors


def _fit_checkpoint(root: Path, step: int, grown: bool, sharded: bool = False, task: str | None = None, **model):
    """A checkpoint of the tiny digits-ddpm model written in-process (no training): its weights, one 4-d
    weight grown in both files when `grown`, in one file per kind or as one rank's shards with shards.json."""
    cfg = load_config("digits-ddpm", TINY)
    ctx = TaskContext(cfg.data.image_size, cfg.data.channels, cfg.seed, load_pretrained=False)
    weights = dict(task_class(cfg.task)(cfg.model_cfg, ctx).build({})["unet"].state_dict())
    key = sorted(k for k in weights if weights[k].ndim == 4)[0]
    shape = list(weights[key].shape)
    if grown:
        weights = _grow(weights)
    doc = cfg.to_dict()
    if task is not None:
        doc["task"] = task
    doc["model"].update(model)
    files: dict = {}
    if not sharded:
        files = {"unet.model.safetensors": weights, "unet.ema.safetensors": dict(weights)}
    else:
        index = {}
        for kind in ("model", "ema"):
            name = f"unet.{kind}.rank-00000.safetensors"
            files[name] = dict(weights)
            index[f"unet.{kind}"] = {
                k: {
                    "dtype": DTYPE_NAMES[t.dtype],
                    "shape": list(t.shape),
                    "chunks": [{"file": name, "offsets": [0] * t.ndim, "sizes": list(t.shape)}],
                }
                for k, t in weights.items()
            }
        files["shards.json"] = json.dumps({"version": 1, "world_size": 1, "tensors": index}).encode()
    store = CheckpointStore(str(root))
    store.write(step, files, {"config": doc, "world_size": 1})
    info = store.check(step)
    assert info.valid and not store.verify(info), "a consistent checkpoint: only its model tells"
    return store, info, key, shape


@pytest.mark.parametrize("sharded", [False, True], ids=["whole-files", "sharded"])
def test_fit_problems_name_each_file_and_key_that_does_not_fit_the_model(tmp_path, sharded):
    store, info, *_ = _fit_checkpoint(tmp_path, 2, grown=False, sharded=sharded)
    cache: dict = {}
    assert fit_problems(store.view(info), cache=cache) == []
    store, info, key, shape = _fit_checkpoint(tmp_path, 4, grown=True, sharded=sharded)
    files = ["unet.model", "unet.ema"] if sharded else ["unet.model.safetensors", "unet.ema.safetensors"]
    want = [f"{name}: {key} has shape {[shape[0] + 1, *shape[1:]]}, the model's is {shape}" for name in files]
    assert fit_problems(store.view(info)) == want
    assert fit_problems(store.view(info), cache=cache) == want and len(cache) == 1  # one config: built once


@pytest.mark.slow
def test_verify_refuses_optimizer_groups_that_do_not_fit_the_model(root):
    # #47: a parameter moved from one optimizer group to the other. Both groups parse, but torch's
    # Optimizer.load_state_dict refuses groups of other sizes than the model's optimizer has.
    def edit(doc):
        groups = doc["parts"]["unet"]["optimizer"]["param_groups"]
        groups[1]["params"].append(groups[0]["params"].pop())
        return doc

    store = CheckpointStore(str(root))
    assert fit_problems(store.view(store.check(4))) == []
    edit_json(root, 4, "trainer.json", edit)
    problems = fit_problems(store.view(store.check(4)))
    assert len(problems) == 1 and "parts.unet.optimizer has parameter groups of" in problems[0], problems
    r = run_cli("checkpoints", "verify", str(root))
    assert r.returncode == 1 and "parameter groups" in r.stdout + r.stderr, r.stdout + r.stderr
    no_traceback(r)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["optimizer-lr-string", "optimizer-betas-one"])
def test_verify_says_invalid_for_optimizer_settings_of_the_wrong_type(root, case):
    # #47: verify called these valid, and every resume then crashed in the optimizer's first step.
    LOADER_REFUSED[case](root)
    r = run_cli("checkpoints", "verify", str(root / "step-000000004"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "INVALID" in r.stdout and "param_groups[0]" in r.stdout + r.stderr, r.stdout + r.stderr
    no_traceback(r)


def test_fit_problems_import_no_task_a_checkpoint_names_by_import_path_unless_the_user_names_it(tmp_path):
    store, info, *_ = _fit_checkpoint(tmp_path, 2, grown=True, task="nowhere_module_xyz:Task")
    with pytest.raises(ConfigError, match="import path"):
        fit_problems(store.view(info))
    assert "nowhere_module_xyz" not in sys.modules
    with pytest.raises(ConfigError, match="must be the same"):
        fit_problems(store.view(info), "ddpm")


def test_fit_problems_skip_a_frozen_part_and_shape_the_others_from_its_recorded_sources_config(tmp_path):
    vq_cfg = load_config("digits-vqgan")
    source = CheckpointStore(str(tmp_path / "vq"))
    source.write(2, {"a.json": b"{}"}, {"config": vq_cfg.to_dict()})  # its config only: no weights are read
    cfg = load_config("digits-maskgit", [f"model.tokenizer.url={tmp_path / 'vq'}", "model.dim=16", "model.depth=1"])
    record = FrozenRecord(url=source.url_for(2), step=2, file="generator.ema.safetensors", digest="blake3:00")
    ctx = TaskContext(cfg.data.image_size, cfg.data.channels, cfg.seed, load_pretrained=False)
    modules = task_class(cfg.task)(cfg.model_cfg, ctx).build({"tokenizer": FrozenWeights(vq_cfg, {}, record)})
    assert set(modules) == {"tokenizer", "transformer"}
    weights = dict(modules["transformer"].state_dict())
    store = CheckpointStore(str(tmp_path / "mg"))
    meta = {"config": cfg.to_dict(), "frozen": {"tokenizer": record.model_dump()}}
    store.write(2, {"transformer.model.safetensors": weights, "transformer.ema.safetensors": weights}, meta)
    assert fit_problems(store.view(store.check(2))) == []  # no tokenizer files: frozen parts are skipped
    key = sorted(k for k, t in weights.items() if t.ndim == 2)[0]
    grown = {**weights, key: torch.zeros(weights[key].shape[0] + 1, weights[key].shape[1])}
    store.write(4, {"transformer.model.safetensors": grown, "transformer.ema.safetensors": weights}, meta)
    assert fit_problems(store.view(store.check(4))) == [
        f"transformer.model.safetensors: {key} has shape {list(grown[key].shape)}, "
        f"the model's is {list(weights[key].shape)}"
    ]
    shutil.rmtree(tmp_path / "vq")
    with pytest.raises(ConfigError, match="frozen part 'tokenizer': its recorded source .* is not valid"):
        fit_problems(store.view(store.check(2)))


def test_fit_problems_load_no_text_encoder_a_checkpoint_names_unless_the_user_names_it(tmp_path):
    doc = load_config("digits-cascade-text").to_dict()
    doc["model"]["text"]["encoder"] = str(tmp_path / "someones-encoder")
    store = CheckpointStore(str(tmp_path / "ckpt"))
    store.write(2, {"a.json": b"{}"}, {"config": doc})
    with pytest.raises(ConfigError, match="--text-encoder"):
        fit_problems(store.view(store.check(2)))


def test_fit_problems_says_when_the_checkpoints_config_builds_no_model(tmp_path, monkeypatch):
    store, info, *_ = _fit_checkpoint(tmp_path, 2, grown=False, norm_num_groups=5)
    # The schema's check: the stored config cannot be used, so the checkpoint cannot (as in `sample`).
    with pytest.raises(
        CheckpointCorrupt, match=r"(?s)config in its manifest is not valid.*divisible by model.norm_num_groups=5"
    ):
        fit_problems(store.view(info))
    store, info, *_ = _fit_checkpoint(tmp_path, 4, grown=False)

    def fails(self, frozen):  # a config that passes the schema and fails in a model's constructor
        raise ValueError("8 channels in 5 groups")

    monkeypatch.setattr(task_class("ddpm"), "build", fails)
    with pytest.raises(ConfigError, match=r"builds no model \(ValueError: 8 channels in 5 groups\)"):
        fit_problems(store.view(info))


@pytest.mark.slow
def test_verify_and_list_say_which_weights_do_not_fit_the_model_when_model_and_ema_agree_on_a_wrong_shape(root):
    ok = run_cli("checkpoints", "verify", str(root))
    assert ok.returncode == 0 and "weights fit the model" in ok.stdout, ok.stdout + ok.stderr[-2000:]
    for name in ("unet.model.safetensors", "unet.ema.safetensors"):
        edit_tensors(root, 4, name, _grow)
    key = sorted(k for k, t in read_tensors(root, 4, "unet.ema.safetensors").items() if t.ndim == 4)[0]
    for url in (str(root), str(step_dir(root, 4))):
        r = run_cli("checkpoints", "verify", url)
        assert r.returncode == 1, r.stdout + r.stderr[-2000:]
        no_traceback(r)
        assert f"INVALID: {step_dir(root, 4)}" in r.stdout, r.stdout
        assert f"unet.ema.safetensors: {key} has shape [" in r.stdout, r.stdout
        assert f"unet.model.safetensors: {key} has shape [" in r.stdout, r.stdout
    r = run_cli("checkpoints", "verify", str(step_dir(root, 2)))
    assert r.returncode == 0 and "weights fit the model" in r.stdout, r.stdout + r.stderr[-2000:]
    listed = run_cli("checkpoints", "list", str(root))
    assert listed.returncode == 0, listed.stderr[-2000:]
    no_traceback(listed)
    rows = {line.split()[0]: line for line in listed.stdout.splitlines()[1:]}
    assert "INVALID" in rows["4"] and f"unet.ema.safetensors: {key} has shape" in rows["4"], listed.stdout
    assert "INVALID" not in rows["2"] and " valid" in rows["2"], listed.stdout


@pytest.mark.slow
def test_verify_says_it_did_not_check_the_fit_of_a_checkpoint_whose_task_is_an_import_path(tmp_path):
    _fit_checkpoint(tmp_path, 2, grown=True, task="nowhere_module_xyz:Task")
    r = run_cli("checkpoints", "verify", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    no_traceback(r)
    assert "weights not checked against a model" in r.stdout and "--task nowhere_module_xyz:Task" in r.stdout
    listed = run_cli("checkpoints", "list", str(tmp_path))
    assert listed.returncode == 0 and "step 2: weights not checked against a model" in listed.stdout, listed.stdout


# ------------------------------------------------------------------ 5. links are never followed


@pytest.mark.slow
def test_retention_never_deletes_through_a_step_dir_that_is_a_link(root, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(step_dir(root, 2), outside)
    shutil.rmtree(step_dir(root, 2))
    os.symlink(outside, step_dir(root, 2))
    before = sorted(p.name for p in outside.iterdir())
    r = rerun(root, "checkpoint.keep=1", max_steps=8)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in outside.iterdir()) == before, "retention deleted files outside the root"
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "step-000000002", "step-000000008"]
    assert CheckpointStore(str(root)).check(2).reason.startswith("is a symbolic link")


@pytest.mark.slow
def test_a_link_named_like_the_step_being_saved_is_replaced_by_a_real_checkpoint_and_its_target_kept(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    CheckpointStore(str(outside)).write(2, {"w.safetensors": {"w": torch.zeros(8)}}, {})
    root.mkdir()
    os.symlink(step_dir(outside, 2), step_dir(root, 2))
    before = sorted(p.name for p in step_dir(outside, 2).iterdir())
    store = CheckpointStore(str(root))
    store.write(2, {"w.safetensors": {"w": torch.ones(8)}}, {})
    assert not os.path.islink(step_dir(root, 2)) and store.check(2).valid
    assert_tensors_equal(read_tensors(root, 2, "w.safetensors")["w"], torch.ones(8), "the new checkpoint")
    assert sorted(p.name for p in step_dir(outside, 2).iterdir()) == before, "the link's target was touched"
    assert_tensors_equal(read_tensors(outside, 2, "w.safetensors")["w"], torch.zeros(8), "the link's target")


# ------------------------------------------------------------------ 6. a failed save leaves no debris


@pytest.mark.slow
def test_a_save_that_fills_the_disk_leaves_no_partial_step_dir(tmp_path):
    # RLIMIT_FSIZE makes the kernel refuse writes past 64 KiB, as a full disk would (EFBIG instead of ENOSPC).
    script = textwrap.dedent(
        f"""
        import resource, signal, torch
        from trainer.checkpoint import CheckpointStore, CheckpointError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        store = CheckpointStore({str(tmp_path)!r})
        store.write(1, {{"w.safetensors": {{"w": torch.zeros(16)}}}}, {{}})
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
        try:
            store.write(2, {{"a.safetensors": {{"w": torch.zeros(1 << 16)}}}}, {{}})
        except OSError as e:
            print("refused", e.errno)
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, env=clean_env(), timeout=120
    )
    assert "refused" in r.stdout, r.stdout + r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step-000000001"]
