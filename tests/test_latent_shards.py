"""`gentrain data encode` and training from its latent shards: the stored posterior is the autoencoder's, a run
on them loads no encoder and draws its posterior noise as on-the-fly encoding does, a SIGKILLed encode keeps
its finished shards and resumes to the same bytes, a SIGKILLed training run resumes bit-identically, a
world-size change reads every sample once per epoch, shards on loopback S3 work, and shards of another
autoencoder or text encoder (or images where latents are expected, and the reverse) exit 2."""

from __future__ import annotations

import ast
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
from collections import defaultdict

import blake3
import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from conftest import REPO, clean_env, run_bench, tiny
from elastic_helpers import finish, standalone, start_torchrun
from helpers import assert_tensors_equal
from hypothesis import given, settings
from hypothesis.extra.numpy import array_shapes, arrays
from test_latent import vae_folder
from test_shards import make_folder, pack
from test_vqgan_maskgit import _kill_and_resume_one_process

from trainer.cli import main
from trainer.data.shards import ShardStream, filesystem, shard_list_json
from trainer.data.shards.tar import scan_tar
from trainer.diffusion.latent import PART, LatentSpace, frozen_source
from trainer.elastic import DistEnv
from trainer.encode import encode_dataset
from trainer.engine.parts import FrozenPart
from trainer.loop import Trainer
from trainer.randomness import Stream, sample_draws
from trainer.registry import load_config
from trainer.runs import load_frozen

ENV = clean_env(PYTHONPATH=f"{REPO}:{REPO / 'tests'}", HF_HUB_OFFLINE="1")
DIGITS = 1797
# A run that stops at the first sample it cannot use (exit 2 naming it and why).
STRICT = ["data.max_skipped_fraction=0"]


def latent_args(root, vae: str, *extra: str, max_steps: int = 2) -> list[str]:
    return [
        "digits-ddpm",
        *tiny(root, f"model.autoencoder.url={vae}", "model.num_classes=10", *extra, max_steps=max_steps),
    ]


def from_shards(url: str, *extra: str) -> list[str]:
    return ["data.source=shards", f"data.urls={url}/shards.json", "data.val_fraction=0", *extra]


def config(args: list[str]):
    return load_config(args[0], args[1:], environ={})


def members(url: str, shard: int, options=None) -> list[dict[str, bytes]]:
    data = filesystem(url, options).cat_file(f"{url}/{shard:06d}.tar")
    out: dict[str, dict[str, bytes]] = defaultdict(dict)
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        for m in tf:
            key, ext = m.name.split(".", 1)
            out[key][ext] = tf.extractfile(m).read()
    return list(out.values())


def cli(capsys, *args: str) -> tuple[int, str]:
    """`gentrain ARGS` in this process (a config error needs no process of its own): exit code and stderr."""
    capsys.readouterr()
    code = main(list(args))
    return code, capsys.readouterr().err


def npy(raw: bytes) -> np.ndarray:
    return np.load(io.BytesIO(raw), allow_pickle=False)


@pytest.fixture(scope="module")
def vae(tmp_path_factory) -> str:
    return vae_folder(tmp_path_factory.mktemp("vae") / "vae")


@pytest.fixture(scope="module")
def encoded(tmp_path_factory, vae) -> str:
    """The digits (8x8) through the tiny VAE, float32, with mirrored posteriors, 4 shards of 500."""
    root = tmp_path_factory.mktemp("enc")
    encode_dataset(config(latent_args(root, vae)), f"{root}/shards", 500, dtype="float32", flip=True, progress=False)
    return f"{root}/shards"


