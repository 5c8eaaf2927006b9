"""Video data: Moving Digits, clip folders decoded with PyAV, joint image+video batches, clips in shards."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import REPO, clean_env, run_cli

from trainer.config import ConfigError, load_config
from trainer.data import build_splits, build_train_loader
from trainer.data.datasets import DIGIT_WORDS
from trainer.data.video import DIRECTIONS, MovingDigitsDataset

PROBE_ENV = {"PYTHONPATH": str(REPO / "tests")}
CLIP_PROBE = str(REPO / "tests" / "video_probe.yaml")


def centre_of_mass(frame: torch.Tensor) -> tuple[float, float]:
    w = (frame + 1).sum(0)  # background is -1: weight 0
    ys, xs = torch.meshgrid(torch.arange(w.shape[0]), torch.arange(w.shape[1]), indexing="ij")
    return float((w * ys).sum() / w.sum()), float((w * xs).sum() / w.sum())


def test_moving_digits_are_deterministic_and_move_as_captioned():
    a, b = MovingDigitsDataset(32, 1, 6), MovingDigitsDataset(32, 1, 6)
    assert len(a) == 1797 * 4 and a.num_classes == 40
    for i in (0, 1, 2, 3, 101, 7187):
        clip, label, extras = a.load(i, aug_seed=i * 7, flip=False)
        again, _, _ = b.load(i, aug_seed=0, flip=False)
        assert torch.equal(clip, again)  # a function of the index alone
        assert clip.shape == (6, 1, 32, 32) and clip.min() >= -1 and clip.max() <= 1
        digit, direction = label % 10, label // 10
        words = extras["caption"].split()
        assert words[-1] == DIRECTIONS[direction] and words[-3] == DIGIT_WORDS[digit]
        assert int(extras["frames"]) == 6
        # The digit never leaves the canvas: every frame holds the same ink.
        ink = (clip + 1).sum(dim=(1, 2, 3))
        assert torch.allclose(ink, ink[0].expand_as(ink), rtol=1e-5)
        ys, xs = zip(*(centre_of_mass(f) for f in clip), strict=True)
        along, across = (xs, ys) if DIRECTIONS[direction] in ("left", "right") else (ys, xs)
        sign = 1 if DIRECTIONS[direction] in ("right", "down") else -1
        steps = [sign * (q - p) for p, q in zip(along, along[1:], strict=False)]
        assert all(s > 2 for s in steps), (extras["caption"], along)  # 16 px over 5 steps: >= 3 px each
        assert max(across) - min(across) < 1e-4
    # Four directions per digit, each labelled direction * 10 + digit.
    labels = [a.load(i, 0, False)[1] for i in range(4)]
    assert [lab // 10 for lab in labels] == [0, 1, 2, 3] and len({lab % 10 for lab in labels}) == 1


def test_moving_digits_config_and_batches():
    cfg = load_config(None, ["data.source=moving-digits", "data.num_frames=4", "train.batch_size=6"])
    assert cfg.data.image_size == 16  # the preset sets it; 32 is only the default when nothing does
    train, val, num_classes = build_splits(cfg)
    assert num_classes == 40 and len(train) + len(val) == 1797 * 4
    batch = next(iter(build_train_loader(train, cfg, 0, 0, 1)))
    assert batch["images"].shape == (6, 4, 1, 16, 16)
    assert batch["extras"]["frames"].tolist() == [4] * 6 and batch["extras"]["frames"].dtype == torch.int64
    assert all(" moving " in c for c in batch["captions"])
    with pytest.raises(ConfigError, match="data.flip"):
        load_config(None, ["data.source=moving-digits", "data.flip=true"])
    with pytest.raises(ConfigError, match="num_frames"):
        load_config(None, ["data.source=moving-digits", "data.num_frames=0"])


def test_moving_digits_train_validate_and_preview_clips(tmp_path):
    """The loop, validation and previews carry (N, T, C, H, W) batches unchanged (probe task checks them)."""
    log = tmp_path / "probe.jsonl"
    args = [
        "train",
        CLIP_PROBE,
        f"run.dir={tmp_path}/run",
        "train.max_steps=2",
        "train.val_every_steps=2",
        "train.val_batches=1",
    ]
    r = run_cli(*args, env=clean_env(**PROBE_ENV, VIDEO_PROBE_LOG=str(log)))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1]
    assert all(x["shape"] == [4, 3, 1, 8, 8] and x["frames"] == [3] * 4 for x in lines)
    assert "val/mse=" in r.stderr
    samples = tmp_path / "run" / "samples"
    gif = samples / "step-000000002-reconstruction.gif"
    assert gif.is_file() and (samples / "step-000000002-reconstruction.png").is_file()
    import av

    with av.open(str(gif)) as c:
        assert sum(1 for _ in c.decode(video=0)) == 3
