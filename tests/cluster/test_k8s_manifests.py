"""The KubeRay manifests in k8s/: KubeRay's CRD schemas (closed against misspelt keys) and our own rules.

Schema checks use ../shared/schemas/kuberay and skip when ../shared is absent; the other checks
(pinned images, GPU limits, ClusterIP, the RayJob's entrypoint parsed by the real CLI, the image's
versions against the Makefile and the cluster) always run.
"""

from __future__ import annotations

import copy
import re
import shlex
from functools import cache
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
SHARED = Path(__file__).resolve().parents[3] / "shared"
SCHEMAS = SHARED / "schemas" / "kuberay"
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml"}
# Kinds without a schema here, each checked by hand below.
CORE_KINDS = {("v1", "ConfigMap"), ("v1", "PersistentVolumeClaim")}
# Not in the CRD schema (a plain string there); the values KubeRay's RayJob controller knows.
SUBMISSION_MODES = {"K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"}
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

needs_schemas = pytest.mark.skipif(not SCHEMAS.is_dir(), reason=f"KubeRay CRD schemas not found at {SCHEMAS}")


def _load_docs() -> list[tuple[str, int, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")) + sorted(K8S.glob("*.yml")):
        for i, doc in enumerate(yaml.load_all(path.read_text(), Loader=Loader)):
            if doc is not None:
                docs.append((path.name, i, doc))
    return docs


DOCS = _load_docs()


def _of_kind(kind: str) -> list[dict]:
    return [doc for _, _, doc in DOCS if doc.get("kind") == kind]


def _walk(node, path=()):
    """Every (path, key, value) in a parsed YAML tree."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield path, key, value
            yield from _walk(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, (*path, i))


def _cluster_specs() -> list[tuple[str, dict]]:
    """Every RayCluster spec: RayClusters' own and RayJobs' embedded rayClusterSpec."""
    specs = [(c["metadata"]["name"], c["spec"]) for c in _of_kind("RayCluster")]
    specs += [(j["metadata"]["name"], j["spec"]["rayClusterSpec"]) for j in _of_kind("RayJob")
              if "rayClusterSpec" in j["spec"]]
    return specs


def _groups(spec: dict) -> list[tuple[str, dict]]:
    return [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec.get("workerGroupSpecs", [])]


def _ray_container(group: dict) -> dict:
    return group["template"]["spec"]["containers"][0]  # KubeRay's convention: the Ray container comes first


# -- schemas ----------------------------------------------------------------------------------------
def close_schema(node):
    """Forbid keys a schema does not list, as KubeRay's kubeconform conversion (openapi2jsonschema --strict) does.

    Objects that list ``properties`` and say nothing about extra keys get ``additionalProperties: false``;
    maps (``additionalProperties`` given) and ``x-kubernetes-preserve-unknown-fields`` objects stay open.
    """
    if isinstance(node, dict):
        node = {k: close_schema(v) for k, v in node.items()}
        if ("properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False
        return node
    if isinstance(node, list):
        return [close_schema(v) for v in node]
    return node


@cache
def crd_schema(kind: str, closed: bool = True) -> dict:
    crd = yaml.load((SCHEMAS / CRD_FILES[kind]).read_text(), Loader=Loader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = version["schema"]["openAPIV3Schema"]
    return close_schema(schema) if closed else schema


def schema_errors(doc: dict, closed: bool = True) -> list[str]:
    import jsonschema

    validator = jsonschema.Draft7Validator(crd_schema(doc["kind"], closed))
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(doc)]


def test_k8s_folder_has_the_manifests():
    kinds = {doc.get("kind") for _, _, doc in DOCS}
    assert {"RayCluster", "RayJob", "ConfigMap", "PersistentVolumeClaim"} <= kinds
    assert (K8S / "Dockerfile").is_file() and (K8S / "README.md").is_file()


@needs_schemas
@pytest.mark.parametrize("name,index,doc", DOCS, ids=[f"{n}#{i}" for n, i, _ in DOCS])
def test_manifest_is_valid(name, index, doc):
    kind, api = doc.get("kind"), doc.get("apiVersion")
    if kind in CRD_FILES:
        assert api == "ray.io/v1", f"{name}: {kind} must be ray.io/v1, got {api}"
        errors = schema_errors(doc)
        assert not errors, f"{name} #{index} ({kind}):\n" + "\n".join(errors[:20])
    else:
        assert (api, kind) in CORE_KINDS, f"{name} #{index}: no check for {api} {kind}: add one to this test"
    assert DNS1035.match(doc["metadata"]["name"]), f"{name}: {doc['metadata']['name']!r} is not a DNS-1035 label"


@needs_schemas
def test_closed_schema_rejects_a_misspelt_key():
    (cluster,) = _of_kind("RayCluster")[:1]
    bad = copy.deepcopy(cluster)
    group = bad["spec"]["workerGroupSpecs"][0]
    group["replica"] = group.pop("replicas")
    assert not schema_errors(bad, closed=False), "the raw schema is open: this is why it is closed"
    errors = schema_errors(bad)
    assert any("replica" in e and "Additional properties" in e for e in errors), errors

    nested = copy.deepcopy(cluster)  # deep inside the pod template too
    _ray_container(nested["spec"]["workerGroupSpecs"][0])["resource"] = {"limits": {"nvidia.com/gpu": "1"}}
    assert any("resource" in e for e in schema_errors(nested))

    (job,) = _of_kind("RayJob")[:1]
    bad_job = copy.deepcopy(job)
    bad_job["spec"]["entryPoint"] = bad_job["spec"].pop("entrypoint")
    assert any("entryPoint" in e for e in schema_errors(bad_job))
    wrong_type = copy.deepcopy(cluster)
    wrong_type["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    assert schema_errors(wrong_type)


# -- our rules --------------------------------------------------------------------------------------
def image_problem(image: str) -> str | None:
    """Why ``image`` is not pinned to an exact version, or None."""
    if "@sha256:" in image:
        return None
    last = image.rsplit("/", 1)[-1]  # a registry port (host:5000/...) is not a tag
    if ":" not in last:
        return "untagged (means latest)"
    tag = last.split(":", 1)[1]
    if tag == "latest" or not re.search(r"\d+\.\d+", tag):
        return f"tag {tag!r} is not an exact version"
    return None


@pytest.mark.parametrize("image,problem", [
    ("registry.example.com/headsweep:0.1.0-ray2.60.0", None), ("localhost:5000/headsweep:1.2.3", None),
    ("repo/x@sha256:" + "a" * 64, None), ("headsweep", "untagged"), ("localhost:5000/headsweep", "untagged"),
    ("headsweep:latest", "not an exact"), ("headsweep:stable", "not an exact"),
])
def test_image_rule(image, problem):
    found = image_problem(image)
    assert (found is None) if problem is None else (problem in found)


def test_every_image_is_pinned_and_the_same():
    images = [(name, value) for name, _, doc in DOCS for _, key, value in _walk(doc) if key == "image"]
    assert images, "no images found"
    for name, image in images:
        assert image_problem(image) is None, f"{name}: image {image}: {image_problem(image)}"
    # Head, workers and submitter must run the same code and Ray.
    assert len({image for _, image in images}) == 1, images


def test_gpu_worker_group_has_gpu_limits():
    for cluster, spec in _cluster_specs():
        gpu_groups = []
        for name, group in _groups(spec)[1:]:
            resources = _ray_container(group).get("resources", {})
            limit = resources.get("limits", {}).get("nvidia.com/gpu")
            if limit is not None:
                assert int(limit) >= 1, f"{cluster}/{name}: nvidia.com/gpu limit {limit}"
                request = resources.get("requests", {}).get("nvidia.com/gpu", limit)
                assert str(request) == str(limit), f"{cluster}/{name}: GPU requests must equal limits"
                assert "num-gpus" not in group.get("rayStartParams", {}), "let Ray read the GPU count from the limit"
                gpu_groups.append(name)
        assert gpu_groups, f"{cluster}: no worker group with an nvidia.com/gpu limit"
        head = _ray_container(spec["headGroupSpec"]).get("resources", {})
        assert "nvidia.com/gpu" not in head.get("limits", {}), f"{cluster}: the head is a CPU pod"


def test_every_ray_container_has_cpu_and_memory_limits():
    for cluster, spec in _cluster_specs():
        for name, group in _groups(spec):
            resources = _ray_container(group).get("resources", {})
            for what in ("cpu", "memory"):
                assert what in resources.get("limits", {}), f"{cluster}/{name}: no {what} limit"
            # KubeRay refuses a group with both rayStartParams resources and the group-level `resources` field.
            params = group.get("rayStartParams", {})
            assert not (group.get("resources") and {"num-cpus", "num-gpus", "memory", "resources"} & set(params))


def test_services_are_cluster_ip_only():
    for _, _, doc in DOCS:
        for path, key, value in _walk(doc):
            if key == "serviceType":
                assert value == "ClusterIP", f"{'.'.join(map(str, path))}.serviceType is {value}"
            if key == "type" and path and path[-1] == "spec" and "headService" in path:
                assert value == "ClusterIP", f"headService type {value}"
            assert not (key == "enableIngress" and value), "no Ingress in front of the job API"
        if doc.get("kind") == "Service":
            assert doc.get("spec", {}).get("type", "ClusterIP") == "ClusterIP"
    for cluster, spec in _cluster_specs():
        assert spec["headGroupSpec"].get("serviceType") == "ClusterIP", f"{cluster}: say ClusterIP explicitly"


def test_token_auth_and_ray_version():
    dockerfile = (K8S / "Dockerfile").read_text()
    (ray_version,) = re.findall(r"^ARG RAY_VERSION=(\S+)$", dockerfile, re.M)
    for cluster, spec in _cluster_specs():
        assert spec.get("rayVersion") == ray_version, f"{cluster}: rayVersion must equal the image's Ray"
        auth = spec.get("authOptions", {})
        assert auth.get("mode") == "token", f"{cluster}: token auth off"
        # KubeRay refuses token auth below Ray 2.52.0.
        assert tuple(int(x) for x in ray_version.split(".")[:2]) >= (2, 52)


def _shared_mounts(group: dict) -> dict[str, str]:
    """mountPath -> claimName of the PVCs mounted in a group's Ray container."""
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
              for v in group["template"]["spec"].get("volumes", []) if "persistentVolumeClaim" in v}
    return {m["mountPath"]: claims[m["name"]] for m in _ray_container(group).get("volumeMounts", [])
            if m["name"] in claims}


def _on_shared_storage(store: str, group: dict) -> bool:
    rwx = {p["metadata"]["name"] for p in _of_kind("PersistentVolumeClaim")
           if "ReadWriteMany" in p["spec"]["accessModes"]}
    if "://" in store:
        return True
    return any(store == m or store.startswith(m.rstrip("/") + "/")
               for m, claim in _shared_mounts(group).items() if claim in rwx)


def test_store_is_on_shared_storage_in_every_pod():
    for cluster, spec in _cluster_specs():
        for name, group in _groups(spec):
            env = {e["name"]: e.get("value") for e in _ray_container(group).get("env", [])}
            assert "HEADSWEEP_STORE" in env, f"{cluster}/{name}: HEADSWEEP_STORE unset"
            assert _on_shared_storage(env["HEADSWEEP_STORE"], group), f"{cluster}/{name}: store not on a RWX volume"
    for pvc in _of_kind("PersistentVolumeClaim"):
        assert "storage" in pvc["spec"]["resources"]["requests"]


def test_rayjob_runs_headsweep_on_a_known_cluster_with_a_mounted_config():
    from headsweep.sweep.configuration.config import build_config
    from headsweep.sweep.terminal.cli import build_parser

    jobs = _of_kind("RayJob")
    assert jobs
    clusters = {c["metadata"]["name"]: c["spec"] for c in _of_kind("RayCluster")}
    configmaps = {c["metadata"]["name"]: c.get("data", {}) for c in _of_kind("ConfigMap")}
    for job in jobs:
        spec, name = job["spec"], job["metadata"]["name"]
        assert spec.get("submissionMode", "K8sJobMode") in SUBMISSION_MODES, spec.get("submissionMode")
        if "clusterSelector" in spec:
            target = spec["clusterSelector"].get("ray.io/cluster")
            assert target in clusters, f"{name}: clusterSelector names no RayCluster in k8s/ ({target})"
            assert spec.get("submissionMode") != "SidecarMode", "KubeRay refuses clusterSelector in SidecarMode"
            cluster = clusters[target]
        else:
            cluster = spec["rayClusterSpec"]

        argv = shlex.split(spec["entrypoint"])
        assert argv[:2] == ["headsweep", "run"], f"{name}: entrypoint must call headsweep run: {argv}"
        try:
            args = build_parser().parse_args(argv[1:])  # the real CLI accepts these arguments
        except SystemExit as exc:
            pytest.fail(f"{name}: `headsweep` rejects {argv[1:]} (exit {exc.code})")
        assert args.address == "auto", "inside a Ray job the driver must join the cluster: --address auto"
        head = cluster["headGroupSpec"]
        assert _on_shared_storage(args.store, head), f"{name}: --store {args.store} is not on shared storage"

        # The config file is a key of a ConfigMap that the head (where the job's driver runs) mounts.
        mounts = {m["name"]: m["mountPath"] for m in _ray_container(head).get("volumeMounts", [])}
        config_maps = {v["name"]: v["configMap"]["name"] for v in head["template"]["spec"].get("volumes", [])
                       if "configMap" in v}
        folder, file = args.config.rsplit("/", 1)
        (volume,) = [v for v, path in mounts.items() if path == folder and v in config_maps] or [None]
        assert volume, f"{name}: the head mounts no ConfigMap at {folder}"
        data = configmaps.get(config_maps[volume])
        assert data is not None and file in data, f"{name}: ConfigMap {config_maps[volume]} in k8s/ has no {file}"
        # The config itself passes headsweep's strict validation (unknown keys, experiment names, ...).
        cfg = build_config(yaml.safe_load(data[file]))
        assert cfg.model.path.startswith("/"), "cluster configs name models by absolute path on the shared volume"
        if cfg.sweep.num_gpus_per_worker:
            gpu_groups = [g for _, g in _groups(cluster)[1:]
                          if "nvidia.com/gpu" in _ray_container(g).get("resources", {}).get("limits", {})]
            assert cfg.sweep.workers <= sum(g.get("maxReplicas", g.get("replicas", 1)) for g in gpu_groups)


def test_dockerfile_pins_what_the_makefile_installs():
    dockerfile = (K8S / "Dockerfile").read_text()
    makefile = (REPO / "Makefile").read_text()
    bases = re.findall(r"^FROM\s+(\S+)", dockerfile, re.M)
    assert bases and all(image_problem(b) is None for b in bases), bases
    assert re.fullmatch(r"python:3\.11\.\d+-slim(-\w+)?", bases[0]), f"base {bases[0]}: python 3.11 slim, exact patch"

    (torch_spec,) = re.findall(r"^TORCH_SPEC \?= (\S+)$", makefile, re.M)
    (fairseq_spec,) = re.findall(r"^FAIRSEQ_SPEC \?= (\S+)$", makefile, re.M)
    (torch_version,) = re.findall(r"^ARG TORCH_VERSION=(\S+)$", dockerfile, re.M)
    assert torch_spec == f"torch=={torch_version}"
    assert f"ARG FAIRSEQ_SPEC={fairseq_spec}" in dockerfile
    runs = " ".join(re.findall(r"^RUN (.*?)(?<!\\)$", dockerfile, re.M | re.S)).replace("\\\n", " ")
    project = runs.index('pip install ".[fairseq]"')
    fairseq = runs.index('pip install --no-deps --no-build-isolation "${FAIRSEQ_SPEC}"')
    assert runs.index('"torch==${TORCH_VERSION}"') < project < fairseq, "torch, then the project, then fairseq"
    assert '"ray[default,tune]==${RAY_VERSION}"' in runs, "Ray pinned to the cluster's version, with the job API"
    assert "latest" not in dockerfile.lower()
    assert re.search(r"^USER\s+1000$", dockerfile, re.M), "the image runs as the uid of the pods' securityContext"
    # `headsweep` and every top-level folder it links to (headsweep/sweep -> ../sweep, ...) are in the image.
    linked = [entry.resolve().relative_to(REPO).as_posix() for entry in (REPO / "headsweep").iterdir()
              if entry.is_symlink()]
    assert len(linked) >= 3, linked
    for folder in ["headsweep", *linked]:
        assert re.search(rf"^COPY {folder} \./{folder}$", dockerfile, re.M), f"the image lacks {folder}/"
    assert "PIP_CONSTRAINT=/opt/headsweep/constraints.txt" in dockerfile and "constraints.txt" in dockerfile


def test_readme_covers_building_submitting_and_security():
    text = (K8S / "README.md").read_text()
    for needle in ("docker build -f k8s/Dockerfile", "kubectl port-forward", "headsweep submit", "--address http://",
                   "rayjob.yaml", "ReadWriteMany", "s3://", "ClusterIP", "RAY_AUTH_TOKEN"):
        assert needle in text, needle
