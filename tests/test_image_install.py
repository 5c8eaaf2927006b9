"""What the image installs is what is tested: a fresh venv with exactly the Dockerfile's install, every task family.

The suite runs in a venv with the `test` extra, which holds every optional package (peft among
them), so a code path that imports one without its feature being configured passes there and
dies in the image (seen: every 2-rank FSDP run, through `has_lora`, on `import peft`). This test
reads the Dockerfile (torch version, the files it copies, its install line: extras and
constraints), builds a venv the same way, and runs one short training of each task family under
DDP and FSDP with two ranks (gloo, 127.0.0.1) there, all in one torchrun launch through a small
driver that calls the CLI's entry point per run. The image now installs every feature extra
(tests/test_image_extras.py), peft included, so the driver hides peft (none of its runs configures LoRA)
to keep that path tested; every extra of the install line passes its own check in trainer/ there, and a
feature whose package is missing says which extra it needs (exit 2), never raises ImportError.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, clean_env, free_port

pytestmark = pytest.mark.slow

DOCKERFILE = REPO / "Dockerfile"

# Tiny models, as the task tests use them (tests/conftest.py, test_vqgan_maskgit.py, test_video_tasks.py).
COMMON = [
    "data.image_size=8",
    "train.batch_size=8",
    "train.warmup_steps=1",
    "train.log_every_steps=1",
    "train.val_every_steps=0",
    "train.threads=1",
    "sample.every_steps=0",
    "sample.num=2",
    "sample.inference_steps=2",
    "checkpoint.every_steps=0",
]
DDPM = ["digits-ddpm", "model.block_out_channels=[8,16]", "model.norm_num_groups=4", "model.attention=false"]
CASCADE = [str(REPO / "tests" / "cascade.yaml")]
GAN = ["model.disc_channels=8", "model.disc_layers=1", "model.disc_start_step=1", "model.grad_penalty_every=0"]
VQGAN = [
    "digits-vqgan",
    *GAN,
    "model.block_out_channels=[8,16]",
    "model.norm_num_groups=4",
    "model.codebook_size=32",
    "model.codebook_dim=4",
    "model.dead_code_threshold=0",
    "model.usage_window=4",
]
MASKGIT = ["digits-maskgit", "model.dim=16", "model.depth=1", "model.heads=2"]
VIDEO_TOKENIZER = [
    "moving-digits-tokenizer",
    *GAN,
    "data.num_frames=3",
    "model.dim=16",
    "model.heads=2",
    "model.spatial_depth=1",
    "model.temporal_depth=1",
    "model.pixel_channels=4",
    "model.quantizer=vq",
    "model.codebook_size=32",
    "model.codebook_dim=4",
]
# With its captions: the image installs the `text` extra (sentence-transformers and the shipped encoder).
VIDEO_MASKGIT = [
    "moving-digits",
    "data.num_frames=3",
    "model.dim=16",
    "model.depth=1",
    "model.heads=2",
]

# Runs inside every torchrun worker of the venv: the CLI's entry point once per run, in order.
DRIVER = """\
import json, sys
sys.modules["peft"] = None  # no run here configures LoRA, so none may import peft (has_lora under FSDP did)
import trainer
from trainer.cli import main

assert trainer.__file__.startswith(sys.prefix), f"gentrain imported from {trainer.__file__}, not the venv"
for name, argv in json.load(open(sys.argv[1])):
    code = main(argv)
    print(f"driver: {name} exited {code}", file=sys.stderr, flush=True)
    if code != 0:
        sys.exit(code)
"""


def _logical_lines(text: str) -> list[str]:
    """Instructions with their continuation lines joined; comments dropped."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    return [line.strip() for line in re.sub(r"\\\n", " ", "\n".join(lines)).splitlines() if line.strip()]


