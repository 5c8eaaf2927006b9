"""The transformers text encoders (model.text.kind t5, clip, sd3): the real transformers classes with tiny random
weights saved to folders (safetensors, a tokenizers tokenizer), loaded through the config, nothing downloaded."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from trainer.conditioning.text import TextEncoder, TextEncoderConfig, check_stored_encoders, text_encoders
from trainer.errors import ConfigError

WORDS = (
    "a an the handwritten photo of red blue cat dog on mat zero one two three four five six seven eight nine".split()
)


def _tokenizer(folder: Path, *, clip: bool) -> None:
    """A word-level tokenizer with T5's (`$A </s>`) or CLIP's (`<bos> $A <eos>`) special tokens, saved as a
    PreTrainedTokenizerFast (tokenizer.json: what AutoTokenizer reads without sentencepiece)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|startoftext|>", "<unk>"] if clip else ["<pad>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(special + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if clip:
        tok.post_processor = processors.TemplateProcessing(
            single="<|startoftext|> $A <|endoftext|>", special_tokens=[("<|startoftext|>", 1), ("<|endoftext|>", 0)]
        )
        names = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    else:
        tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
        names = {"eos_token": "</s>", "pad_token": "<pad>"}
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", **names).save_pretrained(folder)


def tiny_t5(folder: Path, d_model: int = 16, seed: int = 0) -> Path:
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    cfg = T5Config(
        vocab_size=len(WORDS) + 3,
        d_model=d_model,
        d_kv=4,
        d_ff=32,
        num_layers=2,
        num_heads=2,
        feed_forward_proj="gated-gelu",
        pad_token_id=0,
        eos_token_id=1,
    )
    T5EncoderModel(cfg).save_pretrained(folder, safe_serialization=True)
    _tokenizer(folder, clip=False)
    return folder


def tiny_clip(folder: Path, hidden: int = 8, projection: int = 6, seed: int = 0, tokenizer: Path | None = None) -> Path:
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    cfg = CLIPTextConfig(
        vocab_size=len(WORDS) + 3,
        hidden_size=hidden,
        projection_dim=projection,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=0,
    )
    CLIPTextModelWithProjection(cfg).save_pretrained(folder, safe_serialization=True)
    _tokenizer(tokenizer or folder, clip=True)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """An SD3-like set: CLIP-L (8 wide, projection 6), CLIP-G (12, projection 10, its tokenizer in a folder of its
    own, as diffusers' SD3 folders keep them), T5 (24 wide: the CLIPs' 8 + 12 zero-padded to it)."""
    root = tmp_path_factory.mktemp("encoders")
    return {
        "clip_l": tiny_clip(root / "text_encoder", 8, 6, seed=1),
        "clip_g": tiny_clip(root / "text_encoder_2", 12, 10, seed=2, tokenizer=root / "tokenizer_2"),
        "tokenizer_2": root / "tokenizer_2",
        "t5": tiny_t5(root / "text_encoder_3", 24, seed=3),
    }


def sd3_config(folders, tmp_path, **extra) -> TextEncoderConfig:
    return TextEncoderConfig(
        kind="sd3",
        encoder=str(folders["clip_l"]),
        encoder_2=str(folders["clip_g"]),
        tokenizer_2=str(folders["tokenizer_2"]),
        encoder_3=str(folders["t5"]),
        width=24,
        pooled_width=16,
        max_tokens=6,
        clip_max_tokens=8,
        cache_dir=str(tmp_path / "cache"),
        **extra,
    )


def _reference(folder: Path, kind: str, captions: list[str], length: int, masked: bool = True):
    """What diffusers' pipelines do with the model, called here directly on the transformers classes."""
    from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

    tok = AutoTokenizer.from_pretrained(folder)
    t = tok(captions, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
    with torch.no_grad():
        if kind == "t5":
            model = T5EncoderModel.from_pretrained(folder)
            return model(t.input_ids, attention_mask=t.attention_mask if masked else None)[0], t.attention_mask
        out = CLIPTextModelWithProjection.from_pretrained(folder)(t.input_ids, output_hidden_states=True)
        return out.hidden_states[-2], out.text_embeds


CAPTIONS = ["a handwritten seven", "a red cat on the mat", "", "a photo of a blue dog"]


def test_t5_encodes_as_pixarts_pipeline_with_its_attention_mask(folders, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    cfg = TextEncoderConfig(kind="t5", encoder=str(folders["t5"]), width=24, max_tokens=7, cache_dir=str(tmp_path))
    enc = TextEncoder.from_config(cfg)
    import os

    assert os.environ["HF_HUB_OFFLINE"] == "1"  # nothing is downloaded, whatever the folder says
    emb = enc.encode(CAPTIONS)
    assert emb.tokens.shape == (4, 7, 24) and emb.mask.shape == (4, 7) and emb.pooled.shape == (4, 24)
    ref, mask = _reference(folders["t5"], "t5", CAPTIONS, 7)
    assert torch.equal(emb.mask, mask.float())
    # "a handwritten seven" + </s>: 4 real tokens; the empty caption is </s> alone
    assert emb.mask.sum(1).tolist() == [4, 7, 1, 7]
    torch.testing.assert_close(emb.tokens, ref)
    real = mask[..., None].float()
    torch.testing.assert_close(emb.pooled, (ref * real).sum(1) / real.sum(1))


def test_a_t5_folder_with_only_a_sentencepiece_model_encodes_as_t5s_tokenizer_reads_it(tmp_path):
    """T5 v1.1's and PixArt's published tokenizer folders hold spiece.model and no tokenizer.json: the text
    extra's sentencepiece reads them. A real SentencePiece unigram model, trained here on a few captions."""
    import json

    import sentencepiece
    from transformers import T5Config, T5EncoderModel

    folder = tmp_path / "t5"
    folder.mkdir()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CAPTIONS[:2] + CAPTIONS[3:] + [" ".join(WORDS)]) * 20 + "\n")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(folder / "spiece"),
        vocab_size=40,
        hard_vocab_limit=False,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    (folder / "spiece.vocab").unlink()
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "T5Tokenizer", "extra_ids": 0, "eos_token": "</s>", "pad_token": "<pad>"})
    )
    vocab = sentencepiece.SentencePieceProcessor(model_file=str(folder / "spiece.model")).get_piece_size()
    torch.manual_seed(0)
    config = T5Config(vocab_size=vocab, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=2, pad_token_id=0)
    T5EncoderModel(config).save_pretrained(folder, safe_serialization=True)
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json",
        "model.safetensors",
        "spiece.model",
        "tokenizer_config.json",
    ]
    cfg = TextEncoderConfig(kind="t5", encoder=str(folder), width=16, max_tokens=24, cache_dir=str(tmp_path / "c"))
    emb = TextEncoder(cfg).encode(CAPTIONS)
    ref, mask = _reference(folder, "t5", CAPTIONS, 24)
    real = emb.mask.sum(1).tolist()
    assert torch.equal(emb.mask, mask.float()) and real[2] == 1 and 2 < real[0] < 24, real  # "" is </s> alone
    torch.testing.assert_close(emb.tokens, ref)


