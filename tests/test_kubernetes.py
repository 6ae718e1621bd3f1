"""deploy/kubernetes renders and validates offline, and its objects fit together.

Every target (the base, each overlay, and engines/: the volumes and the build Job) is rendered by ``kubectl
kustomize`` where kubectl is on PATH, else by a small renderer here that knows exactly the Kustomize features the
manifests use (resources, JSON 6902 patches, images) and refuses any other; where kubectl exists the two renderings
must be equal. The rendered core objects must pass the Kubernetes JSON schemas bundled with ``kubernetes-validate``
(strict: no unknown field), the PodMonitor a schema of its CRD's fields written here. Then the checks a cluster
would only show at run time: GPUs per replica = tensor_parallel + 1, the HPA's target and metric, selectors, probe
and scrape ports, the build Job writing where the servers read, the adapter rule turning the servers' gauge into
the HPA's metric; the OpenAI server's arguments parse and name the model by its hub id; a terminating pod sleeps
in preStop, then drains within its grace period; pods are pinned to the GPU model the engines were built on; a
disruption budget covers them; the PodMonitor carries kube-prometheus-stack's label. Nothing here needs a cluster or
the network.
"""
from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "kubernetes"
SERVING = ["base", *sorted(f"overlays/{path.name}" for path in (DEPLOY / "overlays").iterdir() if path.is_dir())]
TARGETS = [*SERVING, "engines"]        # engines/: the volumes and the build Job
KUBECTL = shutil.which("kubectl")
K8S_VERSIONS = ("1.29", "1.37")        # the oldest Kubernetes the manifests claim, and the newest bundled schema
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "images", "patches"}   # what render_offline implements
WAITING_GAUGE = "ssd_trt:num_requests_waiting"     # what prometheus-adapter turns into the HPA's metric
HEALTH = {"openai": {"readinessProbe": "/health", "livenessProbe": "/health", "startupProbe": "/health"},
          "triton": {"readinessProbe": "/v2/health/ready", "livenessProbe": "/v2/health/live",
                     "startupProbe": "/v2/health/ready"}}
GPU = "nvidia.com/gpu"
GPU_PRODUCT = "nvidia.com/gpu.product"    # GPU feature discovery's label for the GPU model
PROMETHEUS_RELEASE = {"release": "kube-prometheus-stack"}   # what kube-prometheus-stack's Prometheus selects on
SHUTDOWN_SPARE_S = 10                     # after the drain: the last events, the engines' close

jsonpatch = pytest.importorskip("jsonpatch", reason="pip install -e '.[test]' (jsonpatch renders the overlays)")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[test]'")
jsonschema = pytest.importorskip("jsonschema", reason="pip install -e '.[test]' (kubernetes-validate brings it)")


# --- rendering ------------------------------------------------------------------------------------------------

