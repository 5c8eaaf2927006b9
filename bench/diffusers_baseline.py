"""The training step of diffusers' `examples/unconditional_image_generation/train_unconditional.py`,
rebuilt on the same diffusers/accelerate API so `bench/vs_diffusers.py` can run it offline.

The upstream script imports torchvision (its transforms) and `datasets` (its
image folder), and neither can be used here: torchvision does not import next
to the CPU torch wheel and `datasets` is not a gentrain dependency. Everything
else is the script's code path with the script's defaults: `Accelerator` with a
`ProjectConfiguration` and an `InitProcessGroupKwargs` handler and tensorboard
logging, `UNet2DModel.from_config(--model_config_name_or_path)`, diffusers'
`EMAModel` built as the script builds it (`use_ema_warmup=True`, inv_gamma 1,
power 3/4, max decay 0.9999, foreach off) and stepped after each optimizer
step, `DDPMScheduler` (1000 steps, linear betas, epsilon), `torch.optim.AdamW`
over `model.parameters()` (lr 1e-4, betas 0.95/0.999, weight decay 1e-6, eps
1e-8), the cosine schedule from `diffusers.optimization.get_scheduler` with 500
warm-up steps, `accelerator.prepare`, noise and timesteps from the global RNG,
`F.mse_loss(model_output.float(), noise.float())`, `accelerator.backward`,
`accelerator.clip_grad_norm_(..., 1.0)`, `optimizer.zero_grad()`, a tqdm bar,
`loss.detach().item()` and `accelerator.log(...)` every step, and at the last
epoch a `DDPMPipeline` preview with EMA weights written to tensorboard and
`pipeline.save_pretrained`.

Where it differs from the script (and only there):
- Data: a map-style `torch.utils.data.Dataset` over the image files of
  `--train_data_dir` (sorted, recursive) instead of
  `load_dataset("imagefolder")` + `set_transform`: same `DataLoader(batch_size,
  shuffle=True, num_workers)`, same per-image work (PIL decode,
  `convert("RGB")`, resize of the short side with bilinear filtering, center or
  random crop, optional random flip, to float CHW in [0, 1], normalize with
  mean 0.5 and std 0.5), written with PIL + numpy instead of torchvision
  transforms. `datasets` reads encoded bytes from an Arrow cache, this reads
  them from the files, as gentrain does.
- Checkpoints: `accelerator.save_state` every `--checkpointing_steps` without
  the script's custom save/load hooks (the benchmark never reaches a
  checkpoint step; resuming is not implemented).
- Dropped options the benchmark does not use: `--dataset_name`,
  `--push_to_hub`, wandb, xformers, `--preserve_input_precision`,
  `--prediction_type sample`, `--resume_from_checkpoint`.
"""

from __future__ import annotations

import argparse
import math
import os
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator, InitProcessGroupKwargs
from accelerate.utils import ProjectConfiguration
from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
from PIL import Image
from tqdm.auto import tqdm

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The upstream script's options that the training step depends on, with its defaults."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train_data_dir", required=True)
    p.add_argument("--output_dir", default="ddpm-model-64")
    p.add_argument("--resolution", type=int, default=64)
    p.add_argument("--center_crop", action="store_true")
    p.add_argument("--random_flip", action="store_true")
    p.add_argument("--train_batch_size", type=int, default=16)
    p.add_argument("--eval_batch_size", type=int, default=16)
    p.add_argument("--dataloader_num_workers", type=int, default=0)
    p.add_argument("--num_epochs", type=int, default=100)
    p.add_argument("--save_images_epochs", type=int, default=10)
    p.add_argument("--save_model_epochs", type=int, default=10)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--lr_scheduler", default="cosine")
    p.add_argument("--lr_warmup_steps", type=int, default=500)
    p.add_argument("--adam_beta1", type=float, default=0.95)
    p.add_argument("--adam_beta2", type=float, default=0.999)
    p.add_argument("--adam_weight_decay", type=float, default=1e-6)
    p.add_argument("--adam_epsilon", type=float, default=1e-08)
    p.add_argument("--use_ema", action="store_true")
    p.add_argument("--ema_inv_gamma", type=float, default=1.0)
    p.add_argument("--ema_power", type=float, default=3 / 4)
    p.add_argument("--ema_max_decay", type=float, default=0.9999)
    p.add_argument("--logger", default="tensorboard", choices=["tensorboard"])
    p.add_argument("--logging_dir", default="logs")
    p.add_argument("--mixed_precision", default="no", choices=["no", "fp16", "bf16"])
    p.add_argument("--ddpm_num_steps", type=int, default=1000)
    p.add_argument("--ddpm_num_inference_steps", type=int, default=1000)
    p.add_argument("--ddpm_beta_schedule", default="linear")
    p.add_argument("--checkpointing_steps", type=int, default=500)
    p.add_argument("--model_config_name_or_path", default=None)
    return p.parse_args(argv)