def test_sd3_combines_two_clips_and_t5_as_diffusers_encode_prompt(folders, tmp_path):
    enc = TextEncoder(sd3_config(folders, tmp_path))
    emb = enc.encode(CAPTIONS)
    assert emb.tokens.shape == (4, 8 + 6, 24) and emb.pooled.shape == (4, 6 + 10)
    assert torch.equal(emb.mask, torch.ones(4, 14))  # the MMDiT attends to every token, as in SD3
    clip_l, pooled_l = _reference(folders["clip_l"], "clip", CAPTIONS, 8)
    from transformers import AutoTokenizer, CLIPTextModelWithProjection

    tok = AutoTokenizer.from_pretrained(folders["tokenizer_2"])
    ids = tok(CAPTIONS, padding="max_length", max_length=8, truncation=True, return_tensors="pt").input_ids
    with torch.no_grad():
        out = CLIPTextModelWithProjection.from_pretrained(folders["clip_g"])(ids, output_hidden_states=True)
    t5, _ = _reference(folders["t5"], "t5", CAPTIONS, 6, masked=False)
    # pooled: the two projections side by side
    torch.testing.assert_close(emb.pooled, torch.cat([pooled_l, out.text_embeds], -1))
    # tokens: CLIP-L then CLIG-G channels, zero-padded to T5's 24, then T5's tokens after them
    torch.testing.assert_close(emb.tokens[:, :8, :8], clip_l)
    torch.testing.assert_close(emb.tokens[:, :8, 8:20], out.hidden_states[-2])
    assert torch.equal(emb.tokens[:, :8, 20:], torch.zeros(4, 8, 4))
    torch.testing.assert_close(emb.tokens[:, 8:], t5)
    assert enc.width == 24 and enc.pooled_width == 16