def dockerfile_install() -> tuple[str, list[str], list[tuple[list[str], str]]]:
    """(torch version, the project's pip install arguments, COPY instructions) as the Dockerfile has them."""
    lines = _logical_lines(DOCKERFILE.read_text())
    torch_version = next(m.group(1) for line in lines if (m := re.fullmatch(r"ARG TORCH_VERSION=(\S+)", line)))
    commands = [c.strip() for line in lines if line.startswith("RUN ") for c in line[4:].split("&&")]
    project = [c for c in commands if c.startswith("pip install") and re.search(r"""["']?\.\[""", c)]
    assert len(project) == 1, f"expected one `pip install ... .[extras]` in the Dockerfile, found {project}"
    args = shlex.split(project[0].replace("${TORCH_VERSION}", torch_version))[2:]
    # pip's cache and bytecode (--no-compile, see image_venv) differ from the image build: they keep this test fast.
    args = [a for a in args if a != "--no-cache-dir"]
    copies = [(words[1:-1], words[-1]) for words in (shlex.split(line) for line in lines if line.startswith("COPY "))]
    return torch_version, args, copies


def extras_of(args: list[str]) -> set[str]:
    (spec,) = [a for a in args if a.startswith(".[")]
    return set(spec[2:-1].split(","))


def test_the_dockerfile_install_line_is_parsed_as_written():
    torch_version, args, copies = dockerfile_install()
    assert re.fullmatch(r"\d+\.\d+\.\d+", torch_version)
    assert f"torch=={torch_version}" in args
    # The runtime constraints (a current urllib3), not the test environment's (TorchX's urllib3 1.26).
    assert "-c" in args and args[args.index("-c") + 1] == "constraints-runtime.txt"
    assert extras_of(args) >= {
        "s3",
        "gcs",
        "video",
        "eval",
        "etcd",
        "lowbit",
        "float8",
        "text",
        "trackers",
        "hf",
        "lora",
    }
    assert (["pyproject.toml", "constraints-runtime.txt", "README.md"], "./") in copies
    assert (["trainer"], "./trainer") in copies


def _venv_env(venv: Path) -> dict[str, str]:
    env = clean_env()
    # PYTHONDONTWRITEBYTECODE too: the venv is installed without bytecode (see image_venv), so its first
    # process caches what it compiles and the later ones read it.
    for key in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE"):
        env.pop(key, None)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{shlex.join(cmd)} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-6000:]}"
    return r


