"""What gentrain does with the `ACCELERATE_*` environment that `accelerate launch` (or a user) sets.

gentrain builds accelerate's `Accelerator` for trackers and DDP only; the engine owns precision
(`train.precision`: its own autocast and one loss scaler per part), accumulation (`train.grad_accum`),
compilation (none) and sharding (`train.parallel`). accelerate reads several of those from the
environment whenever its constructor is not told, so `trainer.engine.runtime` tells it every one
(`accelerator_kwargs`), and this module sorts the variables accelerate would still act on:

- ignored (gentrain passes its own value; a warning names the variable and the key that decides):
  `ACCELERATE_MIXED_PRECISION`, `ACCELERATE_GRADIENT_ACCUMULATION_STEPS`, `ACCELERATE_DYNAMO_*`;
- refused (exit 2 before any set-up): the plugins accelerate would wrap the parts with instead of
  gentrain's DDP or FSDP2 (`ACCELERATE_USE_FSDP`, `..._DEEPSPEED`, `..._MEGATRON_LM`,
  `..._PARALLELISM_CONFIG`, `..._SAGEMAKER`), a device chosen behind gentrain's back
  (`ACCELERATE_TORCH_DEVICE`), and `ACCELERATE_USE_CPU` on a machine with CUDA (gentrain would join an
  NCCL process group with CPU tensors), and an MPI launch (`mpirun`, accelerate's multi-CPU mode)
  without torchrun's `WORLD_SIZE`.

Torch-free, so `gentrain launch` refuses before starting any worker.
"""

from __future__ import annotations

from collections.abc import Mapping

from trainer.errors import ConfigError

# accelerate turns these on with "true" (its plugins) or any of its str_to_bool spellings (flags).
_TRUE = {"1", "true", "t", "yes", "y", "on"}

# Variable -> what accelerate would do with it instead of gentrain.
REFUSED_PLUGINS = {
    "ACCELERATE_USE_FSDP": "wrap the parts in accelerate's FSDP plugin (gentrain shards with train.parallel=fsdp)",
    "ACCELERATE_USE_DEEPSPEED": "hand the parts to DeepSpeed, which gentrain does not use",
    "ACCELERATE_USE_MEGATRON_LM": "hand the parts to Megatron-LM, which gentrain does not use",
    "ACCELERATE_USE_PARALLELISM_CONFIG": "build its own device mesh (gentrain uses data parallelism only)",
    "ACCELERATE_USE_SAGEMAKER": "use SageMaker's data parallel backend",
}

# Variable -> (the value accelerate gets explicitly instead, what decides in gentrain).
IGNORED = {
    "ACCELERATE_MIXED_PRECISION": ("no", "train.precision decides, with the engine's own autocast"),
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": ("1", "train.grad_accum decides"),
    "ACCELERATE_DYNAMO_BACKEND": ("no", "gentrain does not compile the parts"),
}

# MPI launchers' world sizes (accelerate's multi-CPU mode runs under mpirun and reads these).
MPI_WORLD_SIZES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")

FIX = "launch with torchrun or gentrain launch, or unset them"


def _on(value: str | None) -> bool:
    return value is not None and value.strip().lower() in _TRUE


def check_accelerate_env(environ: Mapping[str, str], cuda: bool) -> list[str]:
    """ConfigError (exit 2) naming every variable gentrain cannot honour; otherwise one warning per
    variable that is set to something other than gentrain's value and is ignored."""
    refused = [
        f"{k}={environ[k]} (accelerate would {why})" for k, why in REFUSED_PLUGINS.items() if _on(environ.get(k))
    ]
    if environ.get("ACCELERATE_TORCH_DEVICE"):
        refused.append(
            f"ACCELERATE_TORCH_DEVICE={environ['ACCELERATE_TORCH_DEVICE']} (gentrain picks the device: "
            "CUDA's local rank when there is one, else the CPU)"
        )
    if cuda and _on(environ.get("ACCELERATE_USE_CPU")):
        refused.append(
            f"ACCELERATE_USE_CPU={environ['ACCELERATE_USE_CPU']} on a machine with CUDA (gentrain trains on "
            "the GPUs there; hide them with CUDA_VISIBLE_DEVICES= to train on the CPU)"
        )
    if "WORLD_SIZE" not in environ:
        mpi = [f"{k}={environ[k]}" for k in MPI_WORLD_SIZES if environ.get(k, "1").strip() not in ("", "1")]
        if mpi:
            refused.append(
                f"{', '.join(mpi)} without WORLD_SIZE (an MPI launch, e.g. accelerate's multi-CPU mode: gentrain "
                "reads torchrun's RANK/WORLD_SIZE, so every process would train alone)"
            )
    if refused:
        raise ConfigError(
            f"accelerate settings in the environment that gentrain does not use: {'; '.join(refused)}. "
            f"gentrain builds its own DDP or FSDP2 (train.parallel) and precision (train.precision): {FIX}"
        )
    warnings = []
    for key, (value, decides) in IGNORED.items():
        got = environ.get(key)
        if got is not None and got.strip().lower() != value:
            warnings.append(f"{key}={got} is ignored (accelerate gets {value}: {decides})")
    return warnings