@pytest.mark.parametrize("kind", ["t5", "clip", "sd3"])
def test_a_caption_embeds_bit_identically_alone_and_anywhere_in_a_batch(kind, folders, tmp_path):
    """Fixed-length padding and fixed-shape forwards: a caption's row does not depend on its neighbours, so
    a resumed run whose cache is cold gets the floats the first run cached."""
    if kind == "sd3":
        cfg = sd3_config(folders, tmp_path / "a", batch_size=4)
    else:
        folder, width = (folders["t5"], 24) if kind == "t5" else (folders["clip_l"], 8)
        pooled = 6 if kind == "clip" else None
        cfg = TextEncoderConfig(
            kind=kind,
            encoder=str(folder),
            width=width,
            pooled_width=pooled,
            max_tokens=8,
            batch_size=4,
            cache_dir=str(tmp_path / "a"),
        )
    alone = TextEncoder(cfg).encode(["a red cat on the mat"])
    crowd = ["the dog", "one two three four five six", "a red cat on the mat", "nine", "a", "seven eight"]
    batched = TextEncoder(cfg.model_copy(update={"cache_dir": str(tmp_path / "b")})).encode(crowd)
    for field in ("tokens", "mask", "pooled"):
        assert torch.equal(getattr(batched, field)[2], getattr(alone, field)[0]), field


def test_the_training_steps_autocast_never_reaches_the_cached_vectors(folders, tmp_path):
    # Captions are encoded inside the step's forward, under train.precision's autocast on the training device.
    cfg = TextEncoderConfig(
        kind="t5", encoder=str(folders["t5"]), width=24, max_tokens=8, cache_dir=str(tmp_path / "a")
    )
    plain = TextEncoder(cfg).encode(CAPTIONS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = TextEncoder(cfg.model_copy(update={"cache_dir": str(tmp_path / "b")})).encode(CAPTIONS)
    assert under.tokens.dtype == torch.float32
    for field in ("tokens", "mask", "pooled"):
        assert torch.equal(getattr(under, field), getattr(plain, field)), field


def test_the_encoders_run_where_asked_with_a_cache_of_their_own(folders, tmp_path):
    """`gentrain data encode` runs the transformers encoders on its GPU: every model moves there, and the
    embedding cache is another one, so a CPU run is never served vectors another device computed. (The meta
    device stands in for the GPU here: the models move, nothing is computed.)"""
    cfg = sd3_config(folders, tmp_path)
    cpu = TextEncoder(cfg)
    elsewhere = TextEncoder(cfg, run_on=torch.device("meta"))
    assert cpu.run_on.type == "cpu" and elsewhere.run_on.type == "meta"
    for part in elsewhere.backend.parts:
        assert {p.device.type for p in part.model.parameters()} == {"meta"}
        assert part.ids(["a cat"])[0].device.type == "meta"
    assert {p.device.type for part in cpu.backend.parts for p in part.model.parameters()} == {"cpu"}
    assert elsewhere.digest == cpu.digest and elsewhere.cache != cpu.cache and elsewhere.cache.name.endswith("-meta")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["t5", "sd3"])
