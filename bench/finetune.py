"""Fine-tuning a released pipeline: gentrain's LoRA run against diffusers' own DreamBooth LoRA script (issue 48
deliver 7), paired and alternated; and a LoRA checkpoint's bytes and save time against a full fine-tune's.

Both sides train LoRA adapters on the same random pipeline folder (built here by diffusers' own classes and
`save_pretrained`, with a word-level tokenizer made here; nothing downloaded), the same images (random RGB PNGs
at `--resolution`), one caption for every image (the script's `--instance_prompt`; a `.txt` beside each image for
gentrain), rank, batch, steps, learning rate (constant, no warm-up), AdamW, gradient clipping at 1.0, no EMA
(the script has none: `ema.enabled=false`), no flip, no validation or previews, no data-loader workers, one
process each. Text embeddings are computed once on both sides (the script's `--pre_compute_text_embeddings`
for SD; SD3's and Flux's scripts do so themselves for one prompt; gentrain caches them); the VAE encodes every
step on both.

- `--shape sd` (default, the CPU run): a Stable Diffusion 1.x-shaped pipeline, UNet (`--width` channels, x2
  below), CLIP, VAE; the peer is `examples/dreambooth/train_dreambooth_lora.py`, gentrain the `sd15-lora` preset.
- `--shape sd3|flux` (for a GPU: `--device cuda --dtype bf16`): an SD3- or Flux.1-dev-shaped transformer at real
  width (SD3 medium: 24 heads x 64, joint 4096, pooled 2048; Flux: 24 x 128, joint 4096, pooled 768) with
  `--blocks` blocks (Flux: as many double and twice as many single), random weights, text encoders at their real
  output widths with one layer, a 16-channel VAE downsampling 8x; peers `train_dreambooth_lora_sd3.py` /
  `train_dreambooth_lora_flux.py`, gentrain `sd3-lora` / `flux-lora`.

The peer script is never part of this repo: `--peer-script PATH` (diffusers' examples at the tag of the installed
diffusers) and `--peer-python PATH` (an interpreter that imports torchvision, which the scripts need; see
docs/benchmarks.md for how the CPU one here was made).

**Step time** is measured the same way on both sides, by a wall-clock stamp at every optimizer step: each
process runs under this file's `--child` mode, which registers torch's global optimizer-step post hook
(`torch.optim.optimizer.register_optimizer_step_post_hook`) and then runs the program (`python -m trainer` or
the script) in-process with `runpy`. Steps per second = (steps - warmup) / (stamp[last] - stamp[warmup - 1]):
the window starts after `--warmup` steps and ends at the last step's update, so start-up (imports, loading, the
script's text embedding), the first steps and the final save, export and inference are all outside it.
The same stamps carry the process's CPU time (`time.process_time()`, all its threads): CPU seconds per step over
the same window, which the machine's other load disturbs less than wall time. **Peak RSS** is each process's own
`ru_maxrss` (`os.wait4`). Rounds alternate which side runs first, so drifting load hits both alike; the JSON
gives each side's median steps/s, CPU s/step and peak RSS, and the ratios gentrain/diffusers per round with
their median and spread (min, max): steps per second (above 1: gentrain is faster) and CPU per step (below 1:
gentrain uses less).

**Checkpoints**: one more gentrain run of each kind (LoRA, and a full fine-tune: `model.lora=null`) saving at
`--steps`: the committed step folder's bytes on disk, the commit time its log line reports (`checkpoint committed
... in S s`) and the training thread's checkpoint stall (`checkpoint_stall=` of its time line).

Usage (2 cores here: hold the shared lock):
    flock /tmp/gentrain-cpu.lock python bench/finetune.py --peer-script /work/peer/train_dreambooth_lora.py \
        --peer-python /work/peer/venv/bin/python [--rounds 3] [--steps 30] [--json OUT]
A GPU (someone else's run; carry the peer scripts and a venv with torchvision):
    python bench/finetune.py --shape sd3 --device cuda --dtype bf16 --resolution 512 --blocks 4 \
        --peer-script PEER/train_dreambooth_lora_sd3.py --peer-python VENV/bin/python --json OUT
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORDS = ["a", "photo", "of", "sks", "dog", "on", "the", "red", "blue", "green", "sofa", "grass"]
PROMPT = "a photo of sks dog"
PRESETS = {"sd": "sd15-lora", "sd3": "sd3-lora", "flux": "flux-lora"}
_COMMITTED = re.compile(r"checkpoint committed (\S+) \(([0-9.]+) MB in ([0-9.]+)s")
_STALL = re.compile(r"time of this process.*checkpoint_stall=([0-9.]+)")


# ------------------------------------------------------------------------------------------ the pipeline


def _tokenizer(folder: Path, *, clip: bool, max_length: int) -> None:
    """A word-level tokenizer with CLIP's (`<bos> $A <eos>`) or T5's (`$A </s>`) special tokens, as the tests make
    theirs (tests/test_text_encoders.py): what AutoTokenizer reads without a download. The SD3 and Flux scripts
    load them with their own classes (CLIPTokenizer, T5TokenizerFast), which rebuild the pre-tokenizer: their
    token ids differ from gentrain's, which costs the same on random weights (every prompt is padded to the
    same lengths on both sides)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|startoftext|>", "<unk>"] if clip else ["<pad>", "</s>", "<unk>"]
    if clip:
        tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(special + WORDS)}, unk_token="<unk>"))
    else:  # a Unigram model, as T5's: the SD3 and Flux scripts load it with T5TokenizerFast, which reads no other
        tok = Tokenizer(models.Unigram([(t, 0.0) for t in special] + [(w, -1.0) for w in WORDS], unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if clip:
        tok.post_processor = processors.TemplateProcessing(
            single="<|startoftext|> $A <|endoftext|>", special_tokens=[("<|startoftext|>", 1), ("<|endoftext|>", 0)]
        )
        names = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    else:
        tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
        names = {"eos_token": "</s>", "pad_token": "<pad>"}
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", model_max_length=max_length, **names
    ).save_pretrained(folder)


def _clip(folder: Path, hidden: int, projection: int, layers: int, positions: int, with_projection: bool):
    from transformers import AutoTokenizer, CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(
        vocab_size=len(WORDS) + 3,
        hidden_size=hidden,
        projection_dim=projection,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64) if hidden >= 64 else 2,
        max_position_embeddings=positions,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=0,
    )
    model = (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(cfg)
    _tokenizer(folder, clip=True, max_length=positions)
    return model, AutoTokenizer.from_pretrained(folder)


def _t5(folder: Path, d_model: int, max_length: int):
    from transformers import AutoTokenizer, T5Config, T5EncoderModel

    cfg = T5Config(
        vocab_size=len(WORDS) + 3,
        d_model=d_model,
        d_kv=64,
        d_ff=1024,
        num_layers=1,
        num_heads=max(1, d_model // 64),
        feed_forward_proj="gated-gelu",
        pad_token_id=0,
        eos_token_id=1,
    )
    _tokenizer(folder, clip=False, max_length=max_length)
    return T5EncoderModel(cfg), AutoTokenizer.from_pretrained(folder)


def _vae(block_out: tuple[int, ...], latent_channels: int, **factors):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(block_out),
        up_block_types=("UpDecoderBlock2D",) * len(block_out),
        block_out_channels=block_out,
        latent_channels=latent_channels,
        norm_num_groups=min(8, block_out[0]),
        layers_per_block=1,
        **factors,
    )


def build_pipeline(root: Path, shape: str, width: int, blocks: int) -> Path:
    """A random pipeline folder of `shape`, saved by diffusers (safetensors)."""
    import torch

    torch.manual_seed(0)
    parts = root / "parts"
    if shape == "sd":
        from diffusers import DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel

        text_encoder, tokenizer = _clip(parts / "clip", 4 * width // 2, 4 * width // 2, 2, 16, False)
        unet = UNet2DConditionModel(
            sample_size=16,
            in_channels=4,
            out_channels=4,
            block_out_channels=(width, 2 * width),
            layers_per_block=1,
            norm_num_groups=8,
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=text_encoder.config.hidden_size,
            attention_head_dim=8,
        )
        pipe = StableDiffusionPipeline(
            vae=_vae((16, 32), 4),
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            unet=unet,
            scheduler=DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
    elif shape == "sd3":
        from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

        clip_l, tok_l = _clip(parts / "clip_l", 768, 768, 1, 77, True)
        clip_g, tok_g = _clip(parts / "clip_g", 1280, 1280, 1, 77, True)
        t5, tok_t5 = _t5(parts / "t5", 4096, 77)
        transformer = SD3Transformer2DModel(
            sample_size=128,
            patch_size=2,
            in_channels=16,
            out_channels=16,
            num_layers=blocks,
            attention_head_dim=64,
            num_attention_heads=24,
            joint_attention_dim=4096,
            caption_projection_dim=1536,
            pooled_projection_dim=2048,
            pos_embed_max_size=192,
        )
        pipe = StableDiffusion3Pipeline(
            transformer=transformer,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=_vae((32, 32, 64, 64), 16, scaling_factor=1.5305, shift_factor=0.0609),
            text_encoder=clip_l,
            tokenizer=tok_l,
            text_encoder_2=clip_g,
            tokenizer_2=tok_g,
            text_encoder_3=t5,
            tokenizer_3=tok_t5,
        )
    elif shape == "flux":
        from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

        clip_l, tok_l = _clip(parts / "clip_l", 768, 768, 1, 77, False)
        t5, tok_t5 = _t5(parts / "t5", 4096, 512)
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=64,
            num_layers=blocks,
            num_single_layers=2 * blocks,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=4096,
            pooled_projection_dim=768,
            guidance_embeds=True,
            axes_dims_rope=(16, 56, 56),
        )
        scheduler = FlowMatchEulerDiscreteScheduler(
            shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15
        )
        pipe = FluxPipeline(
            scheduler=scheduler,
            vae=_vae((32, 32, 64, 64), 16, scaling_factor=0.3611, shift_factor=0.1159),
            text_encoder=clip_l,
            tokenizer=tok_l,
            text_encoder_2=t5,
            tokenizer_2=tok_t5,
            transformer=transformer,
        )
    else:
        raise SystemExit(f"--shape {shape!r}: sd, sd3 or flux")
    pipe.save_pretrained(root / shape)
    shutil.rmtree(parts, ignore_errors=True)
    return root / shape


def write_images(folder: Path, n: int, resolution: int) -> Path:
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (resolution, resolution, 3), dtype=np.uint8)).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(PROMPT)
    return folder


