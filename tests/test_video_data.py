"""Video data: Moving Digits, clip folders decoded with PyAV, joint image+video batches, clips in shards."""

from __future__ import annotations

import json
import sys
from fractions import Fraction

import av
import numpy as np
import pytest
import torch
from conftest import REPO, clean_env, run_cli
from PIL import Image

from trainer.config import DataConfig
from trainer.data import build_splits, build_train_loader
from trainer.data.datasets import DIGIT_WORDS, image_to_tensor
from trainer.data.sampler import SampleRef, SampleStream
from trainer.data.video import DIRECTIONS, MovingDigitsDataset, VideoFolderDataset
from trainer.errors import ConfigError
from trainer.registry import load_config

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
        # data.path_jitter=0 (the default): the path runs along the centre line, the digit's 16 px band
        # centred across the motion.
        band = clip[..., 8:24, :] if DIRECTIONS[direction] in ("left", "right") else clip[..., 8:24]
        assert torch.equal((clip + 1).sum(), (band + 1).sum())
    assert set(a.offsets.tolist()) == {8}
    assert set(MovingDigitsDataset(32, 1, 6, path_jitter=2).offsets.tolist()) == {6, 7, 8, 9, 10}
    assert set(MovingDigitsDataset(32, 1, 6, path_jitter=None).offsets.tolist()) == set(range(17))  # anywhere
    # Four directions per digit, each labelled direction * 10 + digit.
    labels = [a.load(i, 0, False)[1] for i in range(4)]
    assert [lab // 10 for lab in labels] == [0, 1, 2, 3] and len({lab % 10 for lab in labels}) == 1


def test_moving_digits_config_and_batches():
    assert DataConfig(source="moving-digits").image_size == 32  # the default canvas when nothing sets it
    cfg = load_config(CLIP_PROBE, ["data.image_size=16", "data.num_frames=4", "train.batch_size=6"])
    train, val, num_classes = build_splits(cfg)
    assert num_classes == 40 and len(train) + len(val) == 1797 * 4
    batch = next(iter(build_train_loader(train, cfg, 0, 0, 1)))
    assert batch["images"].shape == (6, 4, 1, 16, 16)
    assert batch["extras"]["frames"].tolist() == [4] * 6 and batch["extras"]["frames"].dtype == torch.int64
    assert all(" moving " in c for c in batch["captions"])
    with pytest.raises(ConfigError, match="data.flip"):
        load_config(CLIP_PROBE, ["data.flip=true"])
    with pytest.raises(ConfigError, match="num_frames"):
        load_config(CLIP_PROBE, ["data.num_frames=0"])
    with pytest.raises(ConfigError, match="data.image_ratio=0.5 mixes images into clip batches"):
        load_config(CLIP_PROBE, ["data.source=digits", "data.image_ratio=0.5"])
    with pytest.raises(ConfigError, match="data.image_path"):
        load_config(CLIP_PROBE, ["data.image_ratio=0.5", "data.image_source=folder"])
    with pytest.raises(ConfigError, match="data.path"):
        load_config(CLIP_PROBE, ["data.source=video"])


@pytest.mark.slow
def test_moving_digits_train_validate_preview_and_resume_clips(tmp_path):
    """The loop, validation and previews carry (N, T, C, H, W) batches unchanged (the probe task checks them),
    and a resumed run continues the joint image+video sequence of an uninterrupted loader."""
    log = tmp_path / "probe.jsonl"
    args = [
        "train",
        CLIP_PROBE,
        f"run.dir={tmp_path}/run",
        "train.max_steps=2",
        "train.val_every_steps=2",
        "train.val_batches=1",
        "data.image_ratio=0.25",  # joint training: one digit image (a one-frame clip) per batch of 4
    ]
    r = run_cli(*args, env=clean_env(**PROBE_ENV, VIDEO_PROBE_LOG=str(log)))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1]
    for x in lines:  # the probe also checks that frames after extras["frames"] are zeros
        assert x["shape"] == [4, 3, 1, 8, 8] and sorted(x["frames"]) == [1, 3, 3, 3]
        image = x["frames"].index(1)
        assert x["captions"][image].startswith("a handwritten ") and 40 <= x["labels"][image] < 50
    assert "val/mse=" in r.stderr
    samples = tmp_path / "run" / "samples"
    gif = samples / "step-000000002-reconstruction.gif"
    assert gif.is_file() and (samples / "step-000000002-reconstruction.png").is_file()
    with av.open(str(gif)) as c:
        assert sum(1 for _ in c.decode(video=0)) == 3

    # Restart from the step-2 checkpoint for one more step: steps 0-2 are what one loader yields from cursor 0.
    r = run_cli(*args[:3], "train.max_steps=3", *args[4:], env=clean_env(**PROBE_ENV, VIDEO_PROBE_LOG=str(log)))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed_from=" in r.stderr and "step=2 cursor=8" in r.stderr, r.stderr[-3000:]
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2]
    cfg = load_config(CLIP_PROBE, ["data.image_ratio=0.25"])
    loader = iter(build_train_loader(build_splits(cfg)[0], cfg, 0, 0, 1))
    for x in lines:
        batch = next(loader)
        assert x["indices"] == batch["indices"].tolist() and x["labels"] == batch["labels"].tolist()
        assert x["frames"] == batch["extras"]["frames"].tolist() and x["captions"] == batch["captions"]


