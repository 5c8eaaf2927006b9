"""Command line: argument parsing and dispatch only (`gentrain ...` and `python -m trainer ...`).

Only what parsing and the config need is imported at the top (no torch): `gentrain presets`, `--help`
and config errors answer at once. Each command imports the layers it runs inside its function.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
from typing import Any, NoReturn

from trainer.config import preset_names, preset_summary, split_preset
from trainer.config.redact import RedactingFilter, redact, redact_text
from trainer.errors import EXIT_INVALID_CHECKPOINT, EXIT_OK, EXIT_USAGE, CheckpointError, ConfigError
from trainer.registry import load_config

log = logging.getLogger("gentrain")


_TASK_HELP = (
    "the task the checkpoint was trained with (default: the checkpoint's); needed when that is an import "
    "path (module:Class), which gentrain imports only when you name it yourself"
)
_TEXT_ENCODER_HELP = (
    "the text encoder (folder or URL) the checkpoint was trained with; needed when that is not the packaged "
    "all-MiniLM-L6-v2: loading an encoder folder runs code it names, so gentrain loads one only when you name it"
)


_MAX_JSON_DEPTH = 32  # storage options nest a few levels (config_kwargs.retries); redaction walks them


def _json_depth(value: Any) -> int:
    """How deep `value` nests (iteratively: a value nested thousands deep must not exhaust the stack)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, depth = todo.pop()
        deepest = max(deepest, depth)
        if depth <= _MAX_JSON_DEPTH:
            todo.extend(
                (x, depth + 1) for x in (v.values() if isinstance(v, dict) else v if isinstance(v, list) else ())
            )
    return deepest