def render_offline(directory: Path) -> list[dict]:
    """``kustomize build`` for the subset the manifests use; anything else is refused, never ignored."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KUSTOMIZATION_KEYS
    assert not unknown, f"{directory}: render_offline does not implement {sorted(unknown)}; extend it or avoid them"
    objects: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        objects += render_offline(path) if path.is_dir() else [o for o in yaml.safe_load_all(path.read_text()) if o]
    for patch in kustomization.get("patches", []):
        assert set(patch) == {"target", "patch"}, f"{directory}: only inline patches with a target: {patch}"
        operations = yaml.safe_load(patch["patch"])
        assert isinstance(operations, list), f"{directory}: only JSON 6902 patches (a list of operations)"
        chosen = [o for o in objects if all(o["metadata"]["name"] == value if key == "name" else o[key] == value
                                            for key, value in patch["target"].items())]
        assert len(chosen) == 1, f"{directory}: patch target {patch['target']} matches {len(chosen)} objects"
        objects[objects.index(chosen[0])] = jsonpatch.apply_patch(chosen[0], operations)
    for image in kustomization.get("images", []):
        for container in (c for o in objects for c in pod_spec(o).get("containers", [])):
            if image_name(container["image"]) == image["name"]:
                tag = image.get("newTag")
                container["image"] = image.get("newName", image["name"]) + (f":{tag}" if tag else "")
    return objects


def image_name(reference: str) -> str:
    """An image reference without its tag and digest (a registry's port is kept)."""
    reference = reference.split("@")[0]
    return re.sub(r":[^/:]+$", "", reference)


@functools.cache
def render(target: str) -> tuple[dict, ...]:
    """The target's objects as kubectl renders them, or the offline renderer where there is no kubectl."""
    return tuple(render_offline(DEPLOY / target) if KUBECTL is None else render_kubectl(target))


def render_kubectl(target: str) -> list[dict]:
    out = subprocess.run([KUBECTL, "kustomize", str(DEPLOY / target)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kubectl kustomize {target}:\n{out.stderr}"
    return [o for o in yaml.safe_load_all(out.stdout) if o]


def by_kind(objects: tuple[dict, ...]) -> dict[str, dict]:
    kinds = [o["kind"] for o in objects]
    assert len(kinds) == len(set(kinds)), f"one object of each kind expected, got {kinds}"
    return {o["kind"]: o for o in objects}


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"] if obj["kind"] in ("Deployment", "Job") else {}


def server(objects: dict[str, dict]) -> dict:
    (container,) = pod_spec(objects["Deployment"])["containers"]
    return container


def frontend(container: dict) -> str:
    return "triton" if "tritonserver" in " ".join(container["args"]) else "openai"


def env(container: dict, name: str) -> str:
    values = [e["value"] for e in container.get("env", []) if e["name"] == name]
    assert len(values) == 1, f"env {name} set {len(values)} times"
    return values[0]


def volume_mounts(obj: dict) -> dict[str, tuple[dict, dict]]:
    """mount path -> (the mount, its volume) of the pod's one container."""
    (container,) = pod_spec(obj)["containers"]
    volumes = {v["name"]: v for v in pod_spec(obj)["volumes"]}
    return {m["mountPath"]: (m, volumes[m["name"]]) for m in container["volumeMounts"]}


def recipe_named(name: str) -> dict:
    for path in sorted((ROOT / "recipes").rglob("*.yaml")):
        recipe = yaml.safe_load(path.read_text())
        if isinstance(recipe, dict) and recipe.get("name") == name:
            return recipe
    raise AssertionError(f"no recipe under recipes/ builds {name!r} (the SSD_TRT_BUILD_DIR's last part)")


@pytest.fixture(params=SERVING)
def rendered(request) -> tuple[str, dict[str, dict]]:
    return request.param, by_kind(render(request.param))


# --- rendering and schemas ------------------------------------------------------------------------------------

@pytest.mark.skipif(KUBECTL is None, reason="kubectl not on PATH: the offline rendering was not compared with "
                                            "kustomize's (the other tests validate the offline rendering)")
@pytest.mark.parametrize("target", TARGETS)
def test_the_offline_renderer_gives_what_kubectl_kustomize_gives(target):
    def key(o):
        return o["apiVersion"], o["kind"], o["metadata"]["name"]
    assert sorted(render_offline(DEPLOY / target), key=key) == sorted(render(target), key=key)


DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
# The PodMonitor fields these manifests may use, typed as in the Prometheus Operator's CRD (monitoring.coreos.com/v1).
POD_MONITOR = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PodMonitor"},
        "metadata": {"type": "object", "additionalProperties": False, "required": ["name"],
                     "properties": {"name": NAME, "namespace": NAME, "labels": STRING_MAP, "annotations": STRING_MAP}},
        "spec": {"type": "object", "additionalProperties": False, "required": ["selector", "podMetricsEndpoints"],
                 "properties": {
                     "selector": {"type": "object", "additionalProperties": False,
                                  "properties": {"matchLabels": STRING_MAP}, "required": ["matchLabels"]},
                     "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
                         "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}},
                     "jobLabel": {"type": "string"},
                     "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                     "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": {
                         "type": "object", "additionalProperties": False, "required": ["port"], "properties": {
                             "port": {"type": "string", "minLength": 1},
                             "path": {"type": "string", "pattern": "^/"},
                             "scheme": {"enum": ["http", "https"]},
                             "interval": {"type": "string", "pattern": DURATION},
                             "scrapeTimeout": {"type": "string", "pattern": DURATION},
                             "honorLabels": {"type": "boolean"}}}}}}}}