# ---------------------------------------------------------------- clip folders (PyAV)

# Few colours, all in the GIF's palette: a GIF round trip is exact.
COLOURS = np.array([[0, 0, 0], [255, 255, 255], [255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 255, 0]], np.uint8)


def random_frames(n: int, h: int, w: int, seed: int) -> list[np.ndarray]:
    """`n` distinct (h, w, 3) uint8 frames drawn from COLOURS."""
    rng = np.random.default_rng(seed)
    return [COLOURS[rng.integers(0, len(COLOURS), (h, w))] for _ in range(n)]


def write_gif(path, frames: list[np.ndarray]) -> None:
    palette = np.zeros((256, 4), np.uint8)  # PyAV takes pal8 palettes as ARGB rows
    palette[:, 0] = 255
    palette[: len(COLOURS), 1:] = COLOURS
    lookup = {tuple(c): i for i, c in enumerate(COLOURS.tolist())}
    with av.open(str(path), "w") as c:
        s = c.add_stream("gif", rate=8)
        s.width, s.height, s.pix_fmt = frames[0].shape[1], frames[0].shape[0], "pal8"
        for f in frames:
            index = np.vectorize(lambda *rgb: lookup[rgb], otypes=[np.uint8])(f[..., 0], f[..., 1], f[..., 2])
            for p in s.encode(av.VideoFrame.from_ndarray((index, palette), format="pal8")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def write_mp4(path, frames: list[np.ndarray]) -> None:
    """H.264 with qp=0 on 4:4:4 YUV: lossless coding; only the RGB <-> YUV conversion rounds."""
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=8, options={"qp": "0"})
        s.width, s.height, s.pix_fmt = frames[0].shape[1], frames[0].shape[0], "yuv444p"
        for f in frames:
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def as_tensor(frames: list[np.ndarray], size: int, channels: int) -> torch.Tensor:
    return torch.stack([image_to_tensor(Image.fromarray(f), size, channels) for f in frames])


# 8-bit BT.601 YUV: Y, Cb, Cr are each rounded (+-0.5 level); back to RGB a channel gains at most
# 1.164 * 0.5 (Y) + 2.018 * 0.5 (the largest chroma coefficient) + 0.5 (rounding to uint8) < 2.1 levels,
# so < 3 levels of 255, i.e. 6/255 in [-1, 1].
YUV_TOLERANCE = 6 / 255