def test_on_a_gpu_the_encoders_embed_as_on_the_cpu_and_alike_in_any_batch(kind, folders, tmp_path):
    """On CUDA: float32 CPU tensors come back, within float32 rounding of the CPU's, and a caption embeds
    bit-identically alone and in a batch (fixed shapes: the same cuBLAS kernels whoever the neighbours are)."""
    if kind == "sd3":
        cfg = sd3_config(folders, tmp_path / "cpu", batch_size=4)
    else:
        cfg = TextEncoderConfig(
            kind="t5", encoder=str(folders["t5"]), width=24, max_tokens=8, batch_size=4, cache_dir=str(tmp_path)
        )
    gpu = torch.device("cuda")
    crowd = ["the dog", "one two three four five six", "a red cat on the mat", "nine", "a", "seven eight"]
    on_gpu = TextEncoder(cfg.model_copy(update={"cache_dir": str(tmp_path / "gpu")}), run_on=gpu).encode(crowd)
    alone = TextEncoder(cfg.model_copy(update={"cache_dir": str(tmp_path / "gpu1")}), run_on=gpu).encode([crowd[2]])
    on_cpu = TextEncoder(cfg).encode(crowd)
    for field in ("tokens", "mask", "pooled"):
        g, c = getattr(on_gpu, field), getattr(on_cpu, field)
        assert g.device.type == "cpu" and g.dtype == torch.float32, field
        torch.testing.assert_close(g, c, rtol=1e-4, atol=1e-5)
        assert torch.equal(g[2], getattr(alone, field)[0]), field


def test_embeddings_are_cached_under_the_digest_and_a_changed_folder_changes_it(folders, tmp_path):
    cfg = sd3_config(folders, tmp_path)
    first = TextEncoder(cfg)
    a = first.encode(["a red cat"])
    second = TextEncoder(cfg)
    b = second.encode(["a red cat"])
    assert second.encoded == 0 and second.from_disk == 1 and torch.equal(a.tokens, b.tokens)
    assert first.digest == second.digest and first.digest.startswith("blake3:")
    # Another T5 (same shape, other weights): another digest, another cache, other vectors.
    changed = tmp_path / "t5b"
    tiny_t5(changed, 24, seed=9)
    third = TextEncoder(cfg.model_copy(update={"encoder_3": str(changed)}))
    assert third.digest != first.digest and third.cache != first.cache
    assert not torch.equal(third.encode(["a red cat"]).tokens, a.tokens) and third.encoded == 1


def test_a_cached_embedding_holding_inf_or_nan_is_encoded_again(folders, tmp_path):
    from safetensors.torch import load_file, save_file

    cfg = sd3_config(folders, tmp_path)
    a = TextEncoder(cfg).encode(["a red cat"])
    path = TextEncoder(cfg)._path("a red cat")
    cached = load_file(str(path))
    cached["pooled"][..., 0] = float("nan")  # as a bit flip on disk or a half-precision overflow would leave it
    save_file(cached, str(path))
    again = TextEncoder(cfg)
    b = again.encode(["a red cat"])
    assert again.encoded == 1 and again.from_disk == 0
    assert torch.equal(a.pooled, b.pooled) and torch.isfinite(load_file(str(path))["pooled"]).all()


def test_an_fsspec_url_is_copied_once_and_pins_the_same_digest(folders, tmp_path):
    local = TextEncoder(TextEncoderConfig(kind="t5", encoder=str(folders["t5"]), width=24, cache_dir=str(tmp_path)))
    url = TextEncoderConfig(kind="t5", encoder=f"file://{folders['t5']}", width=24, cache_dir=str(tmp_path))
    assert TextEncoder(url).digest == local.digest
    import fsspec

    mem = fsspec.filesystem("memory")
    mem.put(str(folders["t5"]), "/enc/t5", recursive=True)
    remote = TextEncoder(url.model_copy(update={"encoder": "memory://enc/t5"}))
    assert remote.digest == local.digest and remote.folder.is_relative_to(tmp_path / "encoders")
    assert torch.equal(remote.encode(["a cat"]).tokens, local.encode(["a cat"]).tokens)