def test_encoded_shards_hold_the_autoencoders_posterior_of_each_source_sample_and_its_mirror(tmp_path, vae, encoded):
    listed = json.loads(open(f"{encoded}/shards.json").read())
    assert [e["nsamples"] for e in listed["shardlist"]] == [500, 500, 500, 297] and listed["num_classes"] == 10
    settings = listed["encoded"]
    cfg = config(latent_args(tmp_path, vae))
    weights = load_frozen(PART, frozen_source(cfg.model_cfg.autoencoder), {})
    assert settings["autoencoder"]["digest"] == weights.record.digest
    assert settings["latent_shape"] == [4, 4, 4] and settings["dtype"] == "float32" and settings["flip"] is True
    latent = LatentSpace(cfg.model_cfg.autoencoder, weights, 8, 1, 0)
    module = latent.build()
    FrozenPart(PART, module, weights)
    from trainer.data.datasets import DigitsDataset

    digits = DigitsDataset(8, 1)
    samples = members(encoded, 3)
    index = torch.tensor([int(s["src"]) for s in samples])
    images = digits.images[index]
    with torch.no_grad():
        mean, std = latent._posterior(module, images)
        fmean, fstd = latent._posterior(module, images.flip(-1))
    for i, s in enumerate(samples):
        assert torch.equal(torch.from_numpy(npy(s["mean.npy"])), mean[i])
        assert torch.equal(torch.from_numpy(npy(s["std.npy"])), std[i])
        assert torch.equal(torch.from_numpy(npy(s["flip.mean.npy"])), fmean[i])
        assert torch.equal(torch.from_numpy(npy(s["flip.std.npy"])), fstd[i])
        assert int(s["cls"]) == int(digits.labels[index[i]]) and s["txt"].decode().startswith("a handwritten")
    # Every source sample once, in the order the shuffle seed gave.
    keys = [int(s["src"]) for j in range(4) for s in members(encoded, j)]
    assert keys == list(np.random.default_rng(0).permutation(DIGITS))
    # float16: the same numbers rounded once (every run reads those same numbers).
    half = f"{tmp_path}/half"
    encode_dataset(cfg, half, 500, dtype="float16", progress=False)
    for a, b in zip(members(half, 3), members(encoded, 3), strict=True):
        assert npy(a["mean.npy"]).dtype == np.float16
        assert np.array_equal(npy(a["mean.npy"]), npy(b["mean.npy"]).astype(np.float16))


def test_a_run_on_encoded_shards_builds_no_encoder_and_draws_the_posterior_noise_of_on_the_fly_encoding(
    tmp_path, vae, encoded
):
    t = Trainer(config(latent_args(tmp_path / "run", vae, *from_shards(encoded), "data.flip=true")), DistEnv())
    module = t.frozen["autoencoder"].module
    assert module.encoder is None and module.quant_conv is None and module.decoder is not None
    assert not any(k.startswith(("encoder.", "quant_conv.")) for k in module.state_dict())
    assert t.task.latent.cache is None
    # The latents of a batch from the shards are mean + std * eps with the stream on-the-fly encoding uses.
    split = t.train_set
    from trainer.data.sampler import SampleRef

    item = split[SampleRef(index=5, position=3)]
    posterior = item[0].unsqueeze(0)
    z = t.task.latent.encode(module, posterior, 7, [3])
    on_the_fly = LatentSpace(
        t.task.cfg.autoencoder, load_frozen(PART, frozen_source(t.task.cfg.autoencoder), {}), 8, 1, 0
    )
    whole = on_the_fly.build()
    FrozenPart(PART, whole, load_frozen(PART, frozen_source(t.task.cfg.autoencoder), {}))
    from trainer.data.datasets import DigitsDataset

    shard, member = split.locate(5)
    src = int(members(encoded, shard)[member]["src"])
    mean, std = posterior.chunk(2, dim=1)
    eps = sample_draws(0, 7, [3], Stream.AUTOENCODER).randn((4, 4, 4))
    assert torch.equal(z, (mean + std * eps - module.latent_shift) * module.latent_scale)  # the same draw
    # ... of the posterior a fresh encode gives (up to the rounding a batch of another size gives on this CPU).
    fresh = on_the_fly.encode(whole, DigitsDataset(8, 1).images[src : src + 1], 7, [3])
    torch.testing.assert_close(z, fresh, rtol=1e-5, atol=1e-6)
    assert t.fit() == 0
    manifest = json.loads((tmp_path / "run/run/checkpoints/step-000000002/manifest.json").read_text())
    assert (
        manifest["frozen"]["autoencoder"]["digest"]
        == json.loads(open(f"{encoded}/shards.json").read())["encoded"]["autoencoder"]["digest"]
    )