# ------------------------------------------------------------------------------------------ the two sides


def gentrain_args(a, pipeline: Path, images: Path, out: Path, *extra: str) -> list[str]:
    return [
        "-m",
        "trainer",
        "train",
        PRESETS[a.shape],
        f"model.pretrained={pipeline}",
        f"data.path={images}",
        f"data.image_size={a.resolution}",
        "data.buckets=null",  # square crops, as the peer script trains (the sd3/flux presets train on buckets)
        "data.flip=false",
        "data.val_fraction=0",
        f"train.max_steps={a.steps}",
        f"train.batch_size={a.batch}",
        f"train.lr={a.lr}",
        "train.lr_schedule=constant",
        "train.warmup_steps=0",
        "train.num_workers=0",
        "train.val_every_steps=0",
        f"train.precision={'no' if a.dtype == 'fp32' else 'bf16'}",
        f"model.lora.rank={a.rank}",
        "ema.enabled=false",
        "sample.every_steps=0",  # and at the end (after the window): one image of one step
        "sample.num=1",
        "sample.inference_steps=1",
        f"checkpoint.every_steps={a.steps}",
        f"run.dir={out}",
        f"model.text.cache_dir={out}-text",
        *extra,
    ]


def peer_args(a, pipeline: Path, images: Path, out: Path) -> list[str]:
    plain = images.parent / "plain"  # the script reads every file of the folder as an image: no .txt beside them
    if not plain.is_dir():
        plain.mkdir()
        for png in images.glob("*.png"):
            shutil.copy(png, plain / png.name)
    args = [
        a.peer_script,
        f"--pretrained_model_name_or_path={pipeline}",
        f"--instance_data_dir={plain}",
        f"--instance_prompt={PROMPT}",
        f"--resolution={a.resolution}",
        f"--train_batch_size={a.batch}",
        f"--max_train_steps={a.steps}",
        f"--learning_rate={a.lr}",
        "--lr_scheduler=constant",
        "--lr_warmup_steps=0",
        f"--rank={a.rank}",
        f"--mixed_precision={'no' if a.dtype == 'fp32' else 'bf16'}",
        "--seed=0",
        "--dataloader_num_workers=0",
        f"--checkpointing_steps={10 * a.steps}",
        "--report_to=tensorboard",
        f"--output_dir={out}",
    ]
    if a.shape == "sd":
        args.append("--pre_compute_text_embeddings")
    return args


