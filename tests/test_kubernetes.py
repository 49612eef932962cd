"""`phalanx k8s render`: every rendered JobSet is checked against JobSet's published CRD schema (read in place
from ../shared/k8s; no Kubernetes API server can run here), for one node, two, sixteen, spares, GPUs and a
Kueue queue; and what the pods would run is the agent command line the other backends run."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import jsonschema
import pytest
import yaml

from conftest import REPO, unavailable
from phalanx.control.executors.kubernetes import KubernetesError, render, submit
from phalanx.spec import parse_spec

# The workplace keeps it next to the repository; PHALANX_JOBSET_CRD points elsewhere (a clone in another place).
CRD = Path(os.environ.get("PHALANX_JOBSET_CRD", REPO.parent / "shared" / "k8s" / "jobset.x-k8s.io_jobsets.yaml"))


@cache
def jobset_validator() -> jsonschema.protocols.Validator:
    if not CRD.is_file():
        unavailable(f"JobSet's CRD schema is not at {CRD}: set PHALANX_JOBSET_CRD to its file (shared/k8s/)")
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    schema = version["schema"]["openAPIV3Schema"]
    return jsonschema.Draft7Validator(schema, format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER)


def _spec(nodes: int, spares: int = 0, device: str = "cpu", kubernetes: str = "", procs: int = 2) -> str:
    claim = "image: registry.example.com/train:1, " + ("runs_claim: shared-runs, " if nodes + spares > 1 else "")
    return (
        f"name: Llama_8B.run\nresources: {{nodes: {nodes}, spare_nodes: {spares}, procs_per_node: {procs}, "
        f"device: {device}}}\n"
        "train: {model: {preset: llama-tiny}, steps: 10, global_batch: 256, micro_batch: 1, seq_len: 32}\n"
        f"resilience: {{max_restarts: 5}}\nkubernetes: {{{claim}{kubernetes}}}\n"
    )


def _render(text: str) -> tuple[dict, dict]:
    config, jobset = render(parse_spec(text), text)
    errors = sorted(jobset_validator().iter_errors(jobset), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)
    return config, jobset


def _job(jobset: dict) -> dict:
    (replicated,) = jobset["spec"]["replicatedJobs"]
    assert replicated["replicas"] == 1
    return replicated["template"]["spec"]


@pytest.mark.parametrize(
    ("nodes", "spares", "device", "kubernetes"),
    [
        (1, 0, "cpu", ""),
        (2, 0, "cuda", "queue: team-a"),
        (16, 2, "cuda", "queue: research, gpu_resource: amd.com/gpu, cpu: '96', memory: 1800Gi, namespace: ml"),
        (2, 1, "cpu", "priority_class: high, service_account: trainer, node_selector: {pool: a100}"),
    ],
)
def test_rendered_jobset_satisfies_the_crd_schema(nodes: int, spares: int, device: str, kubernetes: str) -> None:
    text = _spec(nodes, spares, device, kubernetes)
    spec = parse_spec(text)
    config, jobset = _render(text)
    job = _job(jobset)
    pod = job["template"]["spec"]
    (container,) = pod["containers"]

    assert jobset["metadata"]["name"] == "llama-8b-run" == jobset["spec"]["network"]["subdomain"]
    assert jobset["metadata"]["namespace"] == config["metadata"]["namespace"] == spec.kubernetes.namespace
    assert jobset["spec"]["network"]["enableDNSHostnames"] is True  # the headless service
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] == 5  # the job's restart budget
    assert job["parallelism"] == job["completions"] == nodes + spares  # one pod per node and per spare
    assert job["completionMode"] == "Indexed" and job["backoffLimit"] == 0
    queue = jobset["metadata"]["labels"].get("kueue.x-k8s.io/queue-name")
    assert queue == spec.kubernetes.queue
    limits = container["resources"].get("limits", {})
    assert limits.get(spec.kubernetes.gpu_resource) == (2 if device == "cuda" else None)
    assert container["resources"].get("requests", {}) == limits  # requests = limits: Guaranteed QoS
    # the spec the pods read loads, and points the checkpoints at the shared volume that outlives the pods
    shipped = parse_spec(config["data"]["job.yaml"])
    assert shipped.resources == spec.resources
    if nodes + spares > 1:
        assert shipped.checkpoint.dir == f"{spec.kubernetes.runs_path}/Llama_8B.run/checkpoints"
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["runs"]["persistentVolumeClaim"]["claimName"] == "shared-runs"


def test_each_pod_runs_the_agent_of_its_index_and_the_others_find_node_0_by_its_dns_name(tmp_path: Path) -> None:
    _, jobset = _render(_spec(2, 1))
    (container,) = _job(jobset)["template"]["spec"]["containers"]
    script = container["command"][2]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env["PHALANX_NODE_RANK"] == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    # run the pod's command with a `python` that prints its argv: node 0 binds its own address, node 2 dials
    # node 0's DNS name (JobSet's <jobset>-<replicated job>-<job index>-<pod index>.<subdomain>)
    for rank, rdzv in (("0", "10.1.2.3:29400"), ("2", "llama-8b-run-node-0-0.llama-8b-run:29400")):
        shown = subprocess.run(
            ["/bin/sh", "-c", script],
            env={"PHALANX_NODE_RANK": rank, "POD_IP": "10.1.2.3", "PATH": str(_echo_python(tmp_path))},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert shown[:4] == ["-m", "phalanx", "agent", "/etc/phalanx/job.yaml"]
        args = dict(zip(shown[4::2], shown[5::2], strict=True))
        assert args == {"--rdzv": rdzv, "--node-rank": rank, "--addr": "10.1.2.3", "--runs-dir": "/phalanx/runs"}


def _echo_python(where: Path) -> Path:
    """A folder with a `python` that prints its arguments."""
    (where / "python").write_text(f"#!{sys.executable}\nimport sys; print(' '.join(sys.argv[1:]))\n")
    (where / "python").chmod(0o755)
    return where


def test_what_a_jobset_cannot_do_without_is_refused_naming_the_field() -> None:
    text = _spec(2).replace("runs_claim: shared-runs, ", "")
    with pytest.raises(KubernetesError, match=r"kubernetes.runs_claim: a job of 2 pods needs"):
        render(parse_spec(text), text)
    text = _spec(1).replace("image: registry.example.com/train:1, ", "")
    with pytest.raises(KubernetesError, match=r"kubernetes.image: name the image"):
        render(parse_spec(text), text)


def test_bad_kubernetes_fields_are_spec_errors(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(_spec(1, kubernetes="queue: Team_A, namespace: '', memory: 2 GB"))
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "k8s", "render", str(job)], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 2
    for field in ("kubernetes.queue", "kubernetes.namespace", "kubernetes.memory"):
        assert field in done.stderr, done.stderr


def test_render_command_prints_the_configmap_and_a_valid_jobset(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(_spec(16, 2, "cuda", "queue: research"))
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "k8s", "render", str(job)], capture_output=True, text=True, check=True
    )
    config, jobset = yaml.safe_load_all(done.stdout)
    assert config["kind"] == "ConfigMap" and jobset["kind"] == "JobSet"
    assert not list(jobset_validator().iter_errors(jobset))


def test_submit_without_a_cluster_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    text = _spec(1)
    with pytest.raises(KubernetesError, match="no Kubernetes configuration"):
        submit(render(parse_spec(text), text))