@pytest.mark.slow
def test_another_autoencoder_images_where_latents_are_expected_and_the_reverse_exit_2(
    tmp_path, vae, other_vae, encoded, plain, capsys
):
    code, err = cli(capsys, "train", *latent_args(tmp_path / "a", other_vae, *from_shards(encoded)))
    assert code == 2, err[-3000:]
    made = json.loads(open(f"{encoded}/shards.json").read())["encoded"]["autoencoder"]["digest"]
    assert made in err and other_vae in err and "encoded by the autoencoder" in err
    # Latent shards for a pixel model.
    pixels = ["digits-ddpm", *tiny(tmp_path / "b", "model.num_classes=10", *from_shards(encoded))]
    code, err = cli(capsys, "train", *pixels)
    assert code == 2 and "no model.autoencoder" in err, err[-3000:]
    # Image shards where the config expects latents.
    src = tmp_path / "imgs"
    make_folder(src, per_class=4, size=8)
    pack(src, tmp_path / "img-shards", 4)
    expects = latent_args(tmp_path / "c", vae, *from_shards(str(tmp_path / "img-shards")), "data.encoded=true")
    code, err = cli(capsys, "train", *expects)
    assert code == 2 and "data.encoded=true but" in err, err[-3000:]
    # data.flip=true on shards encoded without mirrored posteriors.
    code, err = cli(capsys, "train", *latent_args(tmp_path / "d", vae, *from_shards(plain), "data.flip=true"))
    assert code == 2 and "--flip" in err, err[-3000:]


@pytest.fixture(scope="module")
def other_vae(tmp_path_factory) -> str:
    return vae_folder(tmp_path_factory.mktemp("other-vae") / "vae", seed=1)


@pytest.fixture(scope="module")
def plain(tmp_path_factory, vae) -> str:
    """The digits through the tiny VAE in one shard, as `data encode` writes by default (float16, no mirrors)."""
    root = tmp_path_factory.mktemp("plain")
    encode_dataset(config(latent_args(root, vae)), f"{root}/shards", DIGITS, progress=False)
    return f"{root}/shards"


def _digest(cfg) -> str:
    return load_frozen(PART, frozen_source(cfg.model_cfg.autoencoder), {}).record.digest


@pytest.mark.slow
def test_a_rerun_into_another_autoencoders_shards_without_their_encode_json_exits_2_naming_the_mismatch(
    tmp_path, vae, other_vae, capsys
):
    """Found 1 of issue 47: the rerun encoded "0 shards, 0 samples", exited 0 and wrote a shards.json naming
    this autoencoder over the other one's latents. Each shard's index records its encode settings."""
    out = tmp_path / "shards"
    theirs = config(latent_args(tmp_path, other_vae))
    encode_dataset(theirs, str(out), 900, progress=False)
    (out / "encode.json").unlink()
    before = (out / "shards.json").read_bytes()
    args = ["data", "encode", *latent_args(tmp_path, vae), "--samples-per-shard", "900", "--out", str(out)]
    code, err = cli(capsys, *args)
    assert code == 2, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert "000000.tar" in line and "other settings" in line and "Traceback" not in err
    assert _digest(theirs) in line and _digest(config(latent_args(tmp_path, vae))) in line
    assert (out / "shards.json").read_bytes() == before and not (out / "encode.json").exists()  # nothing written
    # Shards of `data pack` (their indexes record no encode settings) are refused the same way.
    src = tmp_path / "imgs"
    make_folder(src, per_class=2, size=8)
    pack(src, tmp_path / "packed", 2)
    code, err = cli(capsys, *args[:-1], str(tmp_path / "packed"))
    assert code == 2 and "records no encode settings" in err, err[-3000:]