def test_gif_and_mp4_decode_to_the_encoded_frames_with_stride(tmp_path):
    gif_frames = random_frames(7, 16, 20, seed=1)  # not square: short side resized, then center-cropped
    write_gif(tmp_path / "a.gif", gif_frames)
    mp4_frames = random_frames(7, 16, 16, seed=2)
    write_mp4(tmp_path / "b.mp4", mp4_frames)
    (tmp_path / "a.txt").write_text("a colourful gif\n")

    ds = VideoFolderDataset(str(tmp_path), image_size=8, channels=3, num_frames=3, frame_stride=3)
    assert [p.name for p in ds.files] == ["a.gif", "b.mp4"] and ds.num_classes is None
    clip, label, extras = ds.load(0, aug_seed=0, flip=False)
    assert clip.shape == (3, 3, 8, 8) and label == -1
    assert extras["caption"] == "a colourful gif" and int(extras["frames"]) == 3
    assert torch.equal(clip, as_tensor(gif_frames[::3], 8, 3))  # frames 0, 3, 6, exact

    full = VideoFolderDataset(str(tmp_path), image_size=16, channels=3, num_frames=7, frame_stride=1)
    clip, _, extras = full.load(1, aug_seed=0, flip=False)
    assert "caption" not in extras
    assert (clip - as_tensor(mp4_frames, 16, 3)).abs().max() <= YUV_TOLERANCE
    strided = VideoFolderDataset(str(tmp_path), image_size=16, channels=3, num_frames=4, frame_stride=2)
    assert torch.equal(strided.load(1, 0, False)[0], clip[::2])  # the same decode, every other frame
    gray = VideoFolderDataset(str(tmp_path), image_size=8, channels=1, num_frames=2, frame_stride=1)
    assert torch.equal(gray.load(0, 0, False)[0], as_tensor(gif_frames[:2], 8, 1))
    assert torch.equal(gray.load(0, aug_seed=1, flip=True)[0], as_tensor(gif_frames[:2], 8, 1).flip(-1))

    # Too short for 3 frames at stride 4 (needs 9 of 7): skipped, not padded.
    short = VideoFolderDataset(str(tmp_path), image_size=8, channels=3, num_frames=3, frame_stride=4)
    assert short.load(0, 0, False) is None and short.load(1, 0, False) is None