@pytest.fixture(scope="module")
def image_venv(tmp_path_factory) -> Path:
    """A fresh venv installed as the Dockerfile installs the image (torch first, then the project line)."""
    root = tmp_path_factory.mktemp("image")
    torch_version, args, copies = dockerfile_install()
    venv = root / "venv"
    env = _venv_env(venv)
    _run([sys.executable, "-m", "venv", str(venv)], root, env)
    python = str(venv / "bin" / "python")
    # Without bytecode (--no-compile), unlike the image's pip: compiling every module of torch, transformers and
    # the rest took 52 of pip's 114 s of CPU here, and the processes below import a fraction of them. They run
    # without PYTHONDONTWRITEBYTECODE (`_venv_env`), so what they import is compiled once, by the first.
    _run([python, "-m", "pip", "install", "-q", "--no-compile", f"torch=={torch_version}"], root, env)
    src = root / "src"  # the Dockerfile's WORKDIR, with what it copies there
    src.mkdir()
    for sources, dest in copies:
        for name in sources:
            target = src / dest / name if dest.endswith("/") else src / dest
            if (REPO / name).is_dir():
                shutil.copytree(REPO / name, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(REPO / name, target)
    _run([python, "-m", "pip", "install", "-q", "--no-compile", *args], src, env)
    shutil.rmtree(src)  # nothing may import gentrain from its sources
    return venv


def _train(root: Path, name: str, preset: list[str], *extra: str, max_steps: int = 1) -> tuple[str, list[str]]:
    argv = ["train", *preset, *COMMON, f"run.dir={root / name}", f"train.max_steps={max_steps}", *extra]
    return name, argv


def test_every_task_family_trains_under_ddp_and_fsdp_in_the_image_install(image_venv, tmp_path):
    runs = []
    for parallel in ("ddp", "fsdp"):
        p = f"train.parallel={parallel}"
        vqgan, video_tokenizer = tmp_path / f"vqgan-{parallel}", tmp_path / f"video-tokenizer-{parallel}"
        runs += [
            _train(tmp_path, f"ddpm-{parallel}", DDPM, p),
            _train(tmp_path, f"cascade-{parallel}", CASCADE, p),
            _train(tmp_path, vqgan.name, VQGAN, p, max_steps=2),  # step 2 trains the discriminator too
            _train(tmp_path, f"maskgit-{parallel}", MASKGIT, p, f"model.tokenizer.url={vqgan}/checkpoints"),
            _train(tmp_path, video_tokenizer.name, VIDEO_TOKENIZER, p, max_steps=2),
            _train(
                tmp_path,
                f"video-maskgit-{parallel}",
                VIDEO_MASKGIT,
                p,
                f"model.tokenizer.url={video_tokenizer}/checkpoints",
            ),
        ]
    # Half precision (the GPU presets' setting) goes through the LoRA-aware casts of every part.
    runs.append(_train(tmp_path, "ddpm-bf16-ddp", DDPM, "train.precision=bf16"))
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    (tmp_path / "driver.py").write_text(DRIVER)
    port = free_port()
    torchrun = [
        str(image_venv / "bin" / "python"),
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--max-restarts=0",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=image-{port}",
    ]
    t0 = time.monotonic()
    r = subprocess.run(
        [*torchrun, str(tmp_path / "driver.py"), str(tmp_path / "runs.json")],
        cwd=tmp_path,
        env=_venv_env(image_venv),
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = r.stdout + r.stderr
    assert r.returncode == 0, f"torchrun exited {r.returncode} after {time.monotonic() - t0:.0f}s:\n{log[-8000:]}"
    assert "ModuleNotFoundError" not in log and "ImportError" not in log, log[-8000:]
    for name, _ in runs:
        assert f"driver: {name} exited 0" in log, log[-8000:]
        assert (tmp_path / name / "checkpoints").is_dir(), name


def test_the_image_install_is_consistent_with_a_current_urllib3(image_venv, tmp_path):
    env = _venv_env(image_venv)
    python = str(image_venv / "bin" / "python")
    _run([python, "-m", "pip", "check"], tmp_path, env)
    r = _run([python, "-c", "import urllib3; print(urllib3.__version__)"], tmp_path, env)
    assert int(r.stdout.strip().split(".")[0]) >= 2, r.stdout


# Each extra of the Dockerfile's install line and the check trainer/ makes before it uses it (the one that
# exits 2 naming `gentrain[extra]` when the package is missing), run in the image's venv.
GATES = {
    "s3": "from trainer.storage import check_protocol; check_protocol('s3://bucket/key')",
    "gcs": "from trainer.storage import check_protocol; check_protocol('gs://bucket/key')",
    "video": "from trainer.data.video import import_av; import_av('the image')",
    "eval": "from trainer.eval.features import require_torchmetrics; require_torchmetrics()",
    "etcd": "from trainer.launch import check_rendezvous_backend; check_rendezvous_backend('etcd-v2')",
    "lowbit": "from trainer.optim import adamw8bit_class; adamw8bit_class()",
    "float8": "from torchao.float8 import Float8LinearConfig, convert_to_float8_training\n"
    "for recipe in ('tensorwise', 'rowwise'): Float8LinearConfig.from_recipe_name(recipe)",
    "text": "import pathlib, tempfile, sentence_transformers\n"
    "from trainer.conditioning.text import BUILTIN_ENCODER, resolve_encoder_dir\n"
    "assert (resolve_encoder_dir(BUILTIN_ENCODER, pathlib.Path(tempfile.mkdtemp())) / 'modules.json').is_file()",
    # MLflow's default store (sqlite) needs full MLflow; a run in the image points MLFLOW_TRACKING_URI at a
    # server (building the store contacts nothing).
    "trackers": "import os; os.environ['MLFLOW_TRACKING_URI'] = 'http://127.0.0.1:9'\n"
    "from trainer.config.schema import LogConfig; from trainer.engine.report import tracker_names\n"
    "assert tracker_names(LogConfig(report_to=['tensorboard', 'wandb', 'mlflow'])) == "
    "['tensorboard', 'wandb', 'mlflow']",
    "hf": "from trainer.data.hf import import_datasets; import_datasets()",
    "lora": "from peft import inject_adapter_in_model",
}


# Runs each check in a process of its own, forked from one that imported torch (what every check imports
# first): what a check imports besides is its own, as in a fresh interpreter, without paying torch's import
# eleven times.
GATE_DRIVER = """\
import json, os, sys, traceback
import torch
for extra, code in json.load(open(sys.argv[1])):
    pid = os.fork()
    if pid == 0:
        try:
            exec(compile(code, f"<the {extra} check>", "exec"), {"__name__": "__main__"})
            code = 0
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(f"check {extra} exited {os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}", flush=True)
"""


def test_every_extra_the_image_installs_passes_its_check_in_the_image_install(image_venv, tmp_path):
    _, args, _ = dockerfile_install()
    unchecked = extras_of(args) - set(GATES)
    assert not unchecked, f"no check here for the image's extras {sorted(unchecked)}"
    (tmp_path / "gates.json").write_text(json.dumps([(extra, GATES[extra]) for extra in sorted(extras_of(args))]))
    (tmp_path / "gates.py").write_text(GATE_DRIVER)
    python = str(image_venv / "bin" / "python")
    r = _run([python, str(tmp_path / "gates.py"), str(tmp_path / "gates.json")], tmp_path, _venv_env(image_venv))
    for extra in sorted(extras_of(args)):
        assert f"check {extra} exited 0\n" in r.stdout, f"the {extra} extra in the image install:\n{r.stderr[-3000:]}"


# A LoRA fine-tune in the image install, then the same run where peft cannot be imported (a core install):
# exit 2 naming the extra. Runs without adapters (the base training, the export) never import peft.
NO_PEFT = """\
import sys
sys.modules["peft"] = None  # importlib.util.find_spec and import both see no peft
from trainer.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_lora_trains_in_the_image_install_and_without_peft_exits_2_naming_the_extra(image_venv, tmp_path):
    env = _venv_env(image_venv)
    python, gentrain = str(image_venv / "bin" / "python"), str(image_venv / "bin" / "gentrain")
    (tmp_path / "no_peft.py").write_text(NO_PEFT)
    no_peft = [python, str(tmp_path / "no_peft.py")]
    base = [*DDPM, *COMMON, "train.max_steps=1"]
    _run([*no_peft, "train", *base, f"run.dir={tmp_path / 'base'}"], tmp_path, env)
    folder = tmp_path / "exported"
    _run([*no_peft, "checkpoints", "export", str(tmp_path / "base" / "checkpoints"), str(folder)], tmp_path, env)
    lora = [*base, f"model.pretrained={folder / 'unet'}", "model.lora.rank=4"]
    _run([gentrain, "train", *lora, f"run.dir={tmp_path / 'lora'}"], tmp_path, env)
    assert (tmp_path / "lora" / "checkpoints").is_dir()
    r = subprocess.run(
        [*no_peft, "train", *lora, f"run.dir={tmp_path / 'lora-no-peft'}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 2, r.stderr[-4000:]
    assert "model.lora needs peft: pip install 'gentrain[lora]'" in r.stderr, r.stderr[-4000:]
    assert "Traceback" not in r.stderr, r.stderr[-4000:]
