"""Every data source feeds a released pipeline's run (issue 48 deliver 6): captions in `.txt` files, in a
`metadata.jsonl` and in a Hugging Face dataset saved to disk train the tiny SD pipeline to the same bits, and
`gentrain data encode --text` with a pipeline's config stores what the pipeline's own VAE and text encoders
give (SDXL: both CLIPs), pins each of those folders, trains and resumes exactly from the shards, and a run with a
pipeline of another text encoder exits 2 naming it."""

from __future__ import annotations

import io
import json
import shutil
import tarfile

import numpy as np
import pytest
import torch
from conftest import REPO, clean_env
from helpers import assert_tensors_equal
from safetensors.torch import load_file, save_file
from test_pipeline_finetune import _files, _train
from tiny_pipelines import BUILDERS, captioned_images, pipeline_config

from trainer.data.sampler import SampleRef
from trainer.encode import _source, encode_dataset

KILL_AT_3 = clean_env(PYTHONPATH=str(REPO / "tests"), PROBE_TASK_KILL="0:3")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return captioned_images(tmp_path_factory.mktemp("images"), 6)


@pytest.mark.slow
def test_txt_captions_metadata_jsonl_and_an_hf_dataset_train_an_sd_pipeline_to_the_same_bits(images, tmp_path):
    """The same six images and captions three ways: the folder source reads `.txt` or `metadata.jsonl` captions
    in the same order and the hf source a `save_to_disk` dataset's rows: the LoRA runs are bit-identical."""
    datasets = pytest.importorskip("datasets")
    sd = BUILDERS["sd"](tmp_path / "pipelines")
    captions = {f"{i}.png": (images / f"{i}.txt").read_text() for i in range(6)}
    jsonl = tmp_path / "jsonl"
    jsonl.mkdir()
    for name in captions:
        shutil.copy(images / name, jsonl / name)
    (jsonl / "metadata.jsonl").write_text(
        "".join(json.dumps({"file_name": n, "text": c}) + "\n" for n, c in captions.items())
    )
    rows = {"image": [str(images / n) for n in captions], "text": list(captions.values())}
    features = datasets.Features(image=datasets.Image(), text=datasets.Value("string"))
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "hf"))
    sources = {
        "txt": [],
        "metadata.jsonl": [f"data.path={jsonl}"],
        "hf": ["data.source=hf", f"data.path={tmp_path / 'hf'}"],
    }
    got = {}
    for name, extra in sources.items():
        r = _train(sd, images, tmp_path / name, *extra, "train.precision=no", steps=2)
        assert r.returncode == 0, (name, r.stderr[-3000:])
        got[name] = _files(tmp_path / name, 2)
    assert any(v.abs().max() > 0 for k, v in got["txt"]["unet.model.safetensors"].items() if ".lora_B." in k)
    assert_tensors_equal(got["metadata.jsonl"], got["txt"], "metadata.jsonl vs .txt")
    assert_tensors_equal(got["hf"], got["txt"], "hf vs .txt")


def _members(url: str, shard: int) -> list[dict[str, bytes]]:
    out: dict[str, dict[str, bytes]] = {}
    with tarfile.open(f"{url}/{shard:06d}.tar") as tf:
        for m in tf:
            key, ext = m.name.split(".", 1)
            out.setdefault(key, {})[ext] = tf.extractfile(m).read()
    return list(out.values())


def _npy(raw: bytes) -> torch.Tensor:
    return torch.from_numpy(np.load(io.BytesIO(raw), allow_pickle=False))


