"""Deploy without a cluster: TorchX component and dryruns, kustomize + schema validation, policies,
hadolint, a manifest-driven local run, and `torchx run -s local_cwd` end to end."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jsonschema  # comes with kubernetes-validate (test extra)
import pytest
import yaml
from conftest import REPO, clean_env, free_port, run_cli, tiny
from helpers import kill_group, wait_for_log

BIN = Path(sys.executable).parent
GOLDEN = REPO / "tests" / "golden"
OVERLAYS = ["base", "jobset", "volcano", "kueue", "monitoring", "overlays/cpu-smoke", "overlays/gpu"]
OVERLAYS += ["jobset-gpu", "kueue-gpu", "priority", "etcd", "overlays/etcd"]
GPU_OVERLAYS = ["overlays/gpu", "jobset-gpu", "kueue-gpu"]
# The overlays that run training pods (a Job or a JobSet); test_the_training_overlays_are_listed keeps this whole.
TRAINING_OVERLAYS = ["base", "jobset", "kueue", "overlays/cpu-smoke", "overlays/gpu", "jobset-gpu", "kueue-gpu"]
TRAINING_OVERLAYS += ["overlays/etcd"]


def tool(name: str) -> str:
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    if not path:
        pytest.skip(f"{name} is not installed (scripts/test.sh installs it)")
    return str(path)


def kustomize(overlay: str | Path) -> list[dict]:
    """Render k8s/<overlay>, or a kustomization folder given as a Path."""
    path = overlay if isinstance(overlay, Path) else REPO / "k8s" / overlay
    out = subprocess.run([tool("kubectl"), "kustomize", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def user_overlay(tmp_path: Path, **kustomization) -> Path:
    """A kustomization outside the repo, as a user's own overlay would be; K8S in its values is the
    relative path to k8s/ (kustomize takes no absolute paths)."""
    k8s = os.path.relpath(REPO / "k8s", tmp_path)
    text = yaml.safe_dump(kustomization).replace("K8S", k8s)
    (tmp_path / "kustomization.yaml").write_text(text)
    return tmp_path


def validate(docs: list[dict], tmp_path: Path, name: str) -> str:
    f = tmp_path / f"{name}.yaml"
    f.write_text(yaml.safe_dump_all(docs))
    r = subprocess.run([tool("kubernetes-validate"), "--strict", "-k", "1.33", str(f)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr


def pod_from_template(template: dict, name: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**template.get("metadata", {}), "name": name},
        "spec": template["spec"],
    }


def job_spec(doc: dict) -> dict:
    if doc["kind"] == "Job":
        return doc["spec"]
    return doc["spec"]["replicatedJobs"][0]["template"]["spec"]


# ---------------------------------------------------------------- TorchX


def component():
    sys.path.insert(0, str(REPO))
    from components.train import train

    return train


def test_component_passes_the_torchx_linter_and_builds_the_appdef():
    from torchx.specs.file_linter import validate as lint

    assert lint(str(REPO / "components" / "train.py"), "train") == []
    train = component()
    app = train("train.max_steps=10", j="2x8", gpu=8, checkpoint_url="s3://b/run", max_restarts=5)
    role = app.roles[0]
    assert role.port_map == {"c10d": 29500, "metrics": 9090}
    assert role.env["GENTRAIN_CHECKPOINT__URL"] == "s3://b/run"
    assert role.env["GENTRAIN_METRICS__PORT"] == "9090"
    assert role.resource.memMB == 16384 and role.resource.gpu == 8
    assert role.max_retries == 3 and role.num_replicas == 2
    assert role.entrypoint == "bash"
    cmd = role.args[-1]
    # gentrain launch, not raw torchrun: the contract's exit codes hold in the pod.
    assert cmd.startswith("python -m trainer launch --max_restarts 5 --rdzv_backend c10d ")
    assert cmd.endswith(" -- digits-ddpm train.max_steps=10")
    assert "--nproc_per_node 8" in cmd and "--nnodes 2" in cmd
    assert app.metadata["gentrain/no-retry-exit-codes"] == "2"


def test_component_takes_a_preset_like_gentrain_train():
    train = component()

    def train_args(*args, **kwargs):
        return train(*args, **kwargs).roles[0].args[-1].split(" -- ", 1)[1]

    assert train_args() == "digits-ddpm"
    assert train_args("digits-ddpm", "train.lr=1e-4") == "digits-ddpm train.lr=1e-4"
    assert train_args("train.lr=1e-4", preset="digits-ddpm") == "digits-ddpm train.lr=1e-4"
    assert train_args("/cfg/my run.yaml", "a.b=1") == "'/cfg/my run.yaml' a.b=1"
    # `$` survives TorchX's macro substitution and bash (single quotes).
    from torchx.specs import macros

    role = train("checkpoint.url=$HOME/ckpt").roles[0]
    applied = macros.Values(img_root="", app_id="a", replica_id="0", rank0_env="R").apply(role)
    assert applied.args[-1].endswith(" -- digits-ddpm 'checkpoint.url=$HOME/ckpt'")
    with pytest.raises(ValueError, match="preset given twice"):
        train("other-preset", preset="digits-ddpm")
    with pytest.raises(ValueError, match="not key=value"):
        train("digits-ddpm", "train.lr", "x=1")


def test_component_renders_an_etcd_rendezvous_for_torchrun():
    from torchx.specs import macros

    train = component()
    role = train("train.max_steps=10", j="1:4x8", rdzv_backend="etcd-v2", rdzv_endpoint="gentrain-etcd:2379").roles[0]
    applied = macros.Values(img_root="", app_id="run-1", replica_id="0", rank0_env="R").apply(role)
    launch, train_args = applied.args[-1].split(" -- ")
    launcher = shlex.split(launch)  # as bash reads it
    assert launcher[:4] == ["python", "-m", "trainer", "launch"]
    flags = dict(zip(launcher[4::2], launcher[5::2], strict=True))
    assert flags["--rdzv_backend"] == "etcd-v2" and flags["--rdzv_endpoint"] == "gentrain-etcd:2379"
    assert flags["--rdzv_id"] == "run-1" and flags["--nnodes"] == "1:4" and flags["--max_restarts"] == "3"
    assert train_args == "digits-ddpm train.max_steps=10"
    assert "c10d" not in role.port_map  # nothing listens on replica 0
    # torchrun reads the flags as written: etcd-v2 on that endpoint.
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args([*launcher[4:], "-m", "trainer"])
    assert (parsed.rdzv_backend, parsed.rdzv_endpoint, parsed.nnodes) == ("etcd-v2", "gentrain-etcd:2379", "1:4")
    # The default is still c10d on replica 0.
    assert "--rdzv_backend c10d --rdzv_endpoint $${${rank0_env}:=localhost}:29500 " in train(j="2x8").roles[0].args[-1]
    with pytest.raises(ValueError, match="etcd-v2 needs --rdzv_endpoint"):
        train(rdzv_backend="etcd-v2")
    with pytest.raises(ValueError, match="use one of c10d, etcd-v2"):
        train(rdzv_backend="static")
    with pytest.raises(ValueError, match="--rdzv_endpoint is for etcd-v2"):
        train(rdzv_endpoint="somewhere:29500")


def torchx_dryrun(*args: str) -> str:
    r = subprocess.run(
        [tool("torchx"), "run", "-s", "kubernetes", "--dryrun", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=clean_env(),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.split("=== SCHEDULER REQUEST ===", 1)[1]


def normalize(text: str) -> str:
    return re.sub(r"\b(gentrain|trainer|train)-[a-z0-9]{10,}\b", r"\1-APPID", text)


def volcano_pods(request: str) -> list[dict]:
    job = yaml.safe_load(request)
    assert job["kind"] == "Job" and job["apiVersion"].startswith("batch.volcano.sh")
    return [pod_from_template(t["template"], t["name"]) for t in job["spec"]["tasks"]]


@pytest.mark.slow
def test_kubernetes_dryrun_of_the_component_matches_the_golden_file(tmp_path):
    request = normalize(
        torchx_dryrun(
            "components/train.py:train",
            "--image",
            "ghcr.io/gentrain/gentrain:0.1.0",
            "-j",
            "2x8",
            "--gpu",
            "8",
            "--cpu",
            "32",
            "--memMB",
            "262144",
            "--checkpoint_url",
            "gs://my-bucket/gentrain/run1",
            "--",
            "train.max_steps=100000",
        )
    )
    golden = GOLDEN / "torchx-kubernetes-dryrun.yaml"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(request)
    assert request == golden.read_text(), "dryrun changed; rerun with UPDATE_GOLDEN=1 after checking the diff"
    job = yaml.safe_load(request)
    for task in job["spec"]["tasks"]:
        # A config error (exit 2) terminates the job; Volcano matches a task's policies in order,
        # so it must come before PodFailed -> RestartJob, which retries everything else.
        assert task["policies"][0] == {"exitCode": 2, "action": "TerminateJob"}
        assert {"event": "PodFailed", "action": "RestartJob"} in task["policies"][1:]
        assert {"event": "PodEvicted", "action": "RestartJob"} in task["policies"][1:]
        cmd = task["template"]["spec"]["containers"][0]["command"]
        assert cmd[:2] == ["bash", "-c"] and cmd[2].startswith("python -m trainer launch ")
        assert cmd[2].endswith(" -- digits-ddpm train.max_steps=100000")
    pods = volcano_pods(request)
    assert len(pods) == 2
    for pod in pods:
        c = pod["spec"]["containers"][0]
        assert {p["name"] for p in c["ports"]} == {"c10d", "metrics"}
        assert c["resources"]["requests"]["memory"] == "261120M"  # a real request, not 0
    validate(pods, tmp_path, "torchx-pods")


@pytest.mark.slow
def test_builtin_dist_ddp_dryrun_renders_valid_pods(tmp_path):
    request = torchx_dryrun(
        "dist.ddp",
        "-j",
        "2x8",
        "--gpu",
        "8",
        "--image",
        "ghcr.io/gentrain/gentrain:0.1.0",
        "-m",
        "trainer",
        "train",
        "digits-ddpm",
        "train.max_steps=100",
    )
    pods = volcano_pods(request)
    assert "-m trainer train digits-ddpm" in pods[0]["spec"]["containers"][0]["command"][-1]
    validate(pods, tmp_path, "ddp-pods")
    # Only apps built by components/train.py get the exit-code policy (see k8s/README.md).
    assert "exitCode" not in request


def torchx_local(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = clean_env(PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run(
        [tool("torchx"), "run", "-s", "local_cwd", "components/train.py:train", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=timeout,
    )


@pytest.mark.slow
def test_torchx_local_cwd_trains_with_two_workers_and_a_preset_first(tmp_path):
    # The same words `gentrain train` takes: a preset first, then key=value overrides.
    r = torchx_local("-j", "1x2", "--metrics_port", "0", "--", "digits-ddpm", *tiny(tmp_path, max_steps=4))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "world_size=2" in out and "SUCCEEDED" in out
    assert run_cli("checkpoints", "verify", str(tmp_path / "run" / "checkpoints")).returncode == 0


@pytest.mark.slow
def test_torchx_local_cwd_config_error_fails_once_and_names_the_key(tmp_path):
    r = torchx_local(
        "-j",
        "1x2",
        "--max_restarts",
        "3",
        "--metrics_port",
        "0",
        "--",
        "digits-ddpm",
        *tiny(tmp_path, "train.max_stepz=10"),
    )
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-4000:]
    assert "FAILED" in out
    assert "unknown config key 'train.max_stepz'" in out
    # One attempt: the launcher rejects the config before torchrun starts any worker.
    assert out.count("config error") == 1, out[-4000:]
    assert "attempt_" not in out and "will restart worker group" not in out and "[rank" not in out
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_the_component_command_keeps_exit_codes_in_bash_2_and_143(tmp_path):
    """The pod's own command line (macros applied as the scheduler does), run here with bash."""
    from torchx.specs import macros

    def pod(*script_args: str, log: Path) -> subprocess.Popen:
        role = component()(*script_args, j="1x2", metrics_port=0, max_restarts=3).roles[0]
        role = macros.Values(img_root="", app_id="gentrain-test", replica_id="0", rank0_env="TORCHX_RANK0_HOST").apply(
            role
        )
        env = {**clean_env(PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}"), **role.env}
        env["GENTRAIN_RUN__DIR"] = str(tmp_path / "run")  # the pod's /work/run
        return subprocess.Popen(
            [role.entrypoint, *role.args],
            cwd=REPO,
            env=env,
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    log = tmp_path / "typo.log"
    proc = pod("digits-ddpm", "train.lrr=1", log=log)
    try:
        assert proc.wait(timeout=300) == 2, log.read_text()[-3000:]
    finally:
        kill_group(proc)
    assert "unknown config key 'train.lrr'" in log.read_text()

    log = tmp_path / "term.log"
    proc = pod("digits-ddpm", *tiny(tmp_path, "checkpoint.every_steps=0", max_steps=100000), log=log)
    try:
        wait_for_log(log, "step=5/", proc, timeout=400)
        proc.send_signal(signal.SIGTERM)  # what the kubelet sends to the container's PID 1
        assert proc.wait(timeout=60) == 143, log.read_text()[-3000:]
    finally:
        kill_group(proc)
    assert "emergency checkpoint written" in log.read_text()
    assert run_cli("checkpoints", "verify", str(tmp_path / "run" / "checkpoints")).returncode == 0


@pytest.mark.slow
def test_launch_does_not_restart_workers_that_exit_2(tmp_path):
    """A usage error only workers can see (the world size cannot split the batch): no torchrun retry."""
    port = free_port()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer",
            "launch",
            "--nproc-per-node=3",
            "--max-restarts=3",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id=t{port}",
            "--monitor-interval=0.2",
            "--",
            *tiny(tmp_path, max_steps=2),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=clean_env(),
    )
    assert r.returncode == 2, r.stderr[-3000:]
    # One attempt: each of its 3 workers says so at most once. torchrun SIGTERMs the others as soon as the
    # first exits 2, so a worker still starting says nothing (exit -15): at least one said it.
    assert 1 <= r.stderr.count("cannot be split evenly over world size 3") <= 3, r.stderr[-3000:]
    codes = re.search(r"failed first with exit code 2 \(all: \[([-\d, ]+)\]\)", r.stderr)
    assert codes and set(map(int, codes.group(1).split(","))) <= {2, -15}, r.stderr[-3000:]
    assert "will restart worker group" not in r.stderr and "not restarting the workers" in r.stderr
    # Every launch path runs gentrain launch, which adds its rendezvous defaults (trainer.launch.RDZV_DEFAULTS):
    # a survivor's new round waits 2 s for a lost node, not torch's 30 (docs/goodput.md, Detection).
    assert "rendezvous c10d, --rdzv-conf=last_call_timeout=2" in r.stderr, r.stderr[-3000:]


# ---------------------------------------------------------------- image


def test_the_image_ships_the_torch_the_suite_tests():
    import torch

    dockerfile = (REPO / "Dockerfile").read_text()
    (image_torch,) = re.findall(r"^ARG TORCH_VERSION=(\S+)$", dockerfile, re.M)
    tested = torch.__version__.split("+")[0]
    assert image_torch == tested, f"Dockerfile installs torch {image_torch}, the suite runs {tested}"
    (ci_torch,) = re.findall(r"pip\S* install -q (?:--\S+ )*torch==(\S+)", (REPO / "scripts" / "test.sh").read_text())
    assert image_torch == ci_torch, f"Dockerfile installs torch {image_torch}, scripts/test.sh {ci_torch}"
    assert 'pip install --no-cache-dir "torch==${TORCH_VERSION}"' in dockerfile
    # PyPI's default Linux wheel is the CUDA build; a CPU index or local version would not be.
    assert "download.pytorch.org/whl/cpu" not in dockerfile and "+cpu" not in dockerfile
    assert not re.search(r"^FROM \S*pytorch/pytorch", dockerfile, re.M)  # its torch would be another release


def test_the_image_installs_bytecode_and_the_suite_caches_what_it_compiles(monkeypatch):
    """PYTHONDONTWRITEBYTECODE=1 (the image, CI) means Python never caches what it compiles: an install without
    .pyc files compiles torch's sources again in every process (1.6x the suite's CPU time once). The image installs
    with bytecode. The suite and the image-install test install without it (pip compiles every module, most never
    imported) and run their processes without PYTHONDONTWRITEBYTECODE, so each module is compiled once."""
    from test_image_install import _venv_env

    assert "--no-compile" not in (REPO / "Dockerfile").read_text()
    script = (REPO / "scripts" / "test.sh").read_text()
    installs = [line for line in script.splitlines() if re.match(r'"\$VENV/bin/pip" install', line)]
    assert len(installs) == 2 and all("--no-compile" in line for line in installs), installs
    assert re.search(r"^unset PYTHONDONTWRITEBYTECODE\b", script, re.M)
    assert script.index("unset PYTHONDONTWRITEBYTECODE") < script.index("-m pytest")
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    assert "PYTHONDONTWRITEBYTECODE" not in _venv_env(Path("/venv"))


# ---------------------------------------------------------------- manifests


@pytest.mark.slow
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_and_core_kinds_validate_strictly(overlay, tmp_path):
    docs = kustomize(overlay)
    core = [d for d in docs if "." not in d["apiVersion"].split("/")[0] or d["apiVersion"].startswith("batch/")]
    custom = [d for d in docs if d not in core]
    if core:
        out = validate(core, tmp_path, "core")
        assert "passed" in out
    for d in custom:
        if d["kind"] == "JobSet":
            job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "jobset-child"}, "spec": job_spec(d)}
            validate([job], tmp_path, "jobset-child")


