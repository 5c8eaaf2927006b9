"""TorchX component for gentrain: `torchx run -s kubernetes gentrain.train ...` once gentrain is installed
with the `torchx` extra (the `torchx.components` entry point), or `components/train.py:train` from a checkout
(a link to this file). Nothing of gentrain is imported: the submitting machine needs only TorchX.

Built on TorchX's own `dist.ddp` (its rendezvous arguments: c10d on replica 0, or etcd-v2 on
an etcd outside the job with `--rdzv_backend etcd-v2 --rdzv_endpoint HOST:2379`), but every
node runs `python -m trainer launch TORCHRUN_ARGS -- [PRESET] [key=value ...]` instead of
raw torchrun, so the contract's exit codes hold (docs/contract.md): a config error exits 2 on
every node before any worker starts and is never retried (not by torchrun, and not by
Volcano: see `install_volcano_exit_code_policies`), SIGTERM ends in 143 after an emergency
checkpoint, anything else is retried. It also adds torchrun restarts, the Prometheus port,
the checkpoint URL as GENTRAIN_* environment and a real memory request (TorchX's
kubernetes scheduler requests memMB minus 1024 MB, so its 1024 MB default becomes 0 MB).
"""

# TorchX 0.7's component linter reads annotations with `ast` and knows only
# typing's Optional/Dict/List, so no PEP 604 unions here.
import functools
import shlex
import warnings
from typing import Any, Dict, List, Optional  # noqa: UP035

import torchx.specs as specs
from torchx.components.dist import ddp

DEFAULT_IMAGE = "ghcr.io/gentrain/gentrain:0.1.0"
DEFAULT_PRESET = "digits-ddpm"
EXIT_USAGE = 2  # trainer.elastic.EXIT_USAGE; the submitting machine may not have gentrain installed
# AppDef metadata naming the exit codes after which the scheduler must not retry.
NO_RETRY_EXIT_CODES = "gentrain/no-retry-exit-codes"


def split_script_args(script_args: List[str], preset: Optional[str]) -> List[str]:
    """[PRESET_OR_YAML] [key=value ...] as `gentrain train` takes them, with `--preset` as the other spelling."""
    args = list(script_args)
    if args and "=" not in args[0]:
        if preset and preset != args[0]:
            raise ValueError(f"preset given twice: --preset {preset} and {args[0]!r} after `--`; keep one")
        preset, args = args[0], args[1:]
    bad = [a for a in args if "=" not in a or a.startswith("=")]
    if bad:
        raise ValueError(
            f"after `--` give [PRESET_OR_YAML] [key=value ...] like `gentrain train`; not key=value: {bad}"
        )
    return [preset or DEFAULT_PRESET, *args]


RDZV_BACKENDS = ("c10d", "etcd-v2")


def check_rendezvous(backend: str, endpoint: Optional[str]) -> None:
    """c10d finds its store on replica 0 by itself; etcd-v2 needs the etcd's address."""
    if backend not in RDZV_BACKENDS:
        raise ValueError(f"--rdzv_backend {backend!r}: use one of {', '.join(RDZV_BACKENDS)}")
    if backend == "etcd-v2" and not endpoint:
        raise ValueError("--rdzv_backend etcd-v2 needs --rdzv_endpoint HOST:PORT of the etcd, e.g. gentrain-etcd:2379")
    if backend == "c10d" and endpoint:
        raise ValueError("--rdzv_endpoint is for etcd-v2; c10d's store is on replica 0 (--rdzv_port sets its port)")


def replace_rdzv_endpoint(torchrun_args: str, endpoint: str) -> str:
    """dist.ddp's torchrun arguments with `--rdzv_endpoint` set to `endpoint` (replica 0's by default)."""
    head, flag, rest = torchrun_args.partition("--rdzv_endpoint ")
    if not flag:
        raise ValueError(f"unexpected dist.ddp torchrun arguments: {torchrun_args!r}")
    _, _, tail = rest.partition(" ")
    return f"{head}{flag}{shlex.quote(endpoint).replace('$', '$$')} {tail}"