def _to_normalized_tensor(im: Image.Image) -> torch.Tensor:
    """ToTensor() then Normalize([0.5], [0.5]): uint8 HWC -> float CHW in [-1, 1]."""
    arr = np.asarray(im, dtype=np.uint8)
    x = torch.from_numpy(arr).permute(2, 0, 1).float().div(255)
    return (x - 0.5) / 0.5


class ImageFiles(torch.utils.data.Dataset):
    """The script's `imagefolder` dataset with its `transform_images` applied per item."""

    def __init__(self, root: str, resolution: int, center_crop: bool, random_flip: bool):
        self.files = sorted(p for p in Path(root).rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS)
        if not self.files:
            raise FileNotFoundError(f"no images below {root}")
        self.resolution = resolution
        self.center_crop = center_crop
        self.random_flip = random_flip

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        size = self.resolution
        with Image.open(self.files[i]) as im:
            im = im.convert("RGB")
        w, h = im.size
        # Resize(size, BILINEAR): the short side becomes `size` (torchvision rounds down the long side).
        if w <= h:
            nw, nh = size, int(size * h / w)
        else:
            nw, nh = int(size * w / h), size
        if (nw, nh) != (w, h):
            im = im.resize((nw, nh), Image.Resampling.BILINEAR)
        if self.center_crop:  # CenterCrop(size)
            left, top = int(round((nw - size) / 2.0)), int(round((nh - size) / 2.0))
        else:  # RandomCrop(size), drawn from the global torch RNG as torchvision does
            top = int(torch.randint(0, nh - size + 1, (1,)))
            left = int(torch.randint(0, nw - size + 1, (1,)))
        im = im.crop((left, top, left + size, top + size))
        if self.random_flip and torch.rand(1) < 0.5:  # RandomHorizontalFlip(p=0.5)
            im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return {"input": _to_normalized_tensor(im)}