CRD_SCHEMAS = {("monitoring.coreos.com/v1", "PodMonitor"): POD_MONITOR}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("target", TARGETS)
def test_rendered_objects_pass_strict_kubernetes_schemas(target, version):
    for obj in render(target):
        schema = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
        try:
            if schema is not None:
                jsonschema.validate(obj, schema)
            else:
                kubernetes_validate.validate(obj, version, strict=True)
        except jsonschema.ValidationError as error:
            where = "/".join(map(str, error.absolute_path))
            pytest.fail(f"{target}: {obj['kind']} {where}: {error.message}", pytrace=False)
        except kubernetes_validate.utils.SchemaNotFoundError as error:
            pytest.fail(f"{target}: {error.message}; add the kind's schema to CRD_SCHEMAS", pytrace=False)


# --- what a cluster would only show at run time ---------------------------------------------------------------

def test_a_replica_requests_one_gpu_per_target_rank_plus_one_for_the_draft(rendered):
    target, objects = rendered
    container = server(objects)
    requests, limits = container["resources"]["requests"], container["resources"]["limits"]
    assert requests[GPU] == limits[GPU], "extended resources: requests must equal limits"
    recipe = recipe_named(PurePosixPath(env(container, "SSD_TRT_BUILD_DIR")).name)
    tensor_parallel = (recipe.get("engine") or {}).get("tensor_parallel", 1)
    assert limits[GPU] == tensor_parallel + 1, f"{target}: {recipe['name']} has tensor_parallel {tensor_parallel}"
    assert limits[GPU] == {"base": 2, "overlays/tp4": 5}.get(target, limits[GPU])
    assert "memory" in requests and "memory" in limits and "cpu" in requests