def run_child(python: str, args: list[str], log: Path, threads: int) -> dict:
    """One process under `--child`: its optimizer-step stamps, wall time and peak RSS."""
    stamps = log.with_suffix(".stamps")
    stamps.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GENTRAIN_", "TORCHELASTIC_"))}
    env.update(
        OMP_NUM_THREADS=str(threads),
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=str(REPO),
        TOKENIZERS_PARALLELISM="false",
    )
    t = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [python, str(Path(__file__).resolve()), "--child", str(stamps), "--", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=log.parent,
        )
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"{' '.join(args[:4])} ... failed ({code}):\n{log.read_text()[-4000:]}")
    rows = [line.split() for line in stamps.read_text().splitlines()] if stamps.exists() else []
    return {
        "stamps": [float(r[0]) for r in rows],
        "cpu_stamps": [float(r[1]) for r in rows],
        "wall_s": round(wall, 2),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
    }


def steps_per_s(stamps: list[float], warmup: int) -> float:
    if len(stamps) <= warmup:
        raise SystemExit(f"{len(stamps)} optimizer steps recorded: fewer than --warmup {warmup} + 1")
    return (len(stamps) - warmup) / (stamps[-1] - stamps[warmup - 1])


def _child(stamps: str, argv: list[str]) -> None:
    """Run a program in this process with a stamp at every optimizer step (see the module doc)."""
    import runpy

    from torch.optim.optimizer import register_optimizer_step_post_hook

    f = open(stamps, "a", buffering=1)  # noqa: SIM115 (open for the whole run: one line a step)
    # Wall clock and this process's CPU time (all its threads) at the end of every optimizer step.
    register_optimizer_step_post_hook(lambda *_: f.write(f"{time.perf_counter()!r} {time.process_time()!r}\n"))
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, str(Path(argv[0]).parent))
        runpy.run_path(argv[0], run_name="__main__")