def workload(overlay: str) -> dict:
    return next(d for d in kustomize(overlay) if d["kind"] in ("Job", "JobSet"))


@pytest.mark.slow
@pytest.mark.parametrize("overlay", ["base", "overlays/cpu-smoke", "overlays/gpu", "overlays/etcd"])
def test_job_policies(overlay):
    job = workload(overlay)
    spec = job["spec"]
    rules = spec["podFailurePolicy"]["rules"]
    assert any(
        r["action"] == "Ignore" and r.get("onPodConditions") == [{"type": "DisruptionTarget", "status": "True"}]
        for r in rules
    )
    assert any(r["action"] == "FailJob" and r.get("onExitCodes", {}).get("values") == [2] for r in rules)
    assert spec["podReplacementPolicy"] == "Failed"
    assert spec["completionMode"] == "Indexed"
    check_pod_policies(spec["template"]["spec"])


@pytest.mark.slow
@pytest.mark.parametrize("overlay", ["jobset", "kueue", "jobset-gpu", "kueue-gpu"])
def test_jobset_preemption_recipe(overlay):
    js = workload(overlay)
    fp = js["spec"]["failurePolicy"]
    child = job_spec(js)
    rules = child["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert rules[1]["action"] == "FailJob" and rules[1]["onExitCodes"]["values"] == [2]
    by_name = {r["name"]: r for r in fp["rules"]}
    assert by_name["preemption-is-free"]["action"] == "RestartJobSetAndIgnoreMaxRestarts"
    assert by_name["preemption-is-free"]["onJobFailureReasons"] == ["PodFailurePolicy"]
    assert by_name["preemption-is-free"]["onJobFailureMessagePatterns"] == ["matching FailJob rule at index 0$"]
    assert by_name["config-error-fails"]["action"] == "FailJobSet"
    assert fp["maxRestarts"] >= 1  # everything else counts against it
    check_pod_policies(child["template"]["spec"])


def quantity(q) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9}
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(q))
    return float(m.group(1)) * units.get(m.group(2), 1)