def test_the_hpa_scales_the_deployment_on_the_adapters_waiting_metric(rendered):
    target, objects = rendered
    hpa, deployment = objects["HorizontalPodAutoscaler"], objects["Deployment"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count; a re-apply must not reset it"
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    assert metric["pods"]["metric"]["name"] in adapter_metric_names()


def test_the_service_and_the_podmonitor_select_the_pods_and_name_their_ports(rendered):
    target, objects = rendered
    deployment, service, monitor = objects["Deployment"], objects["Service"], objects["PodMonitor"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    ports = {p["name"]: p["containerPort"] for p in server(objects)["ports"]}
    for selector in (deployment["spec"]["selector"]["matchLabels"], service["spec"]["selector"],
                     monitor["spec"]["selector"]["matchLabels"]):
        assert selector and selector.items() <= labels.items(), f"{target}: {selector} does not select {labels}"
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in ports, f"{target}: Service port {port['name']} -> no container port"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
    args = " ".join(server(objects)["args"])
    if frontend(server(objects)) == "triton":          # Triton serves its metrics on a port of their own
        assert f"--metrics-port={ports[endpoint['port']]}" in args
    else:
        assert f"--port {ports[endpoint['port']]}" in args


def test_probes_ask_the_frontends_health_endpoints_on_its_http_port(rendered):
    target, objects = rendered
    container = server(objects)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    args = " ".join(container["args"])
    listen = re.search(r"--http-port=(\d+)" if frontend(container) == "triton" else r"--port (\d+)", args)
    assert listen, f"{target}: the server's port is not in its arguments: {args}"
    for probe, path in HEALTH[frontend(container)].items():
        get = container[probe]["httpGet"]
        assert get["path"] == path, f"{target}: {probe}"
        assert ports[get["port"]] == int(listen.group(1)), f"{target}: {probe} on port {get['port']}"


def test_pods_run_non_root_with_shared_memory_and_the_build_mounted_read_only(rendered):
    target, objects = rendered
    spec, container = pod_spec(objects["Deployment"]), server(objects)
    assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    mounts = volume_mounts(objects["Deployment"])
    assert mounts["/dev/shm"][1]["emptyDir"]["medium"] == "Memory"
    build = PurePosixPath(env(container, "SSD_TRT_BUILD_DIR"))
    (build_mount, build_volume) = mounts[str(build.parent)]
    assert build_mount["readOnly"] and build_volume["persistentVolumeClaim"]["readOnly"]
    recipe = recipe_named(build.name)
    if (recipe.get("engine") or {}).get("tensor_parallel", 1) > 1:   # its fallback, the torch backend, reads them
        for role in ("target", "draft"):
            source = PurePosixPath(recipe[role]["source"])
            assert any(source.is_relative_to(path) for path in mounts), f"{target}: {source} is not mounted"


@pytest.mark.parametrize("target", TARGETS[1:])
def test_every_overlay_sets_the_image_from_the_container_build(target):
    (container,) = [c for o in render(target) for c in pod_spec(o).get("containers", [])]
    assert image_name(container["image"]).endswith("/ssd-trt"), container["image"]


def test_the_build_job_writes_the_build_directory_every_server_reads():
    engines = render("engines")
    (job,) = [o for o in engines if o["kind"] == "Job"]
    claims = {o["metadata"]["name"]: o["spec"] for o in engines if o["kind"] == "PersistentVolumeClaim"}
    (container,) = pod_spec(job)["containers"]
    (workdir,) = re.findall(r"^WORKDIR (\S+)$", (ROOT / "build/container/Dockerfile").read_text(), re.MULTILINE)
    assert container["workingDir"] == workdir, "the Job runs in the image's copy of this repository"
    assert container["args"][:3] == ["python3", "-m", "ssd_trt.build"]
    recipe = yaml.safe_load((ROOT / container["args"][-1]).read_text())
    writes = PurePosixPath(workdir, "build")           # python -m ssd_trt.build writes build/<recipe name>/
    job_mount, job_volume = volume_mounts(job)[str(writes)]
    assert not job_mount.get("readOnly")
    assert env(server(by_kind(render("base"))), "SSD_TRT_BUILD_DIR") == str(writes / recipe["name"])
    for target in SERVING:
        deployment = by_kind(render(target))["Deployment"]
        assert PurePosixPath(env(server({"Deployment": deployment}), "SSD_TRT_BUILD_DIR")).parent == writes
        mounts = volume_mounts(deployment)
        assert mounts[str(writes)][1]["persistentVolumeClaim"] == {**job_volume["persistentVolumeClaim"],
                                                                    "readOnly": True}
        for _, volume in mounts.values():         # every claim a server mounts is made here, readable on any node
            if "persistentVolumeClaim" in volume:
                assert "ReadWriteMany" in claims[volume["persistentVolumeClaim"]["claimName"]]["accessModes"]


def openai_arguments(container: dict):
    """The OpenAI server's parsed arguments, $(VAR)s expanded from the container's env as the kubelet does."""
    from ssd_trt.serve.openai.__main__ import parser
    values = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    args = [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], arg) for arg in container["args"]]
    assert args[:3] == ["python3", "-m", "ssd_trt.serve.openai"], args
    return parser().parse_args(args[3:])


def test_the_openai_server_is_named_by_its_targets_hub_id_and_its_arguments_parse(rendered):
    target, objects = rendered
    container = server(objects)
    if frontend(container) == "triton":
        pytest.skip("Triton names the model by its repository")
    args = openai_arguments(container)
    recipe = recipe_named(PurePosixPath(args.build_dir).name)
    hub_id = args.served_model_name[0]
    assert re.fullmatch(r"[\w.-]+/[\w.-]+", hub_id), f"{target}: {hub_id} is not a hub id (org/name)"
    assert hub_id.split("/")[1] == PurePosixPath(recipe["target"]["source"]).name, f"{target}: {hub_id}"


def test_a_terminating_pod_leaves_the_service_then_drains_within_its_grace_period(rendered):
    target, objects = rendered
    spec, container = pod_spec(objects["Deployment"]), server(objects)
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and 0 < int(command[1]) <= 15, command
    if frontend(container) == "openai":
        drain = openai_arguments(container).graceful_timeout
    else:
        drain = int(re.search(r"--exit-timeout-secs=(\d+)", " ".join(container["args"])).group(1))
    assert drain >= 30, f"{target}: --graceful-timeout {drain}s leaves long streams no time to finish"
    assert int(command[1]) + drain + SHUTDOWN_SPARE_S <= spec["terminationGracePeriodSeconds"], target