def checkpoint_costs(a, pipeline: Path, images: Path, work: Path) -> dict:
    """A LoRA run's checkpoint against a full fine-tune's: bytes on disk, commit time, the step's stall."""
    out = {}
    for kind, extra in (("lora", []), ("full", ["model.lora=null"])):
        run = work / f"ckpt-{kind}"
        shutil.rmtree(run, ignore_errors=True)
        log = work / f"ckpt-{kind}.log"
        run_child(sys.executable, gentrain_args(a, pipeline, images, run, *extra), log, a.threads)
        text = log.read_text()
        committed = _COMMITTED.findall(text)
        stall = _STALL.search(text)
        if not committed:
            raise SystemExit(f"{log}: no committed checkpoint")
        url, _, seconds = committed[-1]
        folder = Path(url)
        out[kind] = {
            "bytes": sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()),
            "commit_s": float(seconds),
            "stall_s": float(stall.group(1)) if stall else None,
        }
    out["bytes_ratio_full_over_lora"] = round(out["full"]["bytes"] / out["lora"]["bytes"], 1)
    return out


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[4:])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer-script", help="diffusers' examples/dreambooth/train_dreambooth_lora*.py (not in the repo)")
    p.add_argument("--peer-python", default=sys.executable, help="an interpreter that imports torchvision")
    p.add_argument("--shape", default="sd", choices=["sd", "sd3", "flux"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--pipeline", help="an existing pipeline folder of --shape instead of building one")
    p.add_argument("--width", type=int, default=32, help="sd: the UNet's first block channels (x2 below)")
    p.add_argument("--blocks", type=int, default=4, help="sd3 / flux: transformer blocks")
    p.add_argument("--resolution", type=int, default=32)
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps before the measured window")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each process (a GPU run: more)")
    p.add_argument("--no-checkpoints", action="store_true", help="skip the LoRA vs full checkpoint runs")
    p.add_argument("--work", help="working folder (default: a temporary one, removed)")
    p.add_argument("--json")
    a = p.parse_args()
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # both sides on the CPU (each picks a GPU when it sees one)
    work = Path(a.work or tempfile.mkdtemp(prefix="gentrain-finetune-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        pipeline = Path(a.pipeline) if a.pipeline else build_pipeline(work / "pipelines", a.shape, a.width, a.blocks)
        images = write_images(work / "data" / "images", a.images, a.resolution)
        result: dict = {
            "bench": "finetune",
            "shape": a.shape,
            "device": a.device,
            "dtype": a.dtype,
            "settings": {k: getattr(a, k) for k in ("width", "blocks", "resolution", "images", "batch", "rank")}
            | {k: getattr(a, k) for k in ("steps", "warmup", "rounds", "threads")},
            "peer_script": a.peer_script,
        }
        if a.peer_script:
            rounds = []
            for r in range(a.rounds):
                order = ("gentrain", "diffusers") if r % 2 == 0 else ("diffusers", "gentrain")
                got = {}
                for side in order:
                    out = work / f"{side}-{r}"
                    shutil.rmtree(out, ignore_errors=True)
                    if side == "gentrain":
                        args, python = gentrain_args(a, pipeline, images, out), sys.executable
                    else:
                        args, python = peer_args(a, pipeline, images, out), a.peer_python
                    run = run_child(python, args, work / f"{side}-{r}.log", a.threads)
                    rate = steps_per_s(run["stamps"], a.warmup)
                    cpu = 1 / steps_per_s(run["cpu_stamps"], a.warmup)
                    got[side] = {"steps_per_s": rate, "cpu_s_per_step": cpu, "steps_recorded": len(run["stamps"])}
                    got[side].update({k: run[k] for k in ("wall_s", "peak_rss_mb")})
                got["ratio"] = got["gentrain"]["steps_per_s"] / got["diffusers"]["steps_per_s"]
                got["cpu_ratio"] = got["gentrain"]["cpu_s_per_step"] / got["diffusers"]["cpu_s_per_step"]
                print(json.dumps({"round": r, "first": order[0], **got}), file=sys.stderr, flush=True)
                rounds.append(got)
            result["rounds"] = rounds
            result["summary"] = {
                side: {
                    "steps_per_s_median": round(statistics.median(g[side]["steps_per_s"] for g in rounds), 3),
                    "cpu_s_per_step_median": round(statistics.median(g[side]["cpu_s_per_step"] for g in rounds), 4),
                    "peak_rss_mb_median": statistics.median(g[side]["peak_rss_mb"] for g in rounds),
                }
                for side in ("gentrain", "diffusers")
            }
            for key, name in (("ratio", "steps_per_s"), ("cpu_ratio", "cpu_s_per_step")):
                ratios = [g[key] for g in rounds]
                result["summary"][f"{name}_gentrain_over_diffusers"] = {
                    "median": round(statistics.median(ratios), 3),
                    "min": round(min(ratios), 3),
                    "max": round(max(ratios), 3),
                }
        if not a.no_checkpoints:
            result["checkpoints"] = checkpoint_costs(a, pipeline, images, work)
        text = json.dumps(result, indent=1)
        print(text)
        if a.json:
            Path(a.json).write_text(text + "\n")
    finally:
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