@pytest.mark.slow
def test_broken_and_short_clips_are_skipped_and_counted(tmp_path):
    data = tmp_path / "clips"
    for cls in ("moving", "still"):
        (data / cls).mkdir(parents=True)
    write_gif(data / "moving" / "good.gif", random_frames(4, 8, 8, seed=3))
    (data / "moving" / "good.txt").write_text("a good gif")
    write_mp4(data / "still" / "good.mp4", random_frames(4, 8, 8, seed=4))
    write_mp4(data / "still" / "whole.mp4", random_frames(4, 8, 8, seed=5))
    whole = (data / "still" / "whole.mp4").read_bytes()
    (data / "still" / "whole.mp4").unlink()
    (data / "still" / "truncated.mp4").write_bytes(whole[: len(whole) // 2])
    (data / "moving" / "garbage.webm").write_bytes(b"\x1aE\xdf\xa3" + b"not a clip" * 20)
    write_gif(data / "moving" / "short.gif", random_frames(2, 8, 8, seed=6))
    (data / "notes.md").write_text("not a clip")

    log = tmp_path / "probe.jsonl"
    args = [
        "train",
        CLIP_PROBE,
        f"run.dir={tmp_path}/run",
        "data.source=video",
        f"data.path={data}",
        "data.channels=3",
        "data.val_fraction=0",
        "train.batch_size=5",
        "train.max_steps=2",
    ]
    r = run_cli(*args, env=clean_env(**PROBE_ENV, VIDEO_PROBE_LOG=str(log)))
    assert r.returncode == 0, r.stderr[-3000:]
    # Five clips, batch 5: each step sees every clip, three of them bad; each is logged once.
    assert r.stderr.count("skipping clip") == 3, r.stderr
    assert "truncated.mp4" in r.stderr and "garbage.webm" in r.stderr and "too short" in r.stderr
    doc = json.loads((tmp_path / "run" / "checkpoints" / "step-000000002" / "trainer.json").read_text())
    assert doc["progress"]["skipped_samples"] == 6
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    for line in lines:
        assert line["shape"] == [5, 3, 3, 8, 8]
        assert sorted(line["frames"]) == [0, 0, 0, 3, 3] and sum(line["valid"]) == 2
        assert sorted(zip(line["captions"], line["labels"], strict=True))[-1] == ("a good gif", 0)


# ---------------------------------------------------------------- joint image+video training


def joint_cfg(*extra: str):
    return load_config(CLIP_PROBE, ["data.num_frames=2", "train.batch_size=6", *extra])


def rank_batches(train, cfg, cursor: int, world_size: int, steps: int) -> list[dict]:
    """`steps` global batches from `cursor`, each the concatenation of every rank's batch."""
    loaders = [iter(build_train_loader(train, cfg, cursor, r, world_size)) for r in range(world_size)]
    out = []
    for _ in range(steps):
        parts = [next(it) for it in loaders]
        out.append(
            {
                "images": torch.cat([p["images"] for p in parts]),
                "indices": torch.cat([p["indices"] for p in parts]),
                "frames": torch.cat([p["extras"]["frames"] for p in parts]),
                "labels": torch.cat([p["labels"] for p in parts]),
                "positions": [q for p in parts for q in p["positions"]],
            }
        )
    return out


def test_joint_batches_keep_their_ratio_across_a_resume_and_world_sizes():
    cfg = joint_cfg("data.image_ratio=0.3")
    train, _, num_classes = build_splits(cfg)
    assert num_classes == 50
    steps, b = 7, 6
    ref = rank_batches(train, cfg, 0, 1, steps)
    for s, batch in enumerate(ref):
        images = (batch["frames"] == 1).sum().item()
        assert images == int((s + 1) * b * 0.3) - int(s * b * 0.3)  # floor((s+1)Br) - floor(sBr)
        assert ((batch["frames"] == 1) == (batch["indices"] >= 1797 * 4)).all()  # images: indices past the clips
        assert (batch["images"][batch["frames"] == 1][:, 1:] == 0).all()  # one-frame clips: frame 1 is zeros
    # Resume: a loader rebuilt at step 3's cursor continues the uninterrupted sequence exactly,
    # at the same world size and after a world-size change.
    for world_size in (1, 2, 3):
        resumed = rank_batches(train, cfg, 3 * b, world_size, steps - 3)
        for a, r in zip(ref[3:], resumed, strict=True):
            assert r["positions"] == list(range(b))
            for key in ("images", "indices", "frames", "labels"):
                assert torch.equal(a[key], r[key]), key


def test_joint_stream_uses_every_image_and_clip_once_per_epoch_at_any_world_size():
    from trainer.data.joint import JointStream

    n_clips, n_images, b, ratio = 23, 7, 6, Fraction(1, 4)
    seen: dict[int, list] = {}
    for world_size in (1, 2, 3):
        clips, images = SampleStream(n_clips, seed=3), SampleStream(n_images, seed=4)
        stream = JointStream(clips, images, ratio, seed=3)
        entries = []
        for step in range(40):  # 240 positions: 180 clips (7+ epochs), 60 images (8+ epochs)
            refs = [ref for r in range(world_size) for ref in stream.rank_slice(step * b, b, r, world_size)]
            assert [ref.position for ref in refs] == list(range(b))
            entries += [ref.index for ref in refs]
        seen[world_size] = entries
    assert seen[1] == seen[2] == seen[3]
    # Rank 1 of 3 changing to 2 ranks mid-run: the union is still the single-rank stream.
    stream = JointStream(SampleStream(n_clips, seed=3), SampleStream(n_images, seed=4), ratio, seed=3)
    mixed = [
        ref.index
        for step in range(40)
        for w in [2 if step < 17 else 3]
        for r in range(w)
        for ref in stream.rank_slice(step * b, b, r, w)
    ]
    assert mixed == seen[1]
    clip_seq = [i for i in seen[1] if i < n_clips]
    image_seq = [i - n_clips for i in seen[1] if i >= n_clips]
    assert len(image_seq) == 60 and len(clip_seq) == 180
    for seq, n in ((clip_seq, n_clips), (image_seq, n_images)):
        for e in range(len(seq) // n):  # every complete epoch of each stream is a permutation of it
            assert sorted(seq[e * n : (e + 1) * n]) == list(range(n))
        assert seq[:n] != seq[n : 2 * n]  # and epochs are reshuffled
    # Image slots spread evenly: any 3 consecutive positions (a rank's share at W=2) hold 0 or 1 image.
    flags = [i >= n_clips for i in seen[1]]
    assert all(sum(flags[p : p + 3]) in (0, 1) for p in range(len(flags) - 3))


# ---------------------------------------------------------------- clips in WebDataset shards


def test_clips_packed_into_shards_decode_like_the_folder_and_mix_with_images(tmp_path):
    from trainer.data.pack import pack_folder

    src = tmp_path / "clips"
    for cls in ("a", "b"):
        (src / cls).mkdir(parents=True)
    for i in range(3):
        write_gif(src / "a" / f"{i}.gif", random_frames(4, 10, 12, seed=10 + i))
        (src / "a" / f"{i}.txt").write_text(f"gif number {i}")
        write_mp4(src / "b" / f"{i}.mp4", random_frames(5, 8, 8, seed=20 + i))
    write_gif(src / "b" / "short.gif", random_frames(2, 8, 8, seed=30))  # decodes, but too short for 3 frames
    (src / "b" / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 40)  # no video: not packed
    out = tmp_path / "shards"
    summary = pack_folder(str(src), str(out), samples_per_shard=3, progress=False, shuffle_seed=None)
    assert (summary.shards, summary.samples, summary.skipped) == (3, 7, 1)

    args = [f"data.urls={out}/shards.json", "data.num_frames=3", "data.frame_stride=1", "data.val_fraction=0"]
    cfg = load_config(CLIP_PROBE, ["data.source=shards", "data.image_size=8", "data.channels=3", *args])
    train, val, num_classes = build_splits(cfg)
    assert len(train) == 7 and val is None and num_classes == 2
    items = train.__getitems__([SampleRef(index=i, position=i) for i in range(7)])
    folder = VideoFolderDataset(str(src), 8, 3, num_frames=3, frame_stride=1)
    good = [p for p in folder.files if p.name != "broken.mp4"]
    for (clip, label, _, _, valid, extras), path in zip(items, good, strict=True):
        expected = folder.load(folder.files.index(path), 0, False)
        if path.name == "short.gif":
            assert expected is None and not valid and int(extras["frames"]) == 0
            continue
        assert valid and torch.equal(clip, expected[0]) and label == expected[1]
        assert int(extras["frames"]) == 3 and extras.get("caption") == expected[2].get("caption")

    # Joint training over shards: digit images join the clips; the shard fetch's byte counts survive.
    cfg = load_config(
        CLIP_PROBE,
        [
            "data.source=shards",
            "data.image_size=8",
            "data.channels=1",
            "train.batch_size=4",
            "data.image_ratio=0.5",
            *args,
        ],
    )
    train, _, num_classes = build_splits(cfg)
    assert num_classes == 12
    batch = next(iter(build_train_loader(train, cfg, 0, 0, 1)))
    assert batch["images"].shape == (4, 3, 1, 8, 8) and batch["extras"]["frames"].tolist().count(1) == 2
    assert batch["io"]["data_bytes"] > 0


def test_without_pyav_every_clip_reader_exits_2_naming_the_video_extra(tmp_path, monkeypatch, capsys):
    """PyAV is the `video` extra: `import av` fails (None in sys.modules is what a missing package gives
    `import`), and the config that would decode clips is refused at start with the pip line."""
    from trainer.cli import main as cli_main

    (tmp_path / "clips").mkdir()
    write_gif(tmp_path / "clips" / "a.gif", random_frames(3, 8, 8, seed=0))
    monkeypatch.setitem(sys.modules, "av", None)
    fix = "pip install 'gentrain[video]'"
    # A clip folder: before the first step.
    argv = ["train", "moving-digits-tokenizer", "data.source=video", f"data.path={tmp_path / 'clips'}"]
    assert cli_main([*argv, f"run.dir={tmp_path / 'run'}", "train.max_steps=1", "data.num_frames=2"]) == 2
    err = capsys.readouterr().err
    assert "data.source=video decodes video clips with PyAV, which is not installed" in err and fix in err, err
    assert "Traceback" not in err
    # Clips in shards (data.num_frames > 1), before any shard is listed.
    shards = ["data.source=shards", "data.urls=s3://nowhere/{0..3}.tar", "data.num_frames=3"]
    cfg = load_config("moving-digits-tokenizer", shards, environ={})
    with pytest.raises(ConfigError, match=r"data.source=shards with data.num_frames=3 .*gentrain\[video\]"):
        build_splits(cfg)
    # Packing a folder of clips.
    assert (
        cli_main(["data", "pack", str(tmp_path / "clips"), str(tmp_path / "shards"), "--samples-per-shard", "2"]) == 2
    )
    assert fix in capsys.readouterr().err