def gpu_products(obj: dict) -> list[str]:
    """The GPU models a pod may run on (a required node affinity on GPU feature discovery's label)."""
    terms = pod_spec(obj)["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    (term,) = terms
    (expression,) = [e for e in term["matchExpressions"] if e["key"] == GPU_PRODUCT]
    assert expression["operator"] == "In"
    return expression["values"]


def test_servers_run_only_on_the_gpu_model_their_engines_were_built_on(rendered):
    target, objects = rendered
    (product,) = gpu_products(objects["Deployment"])
    assert product.startswith("NVIDIA-"), f"{target}: {product} is not a GPU feature discovery product name"
    (job,) = [o for o in render("engines") if o["kind"] == "Job"]
    if target != "overlays/tp4":            # the 70B engines come from another run of the Job
        assert gpu_products(job) == [product], f"{target}: the build Job runs on another GPU model"


def test_a_disruption_budget_covers_the_servers_without_blocking_node_drains(rendered):
    target, objects = rendered
    budget, hpa = objects["PodDisruptionBudget"], objects["HorizontalPodAutoscaler"]
    labels = objects["Deployment"]["spec"]["template"]["metadata"]["labels"]
    selector = budget["spec"]["selector"]["matchLabels"]
    assert selector and selector.items() <= labels.items(), f"{target}: {selector} does not select {labels}"
    # at the HPA's minimum a drain must still be able to evict one pod
    allowed = budget["spec"].get("maxUnavailable", hpa["spec"]["minReplicas"] - budget["spec"].get("minAvailable", 0))
    assert allowed >= 1, f"{target}: the budget blocks every eviction at {hpa['spec']['minReplicas']} replica(s)"


def test_the_podmonitor_carries_the_label_kube_prometheus_stack_selects(rendered):
    target, objects = rendered
    labels = objects["PodMonitor"]["metadata"]["labels"]
    assert PROMETHEUS_RELEASE.items() <= labels.items(), f"{target}: {labels}"
    assert PROMETHEUS_RELEASE["release"] in (DEPLOY / "README.md").read_text(), "the README names the label"


# --- prometheus-adapter ---------------------------------------------------------------------------------------

def adapter_rules() -> list[dict]:
    values = yaml.safe_load((DEPLOY / "prometheus-adapter" / "values.yaml").read_text())
    return values["rules"]["custom"]


def adapter_metric_names() -> set[str]:
    return {rule["name"]["as"] for rule in adapter_rules()}


def test_the_adapter_rule_maps_the_servers_waiting_gauge_to_the_hpa_metric():
    (rule,) = adapter_rules()
    assert set(rule) <= {"seriesQuery", "seriesFilters", "resources", "name", "metricsQuery"}
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    assert rule["seriesQuery"] == f'{{__name__="{WAITING_GAUGE}",namespace!="",pod!=""}}'
    for placeholder in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
        assert placeholder in rule["metricsQuery"]
    # the adapter's regexps are RE2; this pattern (anchors and literals) means the same in Python
    assert re.sub(rule["name"]["matches"], rule["name"]["as"], WAITING_GAUGE) == "ssd_trt_num_requests_waiting"
    assert ":" not in rule["name"]["as"]


def test_every_frontend_exports_the_gauge_the_adapter_reads():
    """The OpenAI server renders and the Triton backend exports the one catalogue of ssd_trt/serve/metrics.py."""
    from ssd_trt.batching.metrics import EngineMetrics
    from ssd_trt.serve.metrics import ServingMetrics, families
    kinds = {family.name: family.kind for family in families(EngineMetrics(), ServingMetrics())}
    assert kinds.get(WAITING_GAUGE) == "gauge"
    # what routers (the Gateway API inference extension) read beside it, as vLLM's vllm:kv_cache_usage_perc
    assert kinds.get("ssd_trt:kv_cache_usage_perc") == "gauge"
    assert kinds.get("ssd_trt:request_rejected") == "counter"