def test_wrong_widths_folders_and_pickled_weights_are_config_errors(folders, tmp_path):
    t5 = str(folders["t5"])
    with pytest.raises(ConfigError, match="gives 24-wide embeddings but model.text.width=16"):
        TextEncoder(TextEncoderConfig(kind="t5", encoder=t5, width=16, cache_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match="gives 16-wide pooled embeddings but model.text.pooled_width=24"):
        TextEncoder(sd3_config(folders, tmp_path).model_copy(update={"pooled_width": 24}))
    with pytest.raises(ConfigError, match="holds a 't5' model, but it names a CLIP text model"):
        TextEncoder(TextEncoderConfig(kind="clip", encoder=t5, width=24, cache_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match="model.text.encoder='/nope' is not a folder"):
        TextEncoder(TextEncoderConfig(kind="t5", encoder="/nope", width=24, cache_dir=str(tmp_path)))
    pickled = tmp_path / "pickled"
    shutil.copytree(folders["t5"], pickled)
    from transformers import T5EncoderModel

    T5EncoderModel.from_pretrained(folders["t5"]).save_pretrained(pickled, safe_serialization=False)
    (pickled / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no pickled weights"):
        TextEncoder(TextEncoderConfig(kind="t5", encoder=str(pickled), width=24, cache_dir=str(tmp_path)))


def test_the_config_names_what_each_kind_needs():
    with pytest.raises(ValueError, match="kind=t5 needs model.text.encoder"):
        TextEncoderConfig(kind="t5")
    with pytest.raises(ValueError, match="kind=sd3 needs encoder \\(CLIP-L\\), encoder_2"):
        TextEncoderConfig(kind="sd3", encoder="/l", encoder_3="/t5")
    with pytest.raises(ValueError, match="kind=clip reads no encoder_2"):
        TextEncoderConfig(kind="clip", encoder="/l", encoder_2="/g")
    with pytest.raises(ValueError, match="reads at most 77 tokens"):
        TextEncoderConfig(kind="clip", encoder="/l", max_tokens=78)
    assert TextEncoderConfig().kind == "sentence-transformers" and TextEncoderConfig().tokens == 16
    sd3 = TextEncoderConfig(kind="sd3", encoder="/l", encoder_2="/g", encoder_3="/t5", max_tokens=256)
    assert sd3.tokens == 77 + 256 and sd3.source == (
        "encoder=/l, tokenizer=/l, encoder_2=/g, tokenizer_2=/g, encoder_3=/t5, tokenizer_3=/t5"
    )


def test_a_checkpoint_may_name_transformers_encoders_they_run_no_folder_code():
    from trainer.registry import load_config

    sd3 = ["model.text={kind: sd3, encoder: /l, encoder_2: /g, encoder_3: /t5, width: 4096, pooled_width: 2048}"]
    cfg = load_config("mmdit-512", [*sd3, "data.path=/data"], {}).model_cfg
    assert ("model.text.encoder_3", "/t5") in text_encoders(cfg)
    check_stored_encoders(cfg, None, "checkpoint x")  # no flag needed: no folder code runs
    with pytest.raises(ConfigError, match="has no text encoder that needs it"):
        check_stored_encoders(cfg, "/l", "checkpoint x")


def _flow(tmp_path, folders, backbone: str, text: str, *extra: str, max_steps: int = 2) -> list[str]:
    from conftest import tiny

    return tiny(
        tmp_path,
        f"model.backbone={backbone}",
        "model.prediction_type=flow",
        f"model.text={{{text}, cache_dir: {tmp_path}/text}}",
        *extra,
        max_steps=max_steps,
    )


def test_a_pixart_ddpm_trains_on_t5_tokens_and_their_mask(folders, tmp_path, monkeypatch):
    """In process: the task hands PixArt T5's tokens and attention mask (the empty caption for dropped ones)."""
    from trainer.checkpoint import CheckpointStore
    from trainer.elastic import DistEnv
    from trainer.loop import Trainer
    from trainer.registry import load_config

    monkeypatch.setenv("HOME", str(tmp_path))
    backbone = "{kind: pixart, num_layers: 1, num_attention_heads: 2, attention_head_dim: 8, caption_channels: 24}"
    text = f"kind: t5, encoder: {folders['t5']}, width: 24, max_tokens: 8, batch_size: 4"
    cfg = load_config(None, _flow(tmp_path, folders, backbone, text), environ={})
    trainer = Trainer(cfg, DistEnv())
    assert trainer.fit() == 0
    info = CheckpointStore(str(tmp_path / "run" / "checkpoints")).latest_valid()
    assert info.manifest.inputs["text_encoder"].source == str(folders["t5"])
    drop = torch.tensor([False, True])
    cond = trainer.task.conditions(2, torch.device("cpu"), drop, None, ["a handwritten seven", "a red cat"])
    assert cond["caption_mask"].sum(1).tolist() == [4, 1]  # "a handwritten seven </s>"; dropped: "" = </s>
    assert cond["captions"].shape == (2, 8, 24) and trainer.task.text.encoded > 2


@pytest.mark.slow
def test_an_mmdit_trains_on_sd3_encoders_samples_and_refuses_a_changed_t5_on_resume(folders, tmp_path):
    """Through the CLI: an MMDiT on the tiny SD3 set trains, pins the set's digest in its manifest, samples with
    a prompt; a T5 with other weights at the same folder is exit 2 on resume, nothing written."""
    from conftest import clean_env, run_cli

    from trainer.checkpoint import CheckpointStore
    from trainer.runs import load_for_inference
    from trainer.tasks.sampling import SampleRequest

    t5 = tmp_path / "t5"
    shutil.copytree(folders["t5"], t5)
    backbone = (
        "{kind: mmdit, num_layers: 1, num_attention_heads: 2, attention_head_dim: 8, caption_channels: 24, "
        "pooled_channels: 16}"
    )
    text = (
        f"kind: sd3, encoder: {folders['clip_l']}, encoder_2: {folders['clip_g']}, tokenizer_2: "
        f"{folders['tokenizer_2']}, encoder_3: {t5}, width: 24, pooled_width: 16, max_tokens: 6, clip_max_tokens: 8"
    )
    env = clean_env(HOME=str(tmp_path))
    r = run_cli("train", *_flow(tmp_path, folders, backbone, text), env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    root = str(tmp_path / "run" / "checkpoints")
    store = CheckpointStore(root)
    recorded = store.latest_valid().manifest.inputs["text_encoder"]
    assert recorded.pin and recorded.source.startswith(f"encoder={folders['clip_l']}, ")
    _, task, modules = load_for_inference(store.view(store.latest_valid()), True, torch.device("cpu"))
    assert task.text.digest == recorded.digest and task.cfg.text.kind == "sd3"
    request = SampleRequest(num=2, seed=1, inference_steps=2, prompts=["a handwritten seven"], guidance_scale=3.0)
    images = task.sample(modules, request, torch.device("cpu"))
    assert images.shape == (2, 1, 8, 8) and torch.isfinite(images).all()

    tiny_t5(t5, 24, seed=7)  # the same T5 shape, other weights, at the same folder
    r = run_cli("train", *_flow(tmp_path, folders, backbone, text, max_steps=4), env=env)
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"text_encoder: the run at {root} was trained with encoder={folders['clip_l']}" in r.stderr
    assert "Use the same weights again, or start a new run" in r.stderr
    assert store.latest_valid().step == 2