def main(args: argparse.Namespace) -> None:
    logging_dir = os.path.join(args.output_dir, args.logging_dir)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        log_with=args.logger,
        project_config=ProjectConfiguration(project_dir=args.output_dir, logging_dir=logging_dir),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=7200))],
    )
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)

    if args.model_config_name_or_path is None:
        raise SystemExit("--model_config_name_or_path is required (the benchmark's UNet config)")
    model = UNet2DModel.from_config(UNet2DModel.load_config(args.model_config_name_or_path))
    if args.use_ema:
        ema_model = EMAModel(
            model.parameters(),
            decay=args.ema_max_decay,
            use_ema_warmup=True,
            inv_gamma=args.ema_inv_gamma,
            power=args.ema_power,
            model_cls=UNet2DModel,
            model_config=model.config,
        )
    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(accelerator.mixed_precision, torch.float32)
    noise_scheduler = DDPMScheduler(
        num_train_timesteps=args.ddpm_num_steps, beta_schedule=args.ddpm_beta_schedule, prediction_type="epsilon"
    )
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        weight_decay=args.adam_weight_decay,
        eps=args.adam_epsilon,
    )
    dataset = ImageFiles(args.train_data_dir, args.resolution, args.center_crop, args.random_flip)
    train_dataloader = torch.utils.data.DataLoader(
        dataset, batch_size=args.train_batch_size, shuffle=True, num_workers=args.dataloader_num_workers
    )
    lr_scheduler = get_scheduler(
        args.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=args.lr_warmup_steps * args.gradient_accumulation_steps,
        num_training_steps=(len(train_dataloader) * args.num_epochs),
    )
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler
    )
    if args.use_ema:
        ema_model.to(accelerator.device)
    if accelerator.is_main_process:
        accelerator.init_trackers("train_unconditional")

    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    global_step = 0
    for epoch in range(args.num_epochs):
        model.train()
        progress_bar = tqdm(total=num_update_steps_per_epoch, disable=not accelerator.is_local_main_process)
        progress_bar.set_description(f"Epoch {epoch}")
        for batch in train_dataloader:
            clean_images = batch["input"].to(weight_dtype)
            noise = torch.randn(clean_images.shape, dtype=weight_dtype, device=clean_images.device)
            bsz = clean_images.shape[0]
            timesteps = torch.randint(
                0, noise_scheduler.config.num_train_timesteps, (bsz,), device=clean_images.device
            ).long()
            noisy_images = noise_scheduler.add_noise(clean_images, noise, timesteps)

            with accelerator.accumulate(model):
                model_output = model(noisy_images, timesteps).sample
                loss = F.mse_loss(model_output.float(), noise.float())
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

            if accelerator.sync_gradients:
                if args.use_ema:
                    ema_model.step(model.parameters())
                progress_bar.update(1)
                global_step += 1
                if accelerator.is_main_process and global_step % args.checkpointing_steps == 0:
                    accelerator.save_state(os.path.join(args.output_dir, f"checkpoint-{global_step}"))

            logs = {"loss": loss.detach().item(), "lr": lr_scheduler.get_last_lr()[0], "step": global_step}
            if args.use_ema:
                logs["ema_decay"] = ema_model.cur_decay_value
            progress_bar.set_postfix(**logs)
            accelerator.log(logs, step=global_step)
        progress_bar.close()
        accelerator.wait_for_everyone()

        if accelerator.is_main_process:
            last = epoch == args.num_epochs - 1
            if epoch % args.save_images_epochs == 0 or last:
                unet = accelerator.unwrap_model(model)
                if args.use_ema:
                    ema_model.store(unet.parameters())
                    ema_model.copy_to(unet.parameters())
                pipeline = DDPMPipeline(unet=unet, scheduler=noise_scheduler)
                generator = torch.Generator(device=pipeline.device).manual_seed(0)
                images = pipeline(
                    generator=generator,
                    batch_size=args.eval_batch_size,
                    num_inference_steps=args.ddpm_num_inference_steps,
                    output_type="np",
                ).images
                if args.use_ema:
                    ema_model.restore(unet.parameters())
                images_processed = (images * 255).round().astype("uint8")
                tracker = accelerator.get_tracker("tensorboard", unwrap=True)
                tracker.add_images("test_samples", images_processed.transpose(0, 3, 1, 2), epoch)
            if epoch % args.save_model_epochs == 0 or last:
                unet = accelerator.unwrap_model(model)
                if args.use_ema:
                    ema_model.store(unet.parameters())
                    ema_model.copy_to(unet.parameters())
                DDPMPipeline(unet=unet, scheduler=noise_scheduler).save_pretrained(args.output_dir)
                if args.use_ema:
                    ema_model.restore(unet.parameters())
    accelerator.end_training()


if __name__ == "__main__":
    main(parse_args())