@pytest.mark.slow
def test_data_encode_with_an_sdxl_pipeline_stores_its_own_encoders_output_trains_resumes_and_pins_them(
    images, tmp_path
):
    """`data encode --text` on an SDXL pipeline's config: the stored posteriors are the folder's AutoencoderKL's
    (diffusers' latent_dist, bit for bit, same batches) and the embeddings StableDiffusionXLPipeline.encode_prompt's
    (both CLIPs' tokens, CLIP-G's pooled projection); each folder is pinned; a run from the shards trains and a
    SIGKILLed one resumes bit-identically; a pipeline whose text_encoder_2 differs exits 2 naming it."""
    from diffusers import AutoencoderKL, StableDiffusionXLPipeline

    sdxl = BUILDERS["sdxl"](tmp_path / "pipelines")
    # model.text.batch_size=1: one caption a forward, as encode_prompt runs one prompt (more rows change the last
    # bits of CLIP-G's pooled projection; a run reads the same vectors whatever the encoder's batch: see text.py).
    cfg = pipeline_config(
        "sdxl-lora", sdxl, tmp_path, f"data.path={images}", "data.flip=false", "model.text.batch_size=1"
    )
    url = str(tmp_path / "shards")
    encode_dataset(cfg, url, 3, text=True, dtype="float32", progress=False)
    encoded = json.loads((tmp_path / "shards" / "shards.json").read_text())["encoded"]
    assert encoded["autoencoder"]["url"] == f"{sdxl}/vae"
    parts = encoded["text"]["parts"]
    assert {r: p["url"] for r, p in parts.items()} == {
        "encoder": f"{sdxl}/text_encoder",
        "tokenizer": f"{sdxl}/tokenizer",
        "encoder_2": f"{sdxl}/text_encoder_2",
        "tokenizer_2": f"{sdxl}/tokenizer_2",
    }
    source = _source(cfg)  # the images as the run reads them
    vae = AutoencoderKL.from_pretrained(sdxl / "vae").eval()
    pipe = StableDiffusionXLPipeline.from_pretrained(sdxl)
    for shard in (0, 1):
        samples = _members(url, shard)
        index = [source.keys(i) for i in range(len(source))]
        batch = torch.stack([source.items[SampleRef(index.index(s["src"].decode()), 0)][0] for s in samples])
        with torch.no_grad():
            dist = vae.encode(batch).latent_dist
        for i, s in enumerate(samples):
            assert torch.equal(_npy(s["mean.npy"]), dist.mean[i]) and torch.equal(_npy(s["std.npy"]), dist.std[i])
            tokens, _, pooled, _ = pipe.encode_prompt(
                s["txt"].decode(), device="cpu", do_classifier_free_guidance=False
            )
            assert torch.equal(_npy(s["text.tokens.npy"]), tokens[0]) and torch.equal(
                _npy(s["text.pooled.npy"]), pooled[0]
            )

    shards = ["data.source=shards", f"data.urls={url}/shards.json", "data.flip=false"]
    r = _train(sdxl, images, tmp_path / "run", *shards, preset="sdxl-lora")
    assert r.returncode == 0, r.stderr[-3000:]
    r = _train(sdxl, images, tmp_path / "killed", *shards, preset="sdxl-lora", env=KILL_AT_3)
    assert r.returncode == -9, r.stderr[-3000:]
    r = _train(sdxl, images, tmp_path / "killed", *shards, preset="sdxl-lora")
    assert r.returncode == 0 and "step-000000002" in r.stderr, r.stderr[-3000:]
    a, b = _files(tmp_path / "run", 4), _files(tmp_path / "killed", 4)
    assert any(v.abs().max() > 0 for k, v in a["unet.model.safetensors"].items() if ".lora_B." in k)
    assert_tensors_equal(a, b, "resumed from shards")

    other = tmp_path / "other"
    shutil.copytree(sdxl, other)
    weights = other / "text_encoder_2" / "model.safetensors"
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1
    save_file(tensors, weights)
    r = _train(other, images, tmp_path / "other-run", *shards, preset="sdxl-lora")
    line = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"model.text.encoder_2 is {other}/text_encoder_2" in line and f"{sdxl}/text_encoder_2" in line, line
    assert "model.text.encoder " not in line.split("): ")[0], line  # CLIP-L, unchanged, is not named