def install_volcano_exit_code_policies() -> None:
    """Make TorchX's Volcano Jobs stop, not restart, on the exit codes an app lists in its metadata.

    TorchX 0.7 gives every Volcano task the fixed policies [PodEvicted -> RestartJob,
    PodFailed -> RestartJob] and has no option for exit codes. Volcano matches a task's
    policies in order, and a pod that failed carries both the PodFailed event and its exit
    code, so `{exitCode: 2, action: TerminateJob}` placed first wins for a config error
    (TorchX reports the Terminated job as FAILED) while any other failure still restarts
    the job. Only apps that carry NO_RETRY_EXIT_CODES in their metadata are changed; the
    patch is idempotent and lives in the process that runs `torchx run`.
    """
    try:
        from torchx.schedulers import kubernetes_scheduler as ks
    except ImportError:  # no kubernetes client: nothing will build a Volcano Job here
        return
    # Private: TorchX's module-level Volcano Job builder. TorchX has no public hook for task policies;
    # guarded by tests/test_private_apis.py::test_torchx_kubernetes_scheduler_builds_volcano_jobs_through_app_to_resource.
    build = getattr(ks, "app_to_resource", None)
    if build is None:  # another TorchX: jobs still run, config errors are retried (k8s/README.md)
        warnings.warn(
            "torchx's kubernetes scheduler has no app_to_resource: Volcano will retry exit code 2", stacklevel=2
        )
        return
    if getattr(build, "_gentrain_exit_codes", False):
        return

    @functools.wraps(build)
    def app_to_resource(app: specs.AppDef, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        resource = build(app, *args, **kwargs)
        codes = [int(c) for c in app.metadata.get(NO_RETRY_EXIT_CODES, "").split(",") if c]
        if not codes:  # not built by this component: as TorchX made it
            return resource
        for task in resource["spec"]["tasks"]:
            first = [{"exitCode": c, "action": "TerminateJob"} for c in codes]
            task["policies"] = [*first, *task.get("policies", [])]
        return resource

    app_to_resource._gentrain_exit_codes = True  # type: ignore[attr-defined]
    ks.app_to_resource = app_to_resource


def train(
    *script_args: str,
    preset: Optional[str] = None,
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
    rdzv_backend: str = "c10d",
    rdzv_endpoint: Optional[str] = None,
    env: Optional[Dict[str, str]] = None,
    mounts: Optional[List[str]] = None,
) -> specs.AppDef:
    """Train a gentrain model with torchrun on one or more nodes; resumes by itself after preemption.

    Args:
        script_args: what `gentrain train` takes: [PRESET_OR_YAML] [key=value ...], e.g. digits-ddpm train.max_steps=5000
        preset: built-in preset name or a YAML path inside the image, when not given first after `--` (default digits-ddpm)
        image: container image with gentrain installed (see the Dockerfile); pin a tag, never :latest
        name: job name, also the torchrun rendezvous id
        j: [{min_nnodes}:]{nnodes}x{nproc_per_node}; 1:4x8 is elastic between 1 and 4 nodes of 8 processes
        gpu: GPUs per node (replica); 0 trains on CPU with gloo
        cpu: CPUs per node
        memMB: memory per node in MB; the request is memMB - 1024, so keep it well above 1024
        h: a TorchX named resource; when set it replaces cpu, gpu and memMB
        max_retries: scheduler retries of the whole job (Volcano RestartJob on pod failure or eviction; never after exit code 2)
        max_restarts: torchrun restarts of the worker group inside a node before the pod fails (never after exit code 2)
        checkpoint_url: fsspec URL for checkpoints (s3://, gs://, or a shared volume path); sets GENTRAIN_CHECKPOINT__URL
        metrics_port: Prometheus port served by local rank 0 of each node (0 = off); named `metrics` in the pod
        rdzv_port: port of the c10d rendezvous store on replica 0
        rdzv_backend: c10d (a store on replica 0: losing it stops every node until it is back) or etcd-v2 (an etcd outside the job: any node can be lost; the image needs the etcd extra)
        rdzv_endpoint: HOST:PORT of the etcd for etcd-v2, e.g. gentrain-etcd:2379 (k8s/etcd); c10d takes replica 0's
        env: extra environment, e.g. GENTRAIN_TRAIN__LR=1e-4,AWS_REGION=us-east-1
        mounts: volume mounts, e.g. type=volume,src=ckpt-pvc,dst=/checkpoints
    """
    train_args = split_script_args(list(script_args), preset)
    check_rendezvous(rdzv_backend, rdzv_endpoint)
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

    # dist.ddp builds `torchrun RDZV_ARGS -m trainer`; keep its rendezvous arguments
    # (macros and ${rank0 host} included, already quoted) and hand them to `gentrain launch`.
    app = ddp(
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
        rdzv_backend=rdzv_backend,
        mounts=mounts,
    )
    role = app.roles[0]
    command = role.args[-1]
    prefix, suffix = "torchrun ", " -m trainer"
    if not (command.startswith(prefix) and command.endswith(suffix)):
        raise ValueError(f"unexpected dist.ddp command: {command!r}")
    torchrun_args = command[len(prefix) : -len(suffix)]
    if rdzv_endpoint:
        torchrun_args = replace_rdzv_endpoint(torchrun_args, rdzv_endpoint)
        role.port_map.pop("c10d", None)  # no store on replica 0
    role.args[-1] = " ".join(
        [
            f"python -m trainer launch --max_restarts {max_restarts} {torchrun_args}",
            "--",
            # Quoted for bash; `$$` because TorchX substitutes its macros ($app_id, ...) in args.
            *(shlex.quote(a).replace("$", "$$") for a in train_args),
        ]
    )
    if metrics_port:
        role.port_map["metrics"] = metrics_port
    app.metadata[NO_RETRY_EXIT_CODES] = str(EXIT_USAGE)
    install_volcano_exit_code_policies()
    return app