def _json_object(text: str) -> dict[str, Any]:
    """A `--storage-options` value: a JSON object (fsspec takes keyword arguments), else a usage error."""
    # The text is not echoed: it may hold a credential, and argparse prints its errors unredacted.
    example = "give a JSON object of fsspec options, e.g. '{\"anon\": true}'"
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"the value is not JSON ({e}); {example}") from None
    except RecursionError:
        value = None
    if value is None or _json_depth(value) > _MAX_JSON_DEPTH:
        raise argparse.ArgumentTypeError(f"the value nests deeper than {_MAX_JSON_DEPTH} levels; {example}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"the value is a JSON {type(value).__name__}, not an object; {example}")
    return value


def _int_in(low: int, high: int):
    """An argparse type: an integer in [low, high] (a seed or count beyond 64 bits is a usage error, never an
    OverflowError in torch)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text[:40]!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text[:40]} is out of range: give an integer from {low} to {high}")
        return value

    return parse


_COUNT = _int_in(-(2**31), 2**31 - 1)  # images: the commands' own checks say what is allowed within it
_SEED = _int_in(-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gentrain",
        description="Train generative image models on a CPU, under torchrun, or on Kubernetes.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model (default preset: digits-ddpm)")
    t.add_argument("config", nargs="?", help="preset name or YAML file")
    t.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, values parsed as YAML")

    s = sub.add_parser("sample", help="sample an image grid from a checkpoint")
    s.add_argument("checkpoint", help="a checkpoint (…/step-000001200) or a checkpoint root (newest valid)")
    s.add_argument("--num", type=_COUNT, default=64)
    s.add_argument("--out", default="grid.png")
    s.add_argument("--seed", type=_SEED, default=0)
    s.add_argument(
        "--steps", type=_COUNT, default=None, help="inference steps (default: the run's sample.inference_steps)"
    )
    s.add_argument("--scheduler", choices=["ddim", "dpm"], default=None)
    s.add_argument("--guidance-scale", type=float, default=None)
    s.add_argument("--no-ema", action="store_true", help="use the raw weights instead of the EMA weights")
    s.add_argument("--class", dest="class_label", type=int, default=None, help="class-conditional: this class")
    s.add_argument("--prompt", default=None, help="text-conditioned: the caption to draw")
    s.add_argument("--embeddings", default=None, help="image-embedding-conditioned: a .npy of (D,) or (N, D)")
    s.add_argument("--stop-at-stage", type=int, default=None, help="cascade: run stages 1..K only")
    s.add_argument("--frames", type=int, default=None, help="video models: frames per clip (default: as trained)")
    s.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="token models (MaskGIT): temperature of the token draws (default: the run's model.temperature)",
    )
    s.add_argument("--batch-size", type=int, default=None, help="sample in chunks of this many (memory)")
    s.add_argument(
        "--height", type=int, default=None, help="diffusion models: pixels (one of the trained data.buckets)"
    )
    s.add_argument("--width", type=int, default=None, help="diffusion models: pixels (one of the trained data.buckets)")
    s.add_argument("--storage-options", type=_json_object, default={}, help="JSON passed to fsspec")
    s.add_argument("--task", default=None, metavar="TASK", help=_TASK_HELP)
    s.add_argument("--text-encoder", default=None, metavar="PATH_OR_URL", help=_TEXT_ENCODER_HELP)

    e = sub.add_parser("eval", help="FID/KID of a checkpoint's samples vs held-out images; writes eval-<step>.json")
    e.add_argument("checkpoint", help="a checkpoint (…/step-000001200) or a checkpoint root (newest valid)")
    # `--num-images`/`-n`: under torchrun, `--num` is refused by torchrun's own parser (an ambiguous
    # prefix of its --numa-binding, even after the script name).
    e.add_argument(
        "--num",
        "--num-images",
        "-n",
        dest="num",
        type=_COUNT,
        default=None,
        help="images generated and compared (default: eval.num); under torchrun use --num-images",
    )
    e.add_argument(
        "--features", default=None, help="digits | inception | URL of a feature net (default: eval.features)"
    )
    e.add_argument("--features-url", default=None, help="features=inception: path/URL of the Inception weights")
    e.add_argument("--steps", type=_COUNT, default=None, help="inference steps (default: eval/sample settings)")
    e.add_argument("--no-ema", action="store_true", help="use the raw weights instead of the EMA weights")
    e.add_argument(
        "--storage-options", type=_json_object, default={}, help="JSON passed to fsspec (checkpoints, and data too)"
    )
    e.add_argument(
        "--data-storage-options",
        type=_json_object,
        default=None,
        help="JSON passed to fsspec for the data when it needs other options than --storage-options",
    )
    e.add_argument("--task", default=None, metavar="TASK", help=_TASK_HELP)
    e.add_argument("--text-encoder", default=None, metavar="PATH_OR_URL", help=_TEXT_ENCODER_HELP)

    c = sub.add_parser("checkpoints", help="list, verify or consolidate checkpoints")
    csub = c.add_subparsers(dest="action", required=True)
    cl = csub.add_parser("list", help="table of the checkpoints under a root")
    cl.add_argument("root")
    cl.add_argument("--storage-options", type=_json_object, default={})
    cl.add_argument("--task", default=None, metavar="TASK", help=_TASK_HELP)
    cl.add_argument("--text-encoder", default=None, metavar="PATH_OR_URL", help=_TEXT_ENCODER_HELP)
    cl.add_argument(
        "--memory-dir",
        default="/dev/shm/gentrain",
        metavar="DIR",
        help="this node's memory tier of checkpoints (checkpoint.memory_dir; default /dev/shm/gentrain)",
    )
    cv = csub.add_parser(
        "verify",
        help="check sizes and digests of every file (every rank's shards), and that the weights fit the model "
        "the checkpoint's config builds; exit 1 when invalid",
    )
    cv.add_argument("url", help="one checkpoint, or a root (verifies the newest valid one)")
    cv.add_argument("--storage-options", type=_json_object, default={})
    cv.add_argument("--task", default=None, metavar="TASK", help=_TASK_HELP)
    cv.add_argument("--text-encoder", default=None, metavar="PATH_OR_URL", help=_TEXT_ENCODER_HELP)
    cc = csub.add_parser("consolidate", help="copy a (sharded) checkpoint as one file per part, for inference")
    cc.add_argument("url", help="one checkpoint, or a root (the newest valid one)")
    cc.add_argument("out", help="checkpoint root to write the copy under (any fsspec URL)")
    cc.add_argument("--storage-options", type=_json_object, default={}, help="JSON passed to fsspec for both")

    ce = csub.add_parser(
        "export",
        help="diffusers folders (denoisers merged, LoRA adapters alone beside them; autoencoders as "
        "AutoencoderKL or VQModel) and a model card",
    )
    ce.add_argument("url", help="one checkpoint, or a root (the newest valid one)")
    ce.add_argument(
        "out", help="folder (any fsspec URL): OUT/<folder>/ per model and, for LoRA parts, OUT/<part>-lora/"
    )
    ce.add_argument("--no-ema", action="store_true", help="export the raw weights instead of the EMA weights")
    ce.add_argument(
        "--merged",
        action="store_true",
        help="a released pipeline's fine-tune: write that whole pipeline (DiffusionPipeline.from_pretrained(OUT)), "
        "LoRA merged into what trained, the other components copied from the pinned base folder",
    )
    ce.add_argument("--storage-options", type=_json_object, default={}, help="JSON passed to fsspec for both")
    ce.add_argument("--task", default=None, metavar="TASK", help=_TASK_HELP)
    ce.add_argument("--text-encoder", default=None, metavar="PATH_OR_URL", help=_TEXT_ENCODER_HELP)

    d = sub.add_parser("data", help="pack image folders into WebDataset shards, index shards made elsewhere")
    dsub = d.add_subparsers(dest="action", required=True)
    dp = dsub.add_parser(
        "pack", help="an image folder (class subfolders, .txt or metadata.jsonl captions, .npy beside) into shards"
    )
    dp.add_argument("src", help="local image folder")
    dp.add_argument("out_url", help="output folder on any fsspec store (s3://bucket/data, gs://..., a path)")
    dp.add_argument("--samples-per-shard", type=int, required=True)
    dp.add_argument("--storage-options", type=_json_object, default={}, help="JSON passed to fsspec")
    dp.add_argument("--shuffle-seed", type=int, default=0, help="samples are written in an order permuted by it")
    dp.add_argument("--no-shuffle", action="store_true", help="write the samples in the folder's sorted order")
    dp.add_argument(
        "--caption-column",
        default="text",
        help="the caption key of metadata.jsonl records, for images without a .txt (as data.caption_column)",
    )
    di = dsub.add_parser("index", help="write the byte-offset index (and shards.json) for existing tar shards")
    di.add_argument("pattern", help="shard URL or brace pattern, e.g. s3://b/x/{00000..00099}.tar")
    di.add_argument("--storage-options", type=_json_object, default={})

    de = dsub.add_parser(
        "encode",
        help="a latent diffusion config's data through its frozen autoencoder (and text encoder) into latent "
        "shards, once; under torchrun each rank encodes its own shards; rerun to resume",
    )
    de.add_argument("config", nargs="?", help="preset name or YAML file (task ddpm with model.autoencoder)")
    de.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. data.path=...")
    de.add_argument("--out", required=True, help="output folder on any fsspec store (s3://bucket/latents, a path)")
    de.add_argument("--samples-per-shard", type=int, required=True)
    de.add_argument(
        "--dtype", choices=["float16", "float32"], default="float16", help="stored posterior (and embeddings)"
    )
    de.add_argument("--text", action="store_true", help="also store the captions' model.text embeddings")
    de.add_argument("--flip", action="store_true", help="also store the mirrored images' posteriors (data.flip)")
    de.add_argument("--batch-size", type=int, default=64, help="images per encoder call")
    de.add_argument("--shuffle-seed", type=int, default=0, help="samples are written in an order permuted by it")
    de.add_argument("--no-shuffle", action="store_true", help="write the samples in the source's order")
    de.add_argument("--storage-options", type=_json_object, default={}, help="JSON passed to fsspec for --out")
    dc = dsub.add_parser(
        "class-images",
        help="DreamBooth: draw data.class_prompt N times from model.pretrained into data.class_images, once; "
        "exact (seeds from (seed, index)), rerun to resume",
    )
    dc.add_argument("config", nargs="?", help="preset name or YAML file (e.g. sd15-dreambooth)")
    dc.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. data.class_images=...")
    dc.add_argument("--num", type=_int_in(1, 10**7), default=100, help="class images wanted (diffusers' default 100)")
    dc.add_argument("--batch-size", type=_int_in(1, 4096), default=4, help="images per pipeline call (fixed blocks)")
    r = sub.add_parser("runs", help="what a run stored about itself")
    rsub = r.add_subparsers(dest="action", required=True)
    rg = rsub.add_parser(
        "goodput", help="the run's wall time by kind and its goodput, summed over its processes (newest checkpoint)"
    )
    rg.add_argument("root", help="the run's checkpoint root (checkpoint.url)")
    rg.add_argument("--storage-options", type=_json_object, default={})

    sub.add_parser("presets", help="list the built-in presets")
    sub.add_parser(
        "launch",
        help="torchrun with gentrain's exit codes (for containers): launch TORCHRUN_ARGS -- [PRESET] [key=value ...]",
        add_help=False,
    )
    return p


# Every log line passes through it: URL credentials and the secrets of the run's config never reach a log.
_REDACT = RedactingFilter()


class _WithoutTraceback(logging.Filter):
    """A store library's log record without its traceback (the message stays)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True


_NO_TRACEBACK = _WithoutTraceback()


def _setup_logging(rank: int = 0, world_size: int = 1) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    prefix = f"[rank {rank}] " if world_size > 1 else ""
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s {prefix}%(message)s",
        datefmt="%Y-%m-%dT%H:%M:%S",
        stream=sys.stderr,
    )
    for noisy in ("fsspec", "s3fs", "gcsfs", "aiobotocore", "botocore", "urllib3", "PIL", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
        # Their errors as one line: gcsfs logs a traceback when it gives up on a store (gentrain says why).
        if _NO_TRACEBACK not in logging.getLogger(noisy).filters:
            logging.getLogger(noisy).addFilter(_NO_TRACEBACK)
    for handler in logging.getLogger().handlers:
        if _REDACT not in handler.filters:
            handler.addFilter(_REDACT)


def _open_loaded(args: argparse.Namespace, url: str, doing: str, device) -> tuple[Any, Any, Any, dict[str, Any]] | None:
    """(view, config, task, modules) of the checkpoint `url` names, reading and hashing only the files the
    command loads (the weights or EMA it uses, trainer.json; `candidate_views`): a step dir, or a root's newest
    checkpoint whose loaded files pass (one that fails is skipped with a warning, as a resume skips it).
    `checkpoints verify` keeps the full check. None after telling the user why there is none (the caller exits
    1: EXIT_INVALID_CHECKPOINT)."""
    # Imports torch: only commands that read a checkpoint get here.
    from trainer.checkpoint import CheckpointCorrupt, candidate_views
    from trainer.storage import store_errors  # fsspec (see the module doc)

    with store_errors(url, "read checkpoints from"):  # an unreachable store: one line, exit 1
        try:
            is_root, views = candidate_views(url, args.storage_options)
        except CheckpointCorrupt as e:
            _fail(f"cannot {doing} {url}: {e}")
            return None
    while True:
        with store_errors(url, "read checkpoints from"):
            view = next(views, None)
        if view is None:
            _fail(f"cannot {doing} {url}: no valid checkpoint under this root")
            return None
        try:
            with store_errors(view.url, "load"):  # a store that fails mid-read: one line, exit 1
                loaded = _load_for_inference(args, view, device)
                view.part_steps()  # trainer.json, read (and hashed) once here, where a corrupt one can be skipped
            return (view, *loaded)
        except CheckpointCorrupt as e:
            if not is_root:
                raise
            log.warning("skipping checkpoint %s: %s", view.url, e)


def _load_for_inference(args: argparse.Namespace, view, device) -> tuple[Any, Any, dict[str, Any]]:
    """(config, task, modules) of a checkpoint; the task and the text encoder its manifest names are loaded
    only when built in (packaged) or named by the user (--task, --text-encoder): either would run code.
    The config is parsed once (the view keeps it)."""
    # Imports torch: only commands that load a checkpoint get here.
    from trainer.conditioning.text import check_stored_encoders
    from trainer.runs import config_of, load_for_inference

    check_stored_encoders(config_of(view, args.task).model_cfg, args.text_encoder, f"checkpoint {view.url}")
    return load_for_inference(view, not args.no_ema, device, task_name=args.task)


def _check_steps(task, cfg, steps: int | None, scheduler: str | None) -> None:
    """`--steps` the checkpoint's sampler would refuse (more than a DDPM schedule's num_train_timesteps):
    exit 2 naming the flag, asked of the task as the config's sample.inference_steps is."""
    refusal_of = getattr(type(task), "sampling_refusal", None)
    if steps is None or refusal_of is None:
        return
    scheduler = scheduler or cfg.sample.scheduler
    refusal = refusal_of(cfg.model_cfg, steps, scheduler)
    if refusal is not None:
        raise ConfigError(
            f"--steps {steps}: this {cfg.task} checkpoint cannot sample that many steps with the {scheduler} "
            f"scheduler: {refusal}; give fewer --steps"
        )


def cmd_train(args: argparse.Namespace) -> int:
    from trainer.elastic import DistEnv  # imports torch: training needs it anyway

    env = DistEnv.from_environ()
    _setup_logging(env.rank, env.world_size)
    # argparse puts the first word in `config` even when it is a key=value override.
    cfg = load_config(*split_preset([a for a in [args.config, *args.overrides] if a]))
    _REDACT.add_secrets(cfg.to_dict())
    _check_run_outputs(cfg)  # before any work: never a run that trains for hours and fails at its first save
    # Before anything imports prometheus_client (see trainer.metrics).
    from trainer.metrics import configure_multiprocess_dir

    configure_multiprocess_dir(env, cfg.metrics.port > 0)
    from trainer.loop import Trainer  # torch and the whole engine: after the config checked out

    return Trainer(cfg, env).fit()


def _check_run_outputs(cfg) -> None:
    """Refuse (exit 2) a run whose local output folders cannot be made: run.dir, checkpoint.url and, with
    the memory tier, checkpoint.memory_dir (trainer.storage.check_output_folder)."""
    from trainer.storage import check_output_folder  # fsspec (see the module doc)

    default = " (its default: run.dir/checkpoints)" if cfg.checkpoint.url is None else ""
    check_output_folder(
        cfg.run_dir,
        f"run.dir={cfg.run_dir!r}" + (" (its default: runs/<name>)" if cfg.run.dir is None else ""),
        "set run.dir to a folder (it is made if missing), or move the file out of the way",
    )
    check_output_folder(
        cfg.checkpoint_url,
        f"checkpoint.url={cfg.checkpoint_url!r}{default}",
        "set checkpoint.url to a folder or a store URL (it is made if missing), or move the file out of the way",
    )
    if cfg.checkpoint.memory:
        check_output_folder(
            cfg.checkpoint.memory_dir,
            f"checkpoint.memory_dir={cfg.checkpoint.memory_dir!r}",
            "set checkpoint.memory_dir to a node-local folder (shared memory such as /dev/shm/gentrain)",
        )


def cmd_sample(args: argparse.Namespace) -> int:
    _setup_logging()
    import torch

    # torch-heavy layers, imported by the commands that use them (see the module doc)
    from trainer.media import contact_sheet, save_gif, save_grid, save_media, slugify
    from trainer.storage import check_output_file
    from trainer.tasks.sampling import check_request

    _REDACT.add_secrets({"storage_options": args.storage_options})
    check_output_file(
        args.out, f"--out {args.out!r}", "give the file to write, e.g. --out grid.png (its folder is made if missing)"
    )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    opened = _open_loaded(args, args.checkpoint, "sample from", device)
    if opened is None:
        return EXIT_INVALID_CHECKPOINT
    view, cfg, task, modules = opened
    # The sampling contract (trainer/tasks/sampling.py): the user's request, refused once against what this
    # checkpoint's task declares, then the run's sample.* settings for what the user left out.
    request = _request(args)
    check_request(request, task.sample_accepts(), cfg.task)
    _check_steps(task, cfg, args.steps, args.scheduler)
    s = cfg.sample
    request = request.with_defaults(
        inference_steps=s.inference_steps, scheduler=s.scheduler, guidance_scale=s.guidance_scale
    ).replace(
        part_steps=view.part_steps(),  # None for a consolidated checkpoint, which has weights only
        images=_held_out_images(cfg, args.num, args.seed) if task.samples_reconstruct else None,
    )
    images = task.sample(modules, request, device)
    if images.ndim == 4:
        written = [save_grid(images, args.out)]
    elif args.prompt is not None:  # videos of a caption: <caption>.gif beside a contact sheet at --out
        stem = os.path.splitext(args.out)[0]
        written = [save_gif(images, os.path.join(os.path.dirname(stem), f"{slugify(args.prompt)}.gif"))]
        written.append(save_grid(contact_sheet(images), f"{stem}.png", nrow=images.shape[1]))
    else:  # videos: a GIF and a contact sheet beside it
        written = save_media(images, os.path.splitext(args.out)[0])
    print(f"wrote {', '.join(written)}: {args.num} samples from {view.url} (step {view.step})")
    return EXIT_OK


def cmd_eval(args: argparse.Namespace) -> int:
    """Single process, or every rank of a torchrun job (generation and features split, statistics gathered)."""
    import torch

    # torch-heavy layers, imported by the commands that use them (see the module doc)
    from trainer.data import build_splits
    from trainer.elastic import DistEnv, init_process_group
    from trainer.eval.features import load_features
    from trainer.eval.fid import FidKid, evaluate, sample_options, write_result

    env = DistEnv.from_environ()
    _setup_logging(env.rank, env.world_size)

    _REDACT.add_secrets({"storage_options": args.storage_options, "data": args.data_storage_options})
    device = torch.device(f"cuda:{env.local_rank}" if torch.cuda.is_available() else "cpu")
    opened = _open_loaded(args, args.checkpoint, "evaluate", device)
    if opened is None:
        return EXIT_INVALID_CHECKPOINT
    view, cfg, task, modules = opened
    if args.data_storage_options is not None:
        cfg.data.storage_options = args.data_storage_options
    _set_eval_flags(cfg, args)
    _check_steps(task, cfg, args.steps, None)
    net, about = load_features(cfg.eval.features, cfg.eval.features_url, args.storage_options or None)
    if env.world_size > 1:
        init_process_group(env, "nccl" if torch.cuda.is_available() else "gloo", cfg.elastic.collective_timeout_seconds)
    train, val, _ = build_splits(cfg)
    metric = FidKid(net, cfg.eval.kid_subset_size, device)
    values = evaluate(
        task,
        modules,
        metric,
        val or train,
        cfg.eval.num,
        cfg.seed,
        sample_options(cfg),
        env.rank,
        env.world_size,
        device,
    )
    if env.rank == 0:
        result = {"step": view.step, "checkpoint": view.url, "world_size": env.world_size, **values, **about}
        url = write_result(view.reader.url, view.storage_options, view.step, result)
        print(json.dumps(result))
        print(f"fid={values['fid']:.4f} kid={values['kid']:.5f} (±{values['kid_std']:.5f}) -> {url}")
    return EXIT_OK


def _set_eval_flags(cfg, args: argparse.Namespace) -> None:
    """`eval`'s flags over the run's eval.* settings, checked as the config checks them (exit 2 naming the
    flag, the value and what is allowed)."""
    from pydantic import ValidationError

    for flag, key, value in (
        ("--num", "num", args.num),
        ("--features", "features", args.features),
        ("--features-url", "features_url", args.features_url),
        ("--steps", "inference_steps", args.steps),
    ):
        if value is None:
            continue
        try:
            setattr(cfg.eval, key, value)
        except ValidationError as e:
            why = "; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())
            raise ConfigError(
                f"{flag} {value} is not allowed: {why.lower()} (as eval.{key}); give another value"
            ) from None


def _held_out_images(cfg, num: int, seed: int):
    """`num` held-out images of the run's data (the training set when it holds none out), chosen by `seed`,
    for a task that samples by reconstructing (an autoencoder)."""
    import torch

    from trainer.data import SampleRef, build_splits, collate  # torch-heavy (see the module doc)

    train, val, _ = build_splits(cfg)
    held = val or train
    order = torch.randperm(len(held), generator=torch.Generator().manual_seed(seed))[:num].tolist()
    return collate([held[SampleRef(index=i, position=k)] for k, i in enumerate(order)])["images"]


def _request(args: argparse.Namespace):
    """What the user asked `gentrain sample` for, as a `SampleRequest`: each flag not given stays None."""
    import numpy as np
    import torch

    from trainer.tasks.sampling import SampleRequest  # only `sample` needs it (see the module doc)

    image_embeds = None
    if args.embeddings is not None:
        try:
            image_embeds = np.load(args.embeddings, allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:  # EOFError: an empty file
            raise ConfigError(f"--embeddings {args.embeddings}: not a readable .npy file ({e or 'empty'})") from None
    return SampleRequest(
        num=args.num,
        seed=args.seed,
        inference_steps=args.steps,
        scheduler=args.scheduler,
        guidance_scale=args.guidance_scale,
        labels=None if args.class_label is None else torch.full((args.num,), args.class_label, dtype=torch.long),
        prompts=None if args.prompt is None else [args.prompt] * args.num,
        image_embeds=image_embeds,
        stop_at_stage=args.stop_at_stage,
        frames=args.frames,
        temperature=args.temperature,
        batch_size=args.batch_size,
        height=args.height,
        width=args.width,
    )


def _human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _check(store, info, args: argparse.Namespace, cache: dict | None = None) -> tuple[list[str], str | None]:
    """`verify`'s and `list`'s check of one checkpoint: (problems, none if valid; why the weights were not
    checked against a model, or None). Files first (sizes, digests, structure), then whether the weights fit
    the model the checkpoint's config builds, as sampling and resuming need them to."""
    # Imports torch and the tasks: only `checkpoints list` and `verify` get here.
    from trainer.runs import fit_problems

    problems = [info.reason] if not info.valid else store.verify(info)
    if problems:
        return problems, None
    if getattr(args, "action", None) == "verify":
        from trainer.runs import verify_bases  # torch-heavy (see the module doc)

        # LoRA adapters alone: their pinned base folder must be there, unchanged (exit 2 naming it otherwise).
        for base in verify_bases(store.view(info)):
            print(f"base: {base} as pinned")
    try:
        return fit_problems(store.view(info), args.task, args.text_encoder, cache), None
    except ConfigError as e:  # no model to compare with (an import-path task without --task, no config, ...)
        return [], _REDACT.clean(str(e))
    except CheckpointError as e:
        return [str(e)], None


def _list_memory_tier(memory_dir: str, root: str) -> bool:
    """Print the memory tier's steps on this node for the run checkpointing to `root`, if it has any
    (trainer.checkpoint.memory); whether it had."""
    from trainer.checkpoint.memory import memory_root, scan  # torch-heavy (see the module doc)

    folder = memory_root(memory_dir, root)
    pieces = scan(folder) if os.path.isdir(folder) else {}
    if not pieces:
        return False
    print(f"memory tier on this node ({folder}):")
    print(f"{'step':>10}  {'pieces here':<24}  {'size':>9}  status")
    for step, held in sorted(pieces.items(), reverse=True):
        first = next(iter(held.values()))
        needed = first.world_size if first.sharded else 1
        size = sum(e.bytes for doc in held.values() for e in doc.files.values())
        ranks = ",".join(str(o) for o in sorted(held)) if first.sharded else "whole state"
        status = "complete here" if len(held) == needed else f"{len(held)} of {needed} ranks' pieces here"
        print(f"{step:>10}  {ranks:<24}  {_human_bytes(size):>9}  {status}")
    return True


def _list_checkpoints(args: argparse.Namespace, store) -> int:
    """`checkpoints list`: the memory tier's steps on this node, then the durable tier's, each checked."""
    infos = store.list()
    both = _list_memory_tier(args.memory_dir, args.root)
    if not infos:
        print(f"no checkpoints under {args.root}")
        return EXIT_OK
    if both:
        print(f"durable tier ({args.root}):")
    hint = store.latest_hint()
    print(f"{'step':>10}  {'time (UTC)':<25}  {'size':>9}  status")
    unchecked, shapes = [], {}  # the model of each config is built once for the whole root
    for i in infos:
        # The same check as `verify` (digests, structure, fit to the model), so the two always agree.
        problems, skipped = _check(store, i, args, shapes)
        status = "valid" if not problems else f"INVALID: {'; '.join(problems)}"
        if i.step == hint:
            status += " (LATEST)"
        print(f"{i.step:>10}  {i.time_utc or '-':<25}  {_human_bytes(i.total_bytes):>9}  {status}")
        if skipped:
            unchecked.append(f"step {i.step}: weights not checked against a model: {skipped}")
    for line in unchecked:
        print(line)
    return EXIT_OK


def cmd_checkpoints(args: argparse.Namespace) -> int:
    _setup_logging()
    # torch-heavy (see the module doc)
    from trainer.checkpoint import CheckpointReader, InvalidCheckpoint, resolve_checkpoint

    if args.action == "list":
        from trainer.storage import store_errors  # fsspec (see the module doc)

        with store_errors(args.root, "list checkpoints in"):  # an unreachable store: one line, exit 1
            return _list_checkpoints(args, CheckpointReader(args.root, args.storage_options))

    if args.action == "export":
        from trainer.models.export import check_export_target  # torch-heavy (see the module doc)

        check_export_target(args.out, args.storage_options)  # before the checkpoint is read
    elif args.action == "consolidate":
        from trainer.storage import check_output_folder  # fsspec (see the module doc)

        check_output_folder(args.out, f"OUT {args.out!r}", "give a checkpoint root folder (it is made if missing)")
    if args.action == "export":  # reads (and hashes) only the weights it exports: `_open_loaded`
        import torch  # torch-heavy (see the module doc)

        opened = _open_loaded(args, args.url, "export", torch.device("cpu"))
        return EXIT_INVALID_CHECKPOINT if opened is None else _export(args, *opened)
    from trainer.storage import store_errors  # fsspec (see the module doc)

    try:
        with store_errors(args.url, "read checkpoints from"):  # an unreachable store: one line, exit 1
            view = resolve_checkpoint(args.url, args.storage_options)
    except InvalidCheckpoint as e:  # the step dir URL names is not valid
        if args.action == "consolidate":
            print(_REDACT.clean(f"INVALID: {e}"), file=sys.stderr)
        else:
            print(f"INVALID: {e.info.url}\n  {e.info.reason}")
        return EXIT_INVALID_CHECKPOINT
    if view is None:
        print(f"INVALID: no valid checkpoint under {args.url}")
        return EXIT_INVALID_CHECKPOINT
    if args.action == "consolidate":
        from trainer.runs import consolidate  # torch-heavy (see the module doc)

        copy = consolidate(view, args.out, args.storage_options)
        print(
            f"wrote {copy.url}: {len(copy.file_names)} files, "
            f"{_human_bytes(copy.total_bytes)}, from {view.url} (world size {view.world_size})"
        )
        return EXIT_OK
    problems, skipped = _check(view.reader, view.info, args)
    if problems:
        print(f"INVALID: {view.url}")
        for p in problems:
            print(f"  {p}")
        return EXIT_INVALID_CHECKPOINT
    fit = "weights fit the model" if skipped is None else "weights not checked against a model"
    print(
        f"valid: {view.url} (step {view.step}, {len(view.file_names)} files, {_human_bytes(view.total_bytes)}, "
        f"{'+'.join(view.digest_algorithms)} checked, {fit})"
    )
    if skipped is not None:
        print(f"  weights not checked against a model: {skipped}")
    return EXIT_OK


def _export(args: argparse.Namespace, view, cfg, task, modules: dict[str, Any]) -> int:
    """Diffusers folders of the checkpoint's model (the task's `export`), a model card, and model_index.json
    when a diffusers pipeline runs the model (trainer/models/export.py)."""
    from trainer.models.export import merged_pipeline, model_card, write_export  # torch-heavy (see the module doc)

    _REDACT.add_secrets({"storage_options": args.storage_options, "config": cfg.to_dict()})
    # The digits' labels are their digits; other sources' class names are not in the checkpoint.
    names = [str(i) for i in range(10)] if cfg.data.source == "digits" else None
    export = task.export(modules, cfg.sample, names)
    base = view.inputs.get("pipeline") if args.merged else None
    if args.merged:
        export = merged_pipeline(export, base, args.storage_options)
    out = args.out.rstrip("/")
    parts = {export.parts.get(folder, folder) for folder in export.models}
    digests = view.whole_file_digests(parts, use_ema=not args.no_ema)
    card = model_card(
        export,
        task=cfg.task,
        step=view.step,
        use_ema=not args.no_ema,
        checkpoint_url=redact_text(view.url),
        digests=digests,
        config=redact(cfg.to_dict()),
    )
    about = {"step": view.step, "checkpoint": redact_text(view.url), "weights": "online" if args.no_ema else "ema"}
    try:
        written = write_export(export, out, _REDACT.clean(card), args.storage_options, about, base=base)
    except OSError as e:  # the store failed part way (a full disk, a lost connection, a failpoint)
        _fail(
            f"export to {out} failed while writing ({e}); it holds no model_index.json and no model card now "
            f"(gentrain-export.json says complete: false), so nothing loads it as an export: run it again"
        )
        return EXIT_INVALID_CHECKPOINT
    for url in written:
        print(_REDACT.clean(f"wrote {url}"))
    if export.pipeline:
        how = f"a diffusers {export.pipeline}: DiffusionPipeline.from_pretrained({out!r})"
    else:
        how = f"diffusers folders without model_index.json: {export.reason}"
    print(
        _REDACT.clean(f"exported {view.url} (step {view.step}, {'online' if args.no_ema else 'EMA'} weights) to {out}")
    )
    print(_REDACT.clean(f"  {how} (see {out}/README.md)"))
    return EXIT_OK


def cmd_data(args: argparse.Namespace) -> int:
    if args.action == "encode":
        return cmd_data_encode(args)
    if args.action == "class-images":
        return cmd_data_class_images(args)
    _setup_logging()
    from trainer.data.pack import index_shards, pack_folder  # torch-heavy (see the module doc)

    progress = sys.stderr.isatty()
    if args.action == "pack":
        from trainer.storage import check_output_folder  # fsspec (see the module doc)

        check_output_folder(args.out_url, f"OUT_URL {args.out_url!r}", "give a folder for the shards")
        seed = None if args.no_shuffle else args.shuffle_seed
        summary = pack_folder(
            args.src, args.out_url, args.samples_per_shard, args.storage_options, progress, seed, args.caption_column
        )
        print(f"packed {args.src} into {args.out_url}: {summary.line()}")
    else:
        summary = index_shards(args.pattern, args.storage_options, progress)
        print(f"indexed {args.pattern}: {summary.line()}")
    return EXIT_OK


def cmd_data_encode(args: argparse.Namespace) -> int:
    """`gentrain data encode`: this process's shards (rank r of W under torchrun: shards r, r + W, ...)."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    _setup_logging(rank, world)
    cfg = load_config(*split_preset([a for a in [args.config, *args.overrides] if a]))
    _REDACT.add_secrets({**cfg.to_dict(), "storage_options": args.storage_options})
    from trainer.storage import check_output_folder  # fsspec (see the module doc)

    # Before the autoencoder is loaded or an image encoded: a file, a path under a file or a folder this
    # user cannot write in is a usage error, not a traceback at the first shard.
    check_output_folder(args.out, f"--out {args.out!r}", "give a folder for the latent shards (it is made if missing)")
    from trainer.encode import encode_dataset  # torch-heavy (see the module doc)

    summary = encode_dataset(
        cfg,
        args.out,
        args.samples_per_shard,
        storage_options=args.storage_options,
        dtype=args.dtype,
        text=args.text,
        flip=args.flip,
        batch_size=args.batch_size,
        shuffle_seed=None if args.no_shuffle else args.shuffle_seed,
        rank=rank,
        world_size=world,
        progress=sys.stderr.isatty(),
    )
    print(f"encoded into {args.out} (rank {rank} of {world}): {summary.line()}")
    return EXIT_OK


def cmd_data_class_images(args: argparse.Namespace) -> int:
    """`gentrain data class-images`: DreamBooth's class images from the base pipeline (trainer.class_images)."""
    _setup_logging()
    cfg = load_config(*split_preset([a for a in [args.config, *args.overrides] if a]))
    _REDACT.add_secrets(cfg.to_dict())
    from trainer.class_images import generate_class_images  # torch and diffusers (see the module doc)

    summary = generate_class_images(cfg, args.num, args.batch_size)
    print(f"class images: {summary.line()}")
    return EXIT_OK


def cmd_presets(args: argparse.Namespace) -> int:
    for name in preset_names():
        print(f"{name:<20} {preset_summary(name)}")
    return EXIT_OK


def cmd_runs(args: argparse.Namespace) -> int:
    """`runs goodput ROOT`: the time accounting the run keeps in its newest checkpoint (trainer.engine.goodput)."""
    _setup_logging()
    from trainer.checkpoint import CheckpointReader  # torch-heavy (see the module doc)
    from trainer.engine.goodput import parse_record, table
    from trainer.storage import store_errors

    with store_errors(args.root, "read the run in"):  # an unreachable store: one line, exit 1
        reader = CheckpointReader(args.root, args.storage_options)
        info = reader.latest_valid()
        if info is None:
            raise ConfigError(
                f"{args.root} holds no valid checkpoint, so no time accounting: give a run's checkpoint root "
                "(its checkpoint.url) once it has saved a checkpoint"
            )
        view = reader.view(info)
        progress = view.trainer_state().progress
    record = parse_record(progress.goodput)
    if record is None:
        raise ConfigError(
            f"{info.url} holds no time accounting (written by a gentrain that did not keep it): resume the run "
            "with this gentrain and it is kept from then on"
        )
    print(f"run {view.run or '-'} at step {info.step} ({info.url}; time up to that checkpoint's save):")
    print(table(record["seconds"], record["processes"], record["failures"]))
    return EXIT_OK


def cmd_launch(argv: list[str]) -> int:
    _setup_logging()
    from trainer.launch import launch  # torch-heavy (see the module doc)

    return launch(argv)


def _fail(message: str) -> None:
    """One `gentrain: ...` line on stderr, through the same redaction as every log line."""
    print(f"gentrain: {_REDACT.clean(message)}", file=sys.stderr)


def run() -> NoReturn:
    """The `gentrain` command and `python -m trainer`: main(), then the process's exit.

    Before exiting, every object there is is frozen out of the garbage collector (gc.freeze): the
    interpreter's exit runs full collections that walk every object of torch, torch's compiler and
    diffusers once more, 0.9 s of a run's exit here (0.16 s frozen) and each torchrun worker's too,
    for cycles that the process's end frees anyway. Files, logs and checkpoints are closed by then,
    and atexit handlers still run."""
    code = main()
    gc.freeze()
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"]:
        # torchrun's own flags follow: not for argparse to interpret.
        try:
            return cmd_launch(argv[1:])
        except ConfigError as e:
            _fail(f"config error: {e}")
            return EXIT_USAGE
    args = _parser().parse_args(argv)
    handlers: dict[str, Any] = {
        "train": cmd_train,
        "sample": cmd_sample,
        "checkpoints": cmd_checkpoints,
        "runs": cmd_runs,
        "presets": cmd_presets,
        "data": cmd_data,
        "eval": cmd_eval,
    }
    try:
        return handlers[args.command](args)
    except ConfigError as e:  # its kinds say what they are (a store error, a crash loop)
        _fail(f"{e.label}: {e}")
        return EXIT_USAGE
    except CheckpointError as e:  # a checkpoint that cannot be read (training falls back past these itself)
        _fail(f"checkpoint error: {e}")
        return EXIT_INVALID_CHECKPOINT
    except KeyboardInterrupt:
        return 130
    finally:
        sys.stderr.flush()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
