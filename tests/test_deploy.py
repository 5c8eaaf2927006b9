"""Deploy without a cluster: TorchX component and dryruns, kustomize + schema validation, policies,
hadolint, a manifest-driven local run, and `torchx run -s local_cwd` end to end."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, clean_env, free_port, run_cli, tiny
from helpers import kill_group

BIN = Path(sys.executable).parent
GOLDEN = REPO / "tests" / "golden"
OVERLAYS = ["base", "jobset", "volcano", "monitoring", "overlays/cpu-smoke", "overlays/gpu"]


def tool(name: str) -> str:
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    if not path:
        pytest.skip(f"{name} is not installed (scripts/test.sh installs it)")
    return str(path)


def kustomize(overlay: str) -> list[dict]:
    out = subprocess.run([tool("kubectl"), "kustomize", str(REPO / "k8s" / overlay)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


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


def test_component_passes_the_torchx_linter_and_builds_the_appdef():
    from torchx.specs.file_linter import validate as lint

    assert lint(str(REPO / "components" / "train.py"), "train") == []
    sys.path.insert(0, str(REPO))
    from components.train import train

    app = train("train.max_steps=10", j="2x8", gpu=8, checkpoint_url="s3://b/run", max_restarts=5)
    role = app.roles[0]
    assert role.port_map == {"c10d": 29500, "metrics": 9090}
    assert role.env["GENTRAIN_CHECKPOINT__URL"] == "s3://b/run"
    assert role.env["GENTRAIN_METRICS__PORT"] == "9090"
    assert role.resource.memMB == 16384 and role.resource.gpu == 8
    assert role.max_retries == 3 and role.num_replicas == 2
    cmd = role.args[-1]
    assert cmd.startswith("torchrun --max_restarts 5 ")
    assert "-m trainer train digits-ddpm train.max_steps=10" in cmd
    assert "--nproc_per_node 8" in cmd


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
        )  # fmt: skip
    )
    golden = GOLDEN / "torchx-kubernetes-dryrun.yaml"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(request)
    assert request == golden.read_text(), "dryrun changed; rerun with UPDATE_GOLDEN=1 after checking the diff"
    pods = volcano_pods(request)
    assert len(pods) == 2
    for pod in pods:
        c = pod["spec"]["containers"][0]
        assert {p["name"] for p in c["ports"]} == {"c10d", "metrics"}
        assert c["resources"]["requests"]["memory"] == "261120M"  # a real request, not 0
    validate(pods, tmp_path, "torchx-pods")


def test_builtin_dist_ddp_dryrun_renders_valid_pods(tmp_path):
    request = torchx_dryrun(
        "dist.ddp", "-j", "2x8", "--gpu", "8", "--image", "ghcr.io/gentrain/gentrain:0.1.0",
        "-m", "trainer", "train", "digits-ddpm", "train.max_steps=100",
    )  # fmt: skip
    pods = volcano_pods(request)
    assert "-m trainer train digits-ddpm" in pods[0]["spec"]["containers"][0]["command"][-1]
    validate(pods, tmp_path, "ddp-pods")


def test_torchx_local_cwd_trains_with_two_workers(tmp_path):
    env = clean_env(PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    r = subprocess.run(
        [tool("torchx"), "run", "-s", "local_cwd", "components/train.py:train", "-j", "1x2", "--metrics_port", "0",
         "--", *tiny(tmp_path, max_steps=4)],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=300,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "world_size=2" in out and "SUCCEEDED" in out
    assert run_cli("checkpoints", "verify", str(tmp_path / "run" / "checkpoints")).returncode == 0


# ---------------------------------------------------------------- manifests


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


@pytest.mark.parametrize("overlay", ["base", "overlays/cpu-smoke", "overlays/gpu"])
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


def test_jobset_preemption_recipe():
    js = workload("jobset")
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


def test_no_latest_tags_and_no_secrets_anywhere():
    for path in [*(REPO / "k8s").rglob("*.yaml"), REPO / "components" / "train.py"]:
        t = path.read_text()
        assert not re.search(r"image\S*\s*[:=]\s*\S+:latest\b", t), path
        assert "kind: Secret" not in t, path
        assert not re.search(r"(?i)(aws_secret_access_key|password|private_key)\s*[:=]", t), path
    base = re.search(r"^FROM (\S+)", (REPO / "Dockerfile").read_text(), re.M).group(1)
    assert ":" in base and not base.endswith(":latest")


def test_dockerfile_passes_hadolint():
    r = subprocess.run([tool("hadolint"), str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    text = (REPO / "Dockerfile").read_text()
    assert "EXPOSE 29500 9090" in text and re.search(r"^USER 1000", text, re.M)
    assert text.index("COPY pyproject.toml") < text.index("COPY trainer")  # deps cached before code


# ---------------------------------------------------------------- manifest-driven local run


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
