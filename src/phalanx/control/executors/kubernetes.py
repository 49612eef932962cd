"""A job as Kubernetes objects: a ConfigMap with its spec and a JobSet (jobset.x-k8s.io/v1alpha2) of one
replicated job whose nodes + spare_nodes indexed pods each run a ``phalanx agent``, the pod of index 0 being
node 0 and hosting the rendezvous. JobSet's network settings make the headless service that gives each pod
a DNS name (``<jobset>-node-0-0.<jobset>``); Kueue admits the JobSet when a queue is named.

A pod that fails fails its Job (``backoffLimit: 0``), and JobSet then restarts every pod, up to the job's
restart budget (``failurePolicy.maxRestarts``): the job resumes from its last checkpoint, which is why the
checkpoint directory defaults to one on the shared volume that outlives the pods. Submitting goes through
the official ``kubernetes`` client. This executor has not run against a live cluster (docs/clusters.md)."""

from __future__ import annotations

import re
from typing import Any

import yaml

from phalanx.spec import JobSpec, dump_spec, parse_spec

GROUP, VERSION, PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
RDZV_PORT = 29400  # every pod has its own network namespace: a fixed port is free
SPEC_DIR = "/etc/phalanx"
REPLICATED_JOB = "node"

Manifest = dict[str, Any]


class KubernetesError(RuntimeError):
    """The job cannot be rendered for Kubernetes, or the API refused it; the message says which and why."""


def object_name(spec: JobSpec) -> str:
    """The JobSet's name: the job's, as a DNS label short enough for its pods' host names."""
    name = re.sub(r"[^a-z0-9-]+", "-", spec.name.lower()).strip("-")[:40].rstrip("-")
    if not name or not name[0].isalpha():
        name = f"job-{name}".rstrip("-")
    return name


def render(spec: JobSpec, spec_text: str) -> list[Manifest]:
    """The ConfigMap and the JobSet that run ``spec`` (``spec_text`` is its YAML, as written)."""
    k8s, res = spec.kubernetes, spec.resources
    nodes = res.nodes + res.spare_nodes
    if nodes > 1 and k8s.runs_claim is None:
        raise KubernetesError(
            f"kubernetes.runs_claim: a job of {nodes} pods needs a ReadWriteMany PersistentVolumeClaim that every pod "
            "mounts (run directories and checkpoints are shared); name one"
        )
    if k8s.image is None:
        raise KubernetesError("kubernetes.image: name the image the pods run (phalanx, torch, the job's code)")
    name, ns = object_name(spec), k8s.namespace
    if spec.checkpoint.dir is None and k8s.runs_claim is not None:  # outlives the pods: a restart resumes from it
        checkpoint = spec.checkpoint.model_copy(update={"dir": f"{k8s.runs_path}/{spec.name}/checkpoints"})
        spec_text = dump_spec(spec.model_copy(update={"checkpoint": checkpoint}))
    parse_spec(spec_text, source="the rendered spec")  # what the pods will read must load
    labels = {"app.kubernetes.io/managed-by": "phalanx", "phalanx.dev/job": name}
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-spec", "namespace": ns, "labels": labels},
        "data": {"job.yaml": spec_text},
    }
    head = f"{name}-{REPLICATED_JOB}-0-0.{name}"
    start = (
        'if [ "$PHALANX_NODE_RANK" = 0 ]; then rdzv="$POD_IP"; else rdzv=' + head + "; fi; "
        f'exec python -m phalanx agent {SPEC_DIR}/job.yaml --rdzv "$rdzv:{RDZV_PORT}" '
        f'--node-rank "$PHALANX_NODE_RANK" --addr "$POD_IP" --runs-dir {k8s.runs_path}'
    )
    limits: dict[str, Any] = {}
    if res.device == "cuda":
        limits[k8s.gpu_resource] = res.procs_per_node
    if k8s.cpu is not None:
        limits["cpu"] = k8s.cpu
    if k8s.memory is not None:
        limits["memory"] = k8s.memory
    container = {
        "name": "agent",
        "image": k8s.image,
        "command": ["/bin/sh", "-c", start],
        "env": [
            _field_env("PHALANX_NODE_RANK", "metadata.annotations['batch.kubernetes.io/job-completion-index']"),
            _field_env("POD_IP", "status.podIP"),
        ],
        "ports": [{"name": "rendezvous", "containerPort": RDZV_PORT}],
        "resources": {"limits": limits, "requests": dict(limits)} if limits else {},
        "volumeMounts": [
            {"name": "spec", "mountPath": SPEC_DIR, "readOnly": True},
            {"name": "runs", "mountPath": k8s.runs_path},
            {"name": "shm", "mountPath": "/dev/shm"},  # torch's shared memory: the default 64 MiB is too little
        ],
    }
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": [
            {"name": "spec", "configMap": {"name": f"{name}-spec"}},
            {"name": "runs", **_runs_volume(k8s.runs_claim)},
            {"name": "shm", "emptyDir": {"medium": "Memory"}},
        ],
        **({"nodeSelector": k8s.node_selector} if k8s.node_selector else {}),
        **({"priorityClassName": k8s.priority_class} if k8s.priority_class else {}),
        **({"serviceAccountName": k8s.service_account} if k8s.service_account else {}),
    }
    jobset = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "JobSet",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": {**labels, **({"kueue.x-k8s.io/queue-name": k8s.queue} if k8s.queue else {})},
        },
        "spec": {
            "network": {"enableDNSHostnames": True, "subdomain": name, "publishNotReadyAddresses": True},
            "failurePolicy": {"maxRestarts": spec.resilience.max_restarts},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [REPLICATED_JOB]},
            "replicatedJobs": [
                {
                    "name": REPLICATED_JOB,
                    "replicas": 1,
                    "template": {
                        "spec": {
                            "completionMode": "Indexed",
                            "parallelism": nodes,
                            "completions": nodes,
                            "backoffLimit": 0,
                            "template": {"metadata": {"labels": labels}, "spec": pod},
                        }
                    },
                }
            ],
        },
    }
    return [config, jobset]


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _runs_volume(claim: str | None) -> dict[str, Any]:
    return {"persistentVolumeClaim": {"claimName": claim}} if claim else {"emptyDir": {}}


def to_yaml(manifests: list[Manifest]) -> str:
    return yaml.safe_dump_all(manifests, sort_keys=False)


def submit(manifests: list[Manifest], context: str | None = None) -> list[str]:
    """Create the manifests through the API server of the kubeconfig (or of the pod this runs in); their names."""
    try:
        from kubernetes import client, config
        from kubernetes.client.exceptions import ApiException
        from kubernetes.config.config_exception import ConfigException
    except ImportError:
        raise KubernetesError("submitting needs the kubernetes client: pip install 'phalanx[kubernetes]'") from None
    try:
        try:
            config.load_kube_config(context=context)
        except (ConfigException, FileNotFoundError):
            config.load_incluster_config()
    except ConfigException as e:
        raise KubernetesError(f"no Kubernetes configuration (kubeconfig or in-cluster): {e}") from None
    api = client.ApiClient()
    created = []
    try:
        for manifest in manifests:
            ns, kind = manifest["metadata"]["namespace"], manifest["kind"]
            if kind == "ConfigMap":
                client.CoreV1Api(api).create_namespaced_config_map(ns, manifest)
            else:
                client.CustomObjectsApi(api).create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, manifest)
            created.append(f"{kind} {ns}/{manifest['metadata']['name']}")
    except ApiException as e:
        raise KubernetesError(
            f"the API server refused {kind} {manifest['metadata']['name']}: {e.reason} {e.body}"
        ) from None
    return created