@pytest.mark.slow
def test_kueue_overlay_queues_the_jobset_and_its_quota_admits_it():
    docs = kustomize("kueue")
    by_kind = {d["kind"]: d for d in docs}
    js, lq, cq = by_kind["JobSet"], by_kind["LocalQueue"], by_kind["ClusterQueue"]
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == lq["metadata"]["name"]
    assert lq["spec"]["clusterQueue"] == cq["metadata"]["name"]
    assert "namespace" not in lq["metadata"] and "namespace" not in js["metadata"]  # same namespace
    assert workload("jobset")["spec"] == js["spec"]  # the same JobSet and preemption recipe, only labeled
    check_quota_admits(docs)


def check_quota_admits(docs: list[dict]) -> None:
    by_kind = {d["kind"]: d for d in docs}
    js, cq = by_kind["JobSet"], by_kind["ClusterQueue"]
    flavors = {d["metadata"]["name"] for d in docs if d["kind"] == "ResourceFlavor"}
    # Gang admission: the quota must hold every pod of the JobSet at once, in resources it covers.
    child = job_spec(js)
    pods = sum(r["replicas"] for r in js["spec"]["replicatedJobs"]) * child["parallelism"]
    (c,) = child["template"]["spec"]["containers"]
    (group,) = cq["spec"]["resourceGroups"]
    for flavor in group["flavors"]:
        assert flavor["name"] in flavors
        quota = {r["name"]: quantity(r["nominalQuota"]) for r in flavor["resources"]}
        assert set(quota) == set(group["coveredResources"])
        for name, request in c["resources"]["requests"].items():
            assert name in group["coveredResources"], f"{name} is requested but not covered"
            assert pods * quantity(request) <= quota[name]


