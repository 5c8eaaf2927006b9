"""TorchX component for gentrain: `torchx run -s kubernetes components/train.py:train ...`.

Built on TorchX's own `dist.ddp` (torchrun with c10d rendezvous on replica 0),
then adds what a preemptible training job needs: torchrun restarts, the
Prometheus port, the checkpoint URL as GENTRAIN_* environment and a real
memory request (TorchX's kubernetes scheduler requests memMB minus 1024 MB,
so its 1024 MB default becomes a 0 MB request).
"""

# TorchX 0.7's component linter reads annotations with `ast` and knows only
# typing's Optional/Dict/List, so no PEP 604 unions here.
from typing import Dict, List, Optional  # noqa: UP035

import torchx.specs as specs
from torchx.components.dist import ddp

DEFAULT_IMAGE = "ghcr.io/gentrain/gentrain:0.1.0"


def train(
    *script_args: str,
    preset: str = "digits-ddpm",
    image: str = DEFAULT_IMAGE,
    name: str = "gentrain",
    j: str = "1x2",
    gpu: int = 0,
    cpu: int = 4,
    memMB: int = 16384,
    h: Optional[str] = None,
    max_retries: int = 3,
    max_restarts: int = 3,
    checkpoint_url: Optional[str] = None,
    metrics_port: int = 9090,
    rdzv_port: int = 29500,
    env: Optional[Dict[str, str]] = None,
    mounts: Optional[List[str]] = None,
) -> specs.AppDef:
    """Train a gentrain model with torchrun on one or more nodes; resumes by itself after preemption.

    Args:
        script_args: config overrides passed to `gentrain train`, e.g. train.max_steps=5000 train.lr=1e-4
        preset: built-in preset name or a YAML path inside the image (`gentrain presets` lists them)
        image: container image with gentrain installed (see the Dockerfile); pin a tag, never :latest
        name: job name, also the torchrun rendezvous id
        j: [{min_nnodes}:]{nnodes}x{nproc_per_node}; 1:4x8 is elastic between 1 and 4 nodes of 8 processes
        gpu: GPUs per node (replica); 0 trains on CPU with gloo
        cpu: CPUs per node
        memMB: memory per node in MB; the request is memMB - 1024, so keep it well above 1024
        h: a TorchX named resource; when set it replaces cpu, gpu and memMB
        max_retries: scheduler retries of the whole job (Volcano RestartJob on pod failure or eviction)
        max_restarts: torchrun restarts of the worker group inside a node before the pod fails
        checkpoint_url: fsspec URL for checkpoints (s3://, gs://, or a shared volume path); sets GENTRAIN_CHECKPOINT__URL
        metrics_port: Prometheus port served by local rank 0 of each node (0 = off); named `metrics` in the pod
        rdzv_port: port of the c10d rendezvous store on replica 0
        env: extra environment, e.g. GENTRAIN_TRAIN__LR=1e-4,AWS_REGION=us-east-1
        mounts: volume mounts, e.g. type=volume,src=ckpt-pvc,dst=/checkpoints
    """
    env = dict(env or {})
    env["GENTRAIN_METRICS__PORT"] = str(metrics_port)
    if checkpoint_url:
        env["GENTRAIN_CHECKPOINT__URL"] = checkpoint_url
    # Writable places for a read-only root filesystem.
    env.setdefault("GENTRAIN_RUN__DIR", "/work/run")
    env.setdefault("PYTHONUNBUFFERED", "1")
    # A fresh worker store per rendezvous round: torchrun's shared agent store keeps
    # stale keys across restarts (see trainer.elastic.init_process_group).
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")

    app = ddp(
        "train",
        preset,
        *script_args,
        m="trainer",
        image=image,
        name=name,
        j=j,
        cpu=cpu,
        gpu=gpu,
        memMB=memMB,
        h=h,
        env=env,
        max_retries=max_retries,
        rdzv_port=rdzv_port,
        mounts=mounts,
    )
    role = app.roles[0]
    # dist.ddp has no torchrun restart option: add it to the torchrun command it built.
    command = role.args[-1]
    if not command.startswith("torchrun "):
        raise ValueError(f"unexpected dist.ddp command: {command!r}")
    role.args[-1] = command.replace("torchrun ", f"torchrun --max_restarts {max_restarts} ", 1)
    if metrics_port:
        role.port_map["metrics"] = metrics_port
    return app