@pytest.mark.slow
def test_a_shard_swapped_for_one_of_another_encode_of_the_same_size_is_never_trained_on(
    tmp_path, vae, other_vae, plain, capsys
):
    """Found 1 of issue 47: a shard copied in from another encode (same size, so the same offsets) was read
    without complaint. shards.json pins each shard's index by digest, the index each sample's bytes."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    # One shard of every sample: the one replaced is the one the run reads.
    shutil.copytree(plain, ours)
    encode_dataset(config(latent_args(tmp_path, other_vae)), str(theirs), DIGITS, progress=False)
    assert (ours / "000000.tar").stat().st_size == (theirs / "000000.tar").stat().st_size
    listed = json.loads((ours / "shards.json").read_text())
    for j, e in enumerate(listed["shardlist"]):  # the digests are those of the bytes there
        assert e["digest"] == "blake3:" + blake3.blake3((ours / f"{j:06d}.tar").read_bytes()).hexdigest()
        assert e["index_digest"] == "blake3:" + blake3.blake3((ours / f"{j:06d}.tar.idx.json").read_bytes()).hexdigest()

    def train(name: str) -> tuple[int, str]:
        return cli(capsys, "train", *latent_args(tmp_path / name, vae, *from_shards(str(ours)), *STRICT))

    # The tar alone: its samples' bytes are not those its index records.
    shutil.copy(theirs / "000000.tar", ours / "000000.tar")
    code, err = train("tar")
    assert code == 2, err[-3000:]
    assert "000000.tar#" in err and "digest" in err and "Traceback" not in err
    # The tar with its index: the index is not the one shards.json pins.
    shutil.copy(theirs / "000000.tar.idx.json", ours / "000000.tar.idx.json")
    code, err = train("both")
    assert code == 2, err[-3000:]
    assert "000000.tar" in err and "index" in err and "Traceback" not in err


def test_encoded_shards_without_digests_are_refused_naming_the_fix(tmp_path, encoded):
    """An encoded set's shards.json written before shards were pinned by content (no digests): refused."""
    from trainer.data.shards import load_shard_list
    from trainer.errors import ConfigError

    old = tmp_path / "old"
    shutil.copytree(encoded, old)
    listed = json.loads((old / "shards.json").read_text())
    for e in listed["shardlist"]:
        del e["digest"], e["index_digest"]
    (old / "shards.json").write_text(json.dumps(listed))
    for urls in (f"{old}/shards.json", f"{old}/{{000000..000003}}.tar"):  # the list, or patterns beside it
        with pytest.raises(ConfigError, match=r"no content digests.*gentrain data encode"):
            load_shard_list(urls, None)
    pinned = [e["index_digest"] for e in json.loads(open(f"{encoded}/shards.json").read())["shardlist"]]
    assert load_shard_list(f"{encoded}/shards.json", None).index_digests == pinned
    assert load_shard_list(f"{encoded}/{{000001..000002}}.tar", None).index_digests == pinned[1:3]