def check_pod_policies(pod: dict) -> None:
    from trainer.config import ElasticConfig

    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["terminationGracePeriodSeconds"] > ElasticConfig().grace_seconds
    assert pod["serviceAccountName"] == "gentrain"
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert c["resources"]["limits"]["memory"]
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/dev/shm", "/tmp", "/work"}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    podmonitor = yaml.safe_load((REPO / "k8s" / "monitoring" / "podmonitor.yaml").read_text())
    assert podmonitor["spec"]["podMetricsEndpoints"][0]["port"] in ports
    assert ports["metrics"] == 9090
    assert c["envFrom"] == [{"configMapRef": {"name": "gentrain-config"}}]
    assert c["image"].split(":")[-1] not in ("", "latest") and ":" in c["image"]


@pytest.mark.slow
def test_the_training_overlays_are_listed():
    runs = [o for o in OVERLAYS if any(d["kind"] in ("Job", "JobSet") for d in kustomize(o))]
    assert runs == TRAINING_OVERLAYS


@pytest.mark.slow
@pytest.mark.parametrize("overlay", TRAINING_OVERLAYS)
def test_every_training_pod_has_a_memory_backed_dev_shm_with_a_size_limit(overlay):
    """/dev/shm holds the memory tier of checkpoints (and the DataLoader's batches): in memory, bounded, and
    inside the container's memory limit, which it counts against."""
    pod = pod_spec(workload(overlay))
    (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    (c,) = pod["containers"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert 0 < quantity(shm["emptyDir"]["sizeLimit"]) < quantity(c["resources"]["limits"]["memory"])


@pytest.mark.slow
def test_the_etcd_overlay_rendezvous_on_the_etcd_service():
    docs = kustomize("overlays/etcd")
    by_kind = {d["kind"]: d for d in docs if d["kind"] in ("Job", "StatefulSet")}
    (svc,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "gentrain-etcd"]
    sts = by_kind["StatefulSet"]
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"] and sts["spec"]["replicas"] == 1
    assert svc["spec"]["selector"] == sts["spec"]["template"]["metadata"]["labels"]
    (etcd,) = sts["spec"]["template"]["spec"]["containers"]
    assert "--enable-v2=true" in etcd["args"]  # torch's etcd-v2 rendezvous speaks the v2 API
    client = {p["name"]: p["containerPort"] for p in etcd["ports"]}["client"]
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]}["client"] == client
    assert f"--advertise-client-urls=http://{svc['metadata']['name']}:{client}" in etcd["args"]
    pod = pod_spec(by_kind["Job"])
    check_pod_policies(pod)
    (c,) = pod["containers"]
    args = dict(a.split("=", 1) for a in c["args"][: c["args"].index("--")])
    assert args["--rdzv-backend"] == "etcd-v2" and args["--rdzv-endpoint"] == f"{svc['metadata']['name']}:{client}"
    assert args["--rdzv-id"] == "$(JOB_NAME)" and args["--nnodes"] == "1:2"
    (wait,) = pod["initContainers"]
    assert f"http://{svc['metadata']['name']}:{client}/health" in wait["command"][-1]
    assert wait["image"] == c["image"]
    # Apart from the rendezvous, the base's training.
    base = pod_spec(workload("base"))
    assert {k: v for k, v in pod.items() if k not in ("containers", "initContainers")} == {
        k: v for k, v in base.items() if k != "containers"
    }


def test_no_latest_tags_and_no_secrets_anywhere():
    for path in [*(REPO / "k8s").rglob("*.yaml"), REPO / "components" / "train.py"]:
        t = path.read_text()
        assert not re.search(r"image\S*\s*[:=]\s*\S+:latest\b", t), path
        assert "kind: Secret" not in t, path
        assert not re.search(r"(?i)(aws_secret_access_key|password|private_key)\s*[:=]", t), path
    base = re.search(r"^FROM (\S+)", (REPO / "Dockerfile").read_text(), re.M).group(1)
    assert ":" in base and not base.endswith(":latest")


@pytest.mark.slow
def test_dockerfile_passes_hadolint():
    r = subprocess.run([tool("hadolint"), str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    text = (REPO / "Dockerfile").read_text()
    assert "EXPOSE 29500 9090" in text and re.search(r"^USER 1000", text, re.M)
    assert text.index("COPY pyproject.toml") < text.index("COPY trainer")  # deps cached before code


# ---------------------------------------------------------------- GPU overlays, priorities, components

CRD_SCHEMAS = json.loads((REPO / "tests" / "k8s-crd-schemas.json").read_text())
# Custom resources checked elsewhere or not at all: the Prometheus Operator's (rules: promtool in
# test_monitoring.py) and Volcano's Queue.
UNCHECKED_GROUPS = {"monitoring.coreos.com", "scheduling.volcano.sh"}


def api_group(doc: dict) -> str:
    return doc["apiVersion"].rpartition("/")[0]


def crd_errors(doc: dict, api_version: str | None = None) -> list[str]:
    schema = CRD_SCHEMAS[f"{api_version or doc['apiVersion']}/{doc['kind']}"]
    return [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
        for e in jsonschema.Draft7Validator(schema).iter_errors(doc)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_validates_its_other_kinds_against_their_schemas(overlay, tmp_path):
    """What test_every_overlay_renders_and_core_kinds_validate_strictly leaves out: other built-in API groups
    (PriorityClass) strictly with kubernetes-validate, custom resources against their CRDs' schemas."""
    builtin, custom = [], []
    for d in kustomize(overlay):
        group = api_group(d)
        if "." not in group or group.endswith(".k8s.io"):
            builtin.append(d)
        elif group not in UNCHECKED_GROUPS:
            custom.append(d)
    if builtin:
        out = validate(builtin, tmp_path, "builtin")
        assert "Couldn't find schema" not in out
    for d in custom:
        assert not crd_errors(d), (d["kind"], crd_errors(d))
        if d["apiVersion"] == "kueue.x-k8s.io/v1beta1":
            # v1beta1 is deprecated since Kueue 0.16: the same fields hold under v1beta2, so moving is a rename.
            assert not crd_errors(d, "kueue.x-k8s.io/v1beta2"), (d["kind"], crd_errors(d, "kueue.x-k8s.io/v1beta2"))


@pytest.mark.slow
def test_overlay_crd_schemas_reject_unknown_fields():
    docs = {d["kind"]: d for d in kustomize("kueue-gpu")}
    js = json.loads(json.dumps(docs["JobSet"]))
    js["spec"]["replicatedJobs"][0]["replica"] = 1
    assert any("'replica' was unexpected" in e for e in crd_errors(js))
    topo = json.loads(json.dumps(docs["Topology"]))
    topo["spec"]["levels"][0] = {"nodelabel": "rack"}
    assert crd_errors(topo)
    wpc = json.loads(json.dumps(docs["WorkloadPriorityClass"]))
    wpc["spec"] = {"value": 1}  # value is top-level
    assert any("'spec' was unexpected" in e for e in crd_errors(wpc))


def pod_spec(doc: dict) -> dict:
    return job_spec(doc)["template"]["spec"]


@pytest.mark.slow
@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_gpu_overlays_request_gpus_with_nccl_settings_and_a_memory_backed_dev_shm(overlay):
    docs = kustomize(overlay)
    job = next(d for d in docs if d["kind"] in ("Job", "JobSet"))
    spec, pod = job_spec(job), pod_spec(job)
    check_pod_policies(pod)
    (c,) = pod["containers"]
    gpus = c["resources"]["limits"]["nvidia.com/gpu"]
    assert int(gpus) >= 1 and c["resources"]["requests"]["nvidia.com/gpu"] == gpus  # extended resources: equal
    args = dict(a.split("=", 1) for a in c["args"][: c["args"].index("--")])
    assert args["--nproc-per-node"] == gpus  # one process per GPU
    assert int(args["--nnodes"].split(":")[-1]) == spec["parallelism"] == spec["completions"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["NCCL_DEBUG"] == "WARN" and env["NCCL_SOCKET_IFNAME"]
    (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["medium"] == "Memory" and quantity(shm["emptyDir"]["sizeLimit"]) >= 16 * 2**30
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    # The shared memory counts against the container's memory limit: it must fit with room to spare.
    assert quantity(shm["emptyDir"]["sizeLimit"]) < quantity(c["resources"]["limits"]["memory"]) / 2
    assert (
        pod["nodeSelector"]
        and {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    )
    # The PriorityClass the pods name comes with the overlay (a missing one makes pod creation fail).
    classes = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PriorityClass"}
    assert pod["priorityClassName"] in classes
    assert classes[pod["priorityClassName"]]["globalDefault"] is False


@pytest.mark.slow
def test_the_gpu_jobset_is_placed_alone_in_one_topology_domain():
    js = workload("jobset-gpu")
    assert js["metadata"]["annotations"]["alpha.jobset.sigs.k8s.io/exclusive-topology"]
    assert len(js["spec"]["replicatedJobs"]) == 1  # one child Job, so the whole run lands in one domain
    # Only the GPU settings differ from ../jobset: the preemption recipe and the rest of the pod stay.
    cpu = workload("jobset")
    assert js["spec"]["failurePolicy"] == cpu["spec"]["failurePolicy"]
    assert job_spec(js)["podFailurePolicy"] == job_spec(cpu)["podFailurePolicy"]
    assert pod_spec(js)["securityContext"] == pod_spec(cpu)["securityContext"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overlay", "priority"), [("kueue", "gentrain-experiment"), ("kueue-gpu", "gentrain-production")]
)
def test_the_kueue_workload_carries_a_workload_priority_class(overlay, priority):
    docs = kustomize(overlay)
    js = next(d for d in docs if d["kind"] == "JobSet")
    classes = {d["metadata"]["name"]: d["value"] for d in docs if d["kind"] == "WorkloadPriorityClass"}
    assert js["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == priority
    assert priority in classes  # a label naming a missing class stops Kueue from creating the workload
    (cq,) = [d for d in docs if d["kind"] == "ClusterQueue"]
    assert cq["spec"]["preemption"]["withinClusterQueue"] == "LowerPriority"
    assert classes["gentrain-production"] > classes["gentrain-experiment"]  # production may preempt experiments


@pytest.mark.slow
def test_the_kueue_gpu_overlay_uses_topology_aware_scheduling_and_its_quota_admits_it():
    docs = kustomize("kueue-gpu")
    by_kind = {d["kind"]: d for d in docs}
    js, flavor, topology = by_kind["JobSet"], by_kind["ResourceFlavor"], by_kind["Topology"]
    check_quota_admits(docs)
    queue = "kueue.x-k8s.io/queue-name"
    assert js["metadata"]["labels"][queue] == workload("kueue")["metadata"]["labels"][queue]
    # The CEL rules the schema file does not check: a TAS flavor needs node labels; hostname is the last level.
    assert flavor["spec"]["topologyName"] == topology["metadata"]["name"] and flavor["spec"]["nodeLabels"]
    levels = [level["nodeLabel"] for level in topology["spec"]["levels"]]
    assert len(set(levels)) == len(levels) and levels[-1] == "kubernetes.io/hostname"
    annotations = job_spec(js)["template"]["metadata"]["annotations"]
    assert annotations["kueue.x-k8s.io/podset-required-topology"] in levels
    # The flavor's node labels agree with the pods' own node selector (Kueue adds them to it).
    assert flavor["spec"]["nodeLabels"].items() <= pod_spec(js)["nodeSelector"].items()
    # TAS and JobSet's exclusive placement would both steer the pods: only one of them is used.
    assert "alpha.jobset.sigs.k8s.io/exclusive-topology" not in js["metadata"].get("annotations", {})


@pytest.mark.slow
def test_podmonitor_release_label_defaults_to_kube_prometheus_stack_and_can_be_set(tmp_path):
    labelled = ("PodMonitor", "PrometheusRule")
    docs = kustomize("monitoring")
    assert {d["metadata"]["labels"]["release"] for d in docs if d["kind"] in labelled} == {"kube-prometheus-stack"}
    assert "gentrain-monitoring-values" not in {d["metadata"]["name"] for d in docs}  # local-config: never applied
    overlay = user_overlay(
        tmp_path,
        resources=["K8S/monitoring"],
        components=["K8S/components/prometheus-release"],
        configMapGenerator=[
            {"name": "gentrain-monitoring-values", "behavior": "merge", "literals": ["prometheusRelease=prom-ops"]}
        ],
    )
    docs = kustomize(overlay)
    assert {d["metadata"]["labels"]["release"] for d in docs if d["kind"] in labelled} == {"prom-ops"}
    assert len([d for d in docs if d["kind"] in labelled]) == 2
    assert "gentrain-monitoring-values" not in {d["metadata"]["name"] for d in docs}


@pytest.mark.slow
@pytest.mark.parametrize("overlay", ["overlays/gpu", "kueue-gpu"])
def test_the_image_pull_secret_component_adds_image_pull_secrets(overlay, tmp_path):
    def service_account(docs):
        (sa,) = [d for d in docs if d["kind"] == "ServiceAccount"]
        return sa

    assert "imagePullSecrets" not in service_account(kustomize(overlay))
    docs = kustomize(
        user_overlay(tmp_path, resources=[f"K8S/{overlay}"], components=["K8S/components/image-pull-secret"])
    )
    sa = service_account(docs)
    assert sa["imagePullSecrets"] == [{"name": "gentrain-registry"}]
    # Kubernetes adds the ServiceAccount's pull secrets to the pods that run as it: these do.
    job = next(d for d in docs if d["kind"] in ("Job", "JobSet"))
    assert pod_spec(job)["serviceAccountName"] == sa["metadata"]["name"]
    validate([sa], tmp_path, "serviceaccount")


@pytest.mark.slow
def test_dockerfile_gpu_build_takes_torch_from_another_index_only_when_asked(tmp_path):
    """The TORCH_INDEX_URL build argument: empty (the default) installs PyPI's torch; a URL becomes pip's
    index for the torch step only. The step's shell command runs here with a pip that records its call."""
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^ARG TORCH_INDEX_URL=$", text, re.M)
    lines = re.sub(r"\\\n", " ", text).splitlines()
    (step,) = [line[4:] for line in lines if line.startswith("RUN ") and "TORCH_INDEX_URL" in line]
    assert step.index("TORCH_INDEX_URL") < step.index('pip install --no-cache-dir "torch==${TORCH_VERSION}"')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "pip").write_text('#!/bin/sh\nprintf "%s\\n" "index=${PIP_INDEX_URL:-}" "$@" > "$PIP_LOG"\n')
    (bin_dir / "pip").chmod(0o755)

    def run_step(index_url: str) -> list[str]:
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PIP_LOG": str(tmp_path / "pip.log")}
        env.update(TORCH_VERSION="2.13.0", TORCH_INDEX_URL=index_url)
        subprocess.run(["/bin/sh", "-c", step], env=env, check=True)  # the shell docker's RUN uses
        return (tmp_path / "pip.log").read_text().splitlines()

    assert run_step("") == ["index=", "install", "--no-cache-dir", "torch==2.13.0"]
    cu126 = "https://download.pytorch.org/whl/cu126"
    assert run_step(cu126) == [f"index={cu126}", "install", "--no-cache-dir", "torch==2.13.0"]


# ---------------------------------------------------------------- manifest-driven local run


@pytest.mark.slow
def test_cpu_smoke_manifest_runs_as_two_local_pods(tmp_path):
    docs = kustomize("overlays/cpu-smoke")
    job = next(d for d in docs if d["kind"] == "Job")
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "gentrain-config")["data"]
    (c,) = job["spec"]["template"]["spec"]["containers"]
    job_name = job["metadata"]["name"]
    rdzv_host = f"{job_name}-0.{job['spec']['template']['spec']['subdomain']}"
    port = free_port()
    shared = tmp_path / "shared-checkpoints"  # stands in for the bucket both pods write to

    procs = []
    try:
        for index in (0, 1):
            env = clean_env(**config)
            for e in c["env"]:
                if "value" in e:
                    env[e["name"]] = e["value"]
                elif e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['batch.kubernetes.io/job-name']":
                    env[e["name"]] = job_name
            env.update(
                JOB_COMPLETION_INDEX=str(index),
                HOSTNAME=f"{job_name}-{index}",
                GENTRAIN_METRICS_DIR=str(tmp_path / f"pod{index}" / "metrics"),
                # Local stand-ins for the pod's volumes and ports.
                GENTRAIN_CHECKPOINT__URL=str(shared),
                GENTRAIN_RUN__DIR=str(tmp_path / f"pod{index}" / "run"),
                GENTRAIN_METRICS__PORT=str(free_port()),
                GENTRAIN_METRICS__HOST="127.0.0.1",
                GENTRAIN_METRICS__LINGER_SECONDS="0",
            )
            args = [re.sub(r"\$\((\w+)\)", lambda m, env=env: env[m.group(1)], a) for a in c["args"]]
            # pod-0's DNS name maps to 127.0.0.1; the port is a free one on this machine.
            args = [a.replace(f"{rdzv_host}:29500", f"127.0.0.1:{port}") for a in args]
            assert c["command"] == ["gentrain", "launch"]
            cmd = [sys.executable, "-m", "trainer", "launch", *args]
            log = tmp_path / f"pod{index}.log"
            procs.append(
                (
                    subprocess.Popen(
                        cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True
                    ),
                    log,
                )
            )
        for proc, log in procs:
            assert proc.wait(timeout=400) == 0, log.read_text()[-4000:]
    finally:
        for proc, _ in procs:
            kill_group(proc)
    text = procs[0][1].read_text() + procs[1][1].read_text()
    assert "world_size=4" in text  # 2 pods x 2 processes
    max_steps = int(config["GENTRAIN_TRAIN__MAX_STEPS"])
    r = run_cli("checkpoints", "list", str(shared))
    assert r.returncode == 0 and f"{max_steps:>10}" in r.stdout and "valid" in r.stdout
    assert run_cli("checkpoints", "verify", str(shared)).returncode == 0