def test_a_shards_json_with_malformed_encoded_settings_exits_2_naming_the_file_and_the_field(tmp_path, capsys):
    """The `encoded` settings are parsed once, where shards.json is read (an EncodedSettings): a field of the
    wrong type is exit 2 naming the list and `encoded.<field>` before a shard is opened, never a traceback."""
    listed = json.loads(shard_list_json([{"url": "000000.tar", "nsamples": 4, "filesize": 10240}], None, None))
    listed["encoded"] = {  # what encode writes, but for image_size: a string
        **{"format": "gentrain-encoded/1", "kind": "latents", "autoencoder": {"url": "vae", "digest": "blake3:0"}},
        **{"image_size": "8", "channels": 1, "latent_shape": [4, 4, 4], "dtype": "float32", "flip": False},
        **{"text": None, "data": {"source": "digits"}, "samples": 4, "samples_per_shard": 4, "shuffle_seed": 0},
    }
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "shards.json").write_text(json.dumps(listed))
    assert main(["train", "digits-ddpm", *tiny(tmp_path, *from_shards(f"{tmp_path}/shards"), max_steps=1)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}/shards/shards.json" in err and "encoded.image_size" in err and "'8'" in err, err
    assert "Traceback" not in err


def _settings_key_reads(source: str) -> list[int]:
    """Lines that read the encoded settings by string key: `X["key"]` or `X.get("key")` where X names the
    settings (`encoded`, `encoding`, `self.encoding`, `(encoding or {})`, ...), or any read of `"encoded"`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            key, owner = node.slice, node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            key, owner = (node.args or [None])[0], node.func.value
        else:
            continue
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            if key.value == "encoded" or re.search(r"\bencod(ed|ing)\b", ast.unparse(owner)):
                found.append(node.lineno)
    return found


def test_the_encoded_settings_are_read_by_attribute_outside_their_module():
    """`gentrain data encode`'s settings are one EncodedSettings from where shards.json is read to every use
    (issue 51): outside trainer/data/shards/encoded.py nothing in trainer/ or bench/ reads them by key."""
    probe = 'def f(doc, e, self):\n    doc["encoded"] = 1\n    return e.encoded["a"], doc.get("encoded"), self.encoding.text\n'
    assert _settings_key_reads(probe) == [3, 3]
    defining = REPO / "trainer" / "data" / "shards" / "encoded.py"
    files = sorted((REPO / "trainer").rglob("*.py")) + sorted((REPO / "bench").rglob("*.py"))
    assert defining in files and REPO / "trainer" / "encode.py" in files
    found = [
        f"{path.relative_to(REPO)}:{line}"
        for path in files
        if path != defining
        for line in _settings_key_reads(path.read_text("utf-8"))
    ]
    assert found == [], "read the settings by attribute (trainer.data.shards.encoded.EncodedSettings)"


_KILLING_ENCODE = """
import os, signal, sys
import trainer.encode as encode
commit, tars = encode._commit, []
def dying_commit(fs, what, url):
    if url.endswith(".tar"):
        tars.append(url)
        if len(tars) == 3:  # the third shard: its tar is uploaded under the temporary name, then the process dies
            fs.put_file(what, encode.strip_protocol(fs, url + ".partial-" + str(os.getpid())))
            os.kill(os.getpid(), signal.SIGKILL)
    commit(fs, what, url)
encode._commit = dying_commit
from trainer.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_sigkill_during_encoding_keeps_finished_shards_hides_the_half_written_one_and_resumes_to_the_same_bytes(
    tmp_path, vae, capsys
):
    args = ["data", "encode", *latent_args(tmp_path, vae), "--samples-per-shard", "300", "--batch-size", "50"]
    code, err = cli(capsys, *args, "--out", f"{tmp_path}/ref")  # the reference: an uninterrupted encode
    assert code == 0, err[-3000:]
    out = tmp_path / "killed"
    cmd = [sys.executable, "-c", _KILLING_ENCODE, *args, "--out", str(out)]
    killed = subprocess.run(cmd, env=ENV, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert not (out / "shards.json").exists()
    visible = sorted(p.name for p in out.glob("*.tar"))
    assert visible == ["000000.tar", "000001.tar"]  # the third is only under its temporary name
    assert any(".partial-" in p.name for p in out.iterdir())
    finished = {p: p.stat().st_mtime_ns for p in out.glob("*.tar")}
    code, err = cli(capsys, *args, "--out", str(out))
    assert code == 0, err[-3000:]
    assert {p: p.stat().st_mtime_ns for p in finished} == finished  # kept, not encoded again
    names = sorted(p.name for p in (tmp_path / "ref").iterdir())
    assert names == sorted(p.name for p in out.iterdir() if ".partial-" not in p.name)
    for name in names:
        assert (tmp_path / "ref" / name).read_bytes() == (out / name).read_bytes(), name
    for e in json.loads((out / "shards.json").read_text())["shardlist"]:  # pinned: the resumed shards' own digests
        assert e["digest"] == "blake3:" + blake3.blake3((out / e["url"]).read_bytes()).hexdigest()
    # Settings that differ from the interrupted encode's are refused.
    code, err = cli(capsys, *args, "--out", str(out), "--dtype", "float32")
    assert code == 2 and "other settings" in err and "dtype" in err, err[-3000:]


@pytest.mark.slow
def test_sigkill_while_training_from_encoded_shards_resumes_bit_identical(tmp_path, vae, encoded):
    steps = 4  # a checkpoint (2) before the kill (in 3), a step after it
    extra = [*from_shards(encoded), "data.flip=true", "checkpoint.every_steps=2", "task=probe_tasks:KillableDDPM"]

    def args(root):
        return latent_args(root, vae, *extra, max_steps=steps)

    a, b, _ = _kill_and_resume_one_process(tmp_path, args, ENV, kill_step=3, saved_step=2, steps=steps)
    assert_tensors_equal(a, b)


@pytest.mark.slow
def test_encode_under_torchrun_to_s3_then_train_across_world_sizes_reads_every_sample_once_per_epoch(
    tmp_path, vae, s3_server
):
    options = s3_server.storage_options()
    url = f"s3://{s3_server.make_bucket()}/latents"
    log = tmp_path / "encode.log"
    args = [*latent_args(tmp_path, vae), "--out", url, "--samples-per-shard", "400"]
    args += ["--storage-options", json.dumps(options)]
    proc = start_torchrun(standalone(2), args, log, command=("data", "encode"), PYTHONPATH=ENV["PYTHONPATH"])
    assert finish(proc, log) == 0, log.read_text()[-4000:]
    text = log.read_text()
    assert "rank 0 of 2): 3 shards" in text and "rank 1 of 2): 2 shards" in text
    fs = filesystem(url, options)
    listed = json.loads(fs.cat_file(f"{url}/shards.json"))
    assert [e["nsamples"] for e in listed["shardlist"]] == [400, 400, 400, 400, 197]
    for j in range(5):  # every shard whole: its index describes its bytes
        offsets, keys, _ = scan_tar(io.BytesIO(fs.cat_file(f"{url}/{j:06d}.tar")))
        assert len(keys) == listed["shardlist"][j]["nsamples"]

    batch = 6
    base = latent_args(
        tmp_path,
        vae,
        *from_shards(url),
        f"data.storage_options={json.dumps(options)}",
        f"checkpoint.storage_options={json.dumps(options)}",
        "data.ledger=true",
        f"train.batch_size={batch}",
        "checkpoint.every_steps=0",
    )[1:]
    previous = 0
    for i, (world, until) in enumerate([(2, 4), (1, 9)]):
        leg = tmp_path / f"leg{i}.log"
        args = ["digits-ddpm", *base, f"train.max_steps={until}"]
        proc = start_torchrun(standalone(world), args, leg, PYTHONPATH=ENV["PYTHONPATH"])
        assert finish(proc, leg) == 0, leg.read_text()[-4000:]
        if previous:
            assert f"step={previous} cursor={previous * batch}" in leg.read_text()
        previous = until
    stream = []
    per_step: dict[int, dict[int, list[int]]] = defaultdict(dict)
    for f in (tmp_path / "run" / "ledger").glob("rank-*.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            per_step[rec["step"]][rec["rank"]] = rec["indices"]
    stream = [i for s in sorted(per_step) for r in sorted(per_step[s]) for i in per_step[s][r]]
    counts = np.array([e["nsamples"] for e in listed["shardlist"]])
    assert stream == [i for _, i in ShardStream(counts, 0, 8, 8).take(0, 9 * batch)]


@pytest.mark.slow
def test_caption_embeddings_are_stored_and_a_run_with_another_text_encoder_setting_exits_2(
    tmp_path, vae, monkeypatch, capsys
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    backbone = "model.backbone={kind: pixart, patch_size: 2, num_layers: 1, num_attention_heads: 2, attention_head_dim: 8, caption_channels: 384}"
    text = f"model.text={{cache_dir: {tmp_path}/text, max_tokens: 8}}"
    args = ["digits-ddpm", *tiny(tmp_path, f"model.autoencoder.url={vae}", backbone, text, max_steps=2)]
    cfg = config(args)
    url = f"{tmp_path}/shards"
    encode_dataset(cfg, url, 900, text=True, dtype="float32", progress=False)
    settings = json.loads(open(f"{url}/shards.json").read())["encoded"]["text"]
    assert settings["max_tokens"] == 8 and settings["digest"].startswith("blake3:")
    from trainer.conditioning.text import TextEncoder

    encoder = TextEncoder(cfg.model_cfg.text)
    sample = members(url, 0)[0]
    emb = encoder.encode([sample["txt"].decode()])
    assert torch.equal(torch.from_numpy(npy(sample["text.tokens.npy"])), emb.tokens[0])
    assert torch.equal(torch.from_numpy(npy(sample["text.pooled.npy"])), emb.pooled[0])
    t = Trainer(config([*args, *from_shards(url)]), DistEnv())
    assert t.task.stored_text and t.fit() == 0
    wider = ["digits-ddpm", *tiny(tmp_path / "b", f"model.autoencoder.url={vae}", backbone, text.replace("8}", "6}"))]
    code, err = cli(capsys, "train", *wider, *from_shards(url))
    assert code == 2, err[-3000:]
    assert settings["digest"] in err and "max_tokens 8" in err and "max_tokens 6" in err


# ---------------------------------------------------------------- reading a member


def _npy(a: np.ndarray, version=None) -> bytes:
    f = io.BytesIO()
    np.lib.format.write_array(f, a, version=version, allow_pickle=False)
    return f.getvalue()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    arrays(
        st.sampled_from([np.float16, np.float32]),
        array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5),
        elements=st.floats(-1e3, 1e3, width=16),
    ),
    st.booleans(),
    st.sampled_from([None, (1, 0), (2, 0), (3, 0)]),
)
def test_a_member_reads_as_np_load_reads_it(a, fortran, version):
    """trainer/data/shards/latents.py parses each .npy header once and views the data: the same array as np.load
    (float32, C order, writable), for every header version, shape and memory order."""
    from trainer.data.shards.latents import _read_npy

    raw = _npy(np.asfortranarray(a) if fortran else a, version)
    got, expected = _read_npy(raw, "mean.npy"), np.load(io.BytesIO(raw), allow_pickle=False).astype(np.float32)
    assert got.dtype == np.float32 and got.shape == expected.shape and np.array_equal(got, expected, equal_nan=True)
    assert got.flags.c_contiguous and got.flags.writeable


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    array_shapes(min_dims=3, max_dims=3, min_side=1, max_side=6),
    st.sampled_from([np.float16, np.float32]),
    st.booleans(),
    st.integers(0, 3),
)
def test_an_encoded_sample_decodes_to_its_stored_posterior(shape, dtype, fortran, aug_seed):
    """decode_encoded_sample converts mean and std straight into one float32 tensor: cat(mean, std) of
    what np.load reads, the mirrored pair when the draw flips, the label and caption beside it."""
    from trainer.data.shards.encoded import EncodedSettings
    from trainer.data.shards.latents import decode_encoded_sample

    def settings(latent_shape) -> EncodedSettings:  # what the decoder reads of a set's settings
        return EncodedSettings.model_construct(latent_shape=tuple(latent_shape), text=None, buckets=None)

    rng = np.random.default_rng(list(shape))
    arrays_ = {k: rng.standard_normal(shape).astype(dtype) for k in ("mean", "std", "flip.mean", "flip.std")}
    members = {f"{k}.npy": _npy(np.asfortranarray(a) if fortran else a) for k, a in arrays_.items()}
    members.update({"cls": b"7\n", "txt": b" a caption "})
    for flip in (False, True):
        x, label, extras = decode_encoded_sample(members, settings(shape), flip, aug_seed)
        pre = "flip." if flip and aug_seed & 1 else ""
        want = np.concatenate(
            [np.load(io.BytesIO(members[f"{pre}{k}.npy"])).astype(np.float32) for k in ("mean", "std")]
        )
        assert x.dtype == torch.float32 and x.is_contiguous() and torch.equal(x, torch.from_numpy(want))
        assert label == 7 and extras == {"caption": "a caption"}
    with pytest.raises(ValueError, match=r"posterior of shape"):
        decode_encoded_sample(members, settings([shape[0] + 1, *shape[1:]]), False, 0)


def test_a_broken_member_is_a_clear_error():
    from trainer.data.shards.latents import _read_npy

    good = _npy(np.ones((4, 4, 4), np.float16))
    with pytest.raises(ValueError, match=r"member mean.npy: 126 bytes of data, its header says 128"):
        _read_npy(good[:-2], "mean.npy")
    with pytest.raises(ValueError, match=r"member std.npy: not an .npy array"):
        _read_npy(b"PK\x03\x04" + good[4:], "std.npy")
    with pytest.raises(ValueError, match=r"member mean.npy: dtype int64, not float16/float32"):
        _read_npy(_npy(np.arange(3)), "mean.npy")


@pytest.mark.slow
def test_the_latent_shards_bench_prints_every_way_and_the_read_cost(tmp_path):
    """bench/latent_shards.py at a tiny size: every way's steps/s and ratio, the read cost per step and the
    ratio it implies, finite and positive (no assertion on speed: the figures mean something only at size)."""
    import math

    out = tmp_path / "bench.json"
    # The preset's geometry (16 px -> 4x4x4) at the smallest widths, and a one-block DiT: the figures' plumbing.
    small = ["--autoencoder", vae_folder(tmp_path / "vae", levels=3), "--json", str(out)]
    small += [*"--steps 3 --warmup 1 --rounds 1 --batch-size 8 --set model.backbone.num_layers=1".split()]
    r = run_bench("latent_shards.py", *small)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    ways = {"on_the_fly", "cache", "shards", "in_memory", "hand_loop"}
    assert set(got["steps_per_s"]) == set(got["vs_in_memory"]) == set(got["vs_in_memory_per_round"]) == ways
    assert got["vs_in_memory"]["in_memory"] == 1.0 and set(got["read_ms_per_step"]) == {"shards", "in_memory"}
    figures = [*got["steps_per_s"].values(), got["read_ms_per_step"]["shards"], got["encode_images_per_s"]]
    figures.append(got["implied_vs_in_memory"])
    assert all(isinstance(x, float) and math.isfinite(x) and x > 0 for x in figures), figures
    assert 0 <= got["read_ms_per_step"]["in_memory"] < got["read_ms_per_step"]["shards"]  # microseconds: may round to 0
    assert 0 < got["implied_vs_in_memory"] <= 1.0
