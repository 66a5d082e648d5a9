"""deploy/: the Kubernetes manifests and the Grafana dashboard, checked offline.

Every manifest validates (strict: no unknown fields) against the Kubernetes OpenAPI schemas
that `kubernetes-validate` ships; the probes, RBAC and discovery flags say what
deploy/README.md says; the commands the pods run parse with our own CLIs; every panel of
the dashboard queries only metric names from the list below, and each name is shown.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="in the test extra")

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
K8S = DEPLOY / "kubernetes"
# The newest minor whose schemas kubernetes-validate ships for every kind used here, and old
# enough to be what most clusters run (apps.kubernetes.io/pod-index needs 1.28).
K8S_VERSION = "1.30"

WORKER_METRICS = {
    "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate",
    "sglang:gen_throughput", "sglang:time_to_first_token_seconds_bucket",
    "sglang:inter_token_latency_seconds_bucket",
}
ROUTER_METRICS = {
    "sgl_router_requests_total", "sgl_router_request_duration_seconds_bucket", "sgl_router_retries_total",
    "sgl_router_worker_in_flight", "sgl_router_worker_requests_total", "sgl_router_cache_hits",
    "sgl_router_cache_misses", "sgl_router_circuit_state", "sgl_router_workers", "sgl_router_healthy_workers",
    "sgl_router_worker_healthy", "sgl_router_admission_active", "sgl_router_admission_queued",
    "sgl_router_admission_rejected_total", "sgl_router_tree_size",
}


def manifests() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        out += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


def by_kind(kind: str, name: str | None = None) -> dict:
    found = [d for _, d in manifests() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


@pytest.mark.parametrize("name,doc", manifests(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_manifest_validates_against_the_kubernetes_schema(name: str, doc: dict):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_kustomization_lists_every_manifest():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert kust["namespace"] == by_kind("Namespace")["metadata"]["name"]


def test_a_broken_manifest_is_rejected():  # the validator is not vacuous
    sts = json.loads(json.dumps(by_kind("StatefulSet")))
    sts["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, K8S_VERSION, strict=True)


def _container(doc: dict) -> dict:
    (c,) = doc["spec"]["template"]["spec"]["containers"]
    return c


def test_worker_probes_ports_and_selector():
    sts = by_kind("StatefulSet", "sgl-worker")
    c = _container(sts)
    assert c["readinessProbe"]["httpGet"]["path"] == "/health_generate"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == 30000
    assert all(c[p]["httpGet"]["port"] == "http" for p in ("readinessProbe", "livenessProbe", "startupProbe"))
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    svc = by_kind("Service", "sgl-worker")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"].items() <= labels.items()
    assert sts["spec"]["serviceName"] == "sgl-worker"
    assert c["resources"]["requests"]["memory"] and c["resources"]["limits"]["memory"]


def test_router_may_get_list_and_watch_pods_through_its_service_account():
    role = by_kind("Role")
    (rule,) = role["rules"]
    assert rule["apiGroups"] == [""] and rule["resources"] == ["pods"]
    assert {"list", "watch"} <= set(rule["verbs"])
    binding = by_kind("RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    sa = by_kind("ServiceAccount")
    assert {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "sgl"} in binding["subjects"]
    router = by_kind("Deployment", "sgl-router")
    assert router["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    svc = by_kind("Service", "sgl-router")
    assert svc["spec"]["selector"].items() <= router["spec"]["template"]["metadata"]["labels"].items()


def _config() -> dict:
    return by_kind("ConfigMap", "sgl-config")["data"]


def _shell_command(container: dict, env: dict[str, str]) -> list[str]:
    """The argv `sh -c` will exec: $(VAR) is Kubernetes', $VAR the shell's (word-split)."""
    sh, flag, script = container["command"]
    assert (sh, flag) == ("sh", "-c")
    script = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], script)
    script = re.sub(r"\$(\w+)", lambda m: env[m.group(1)], script)
    argv = shlex.split(script)
    assert argv[0] == "exec"
    return argv[1:]


def test_router_command_parses_with_the_router_cli_and_discovers_the_workers():
    launch_router = pytest.importorskip("sgl.launch_router", reason="the router is on another branch")
    c = _container(by_kind("Deployment", "sgl-router"))
    argv = _shell_command(c, {"NAMESPACE": "sgl", "ROUTER_ARGS": _config()["router-args"]})
    assert argv[:3] == ["python", "-m", "sgl.launch_router"]
    args = launch_router.build_parser().parse_args(argv[3:])
    worker = by_kind("StatefulSet", "sgl-worker")
    assert args.service_discovery and args.policy == "kv_aware"
    assert [f"{k}={v}" for k, v in worker["spec"]["selector"]["matchLabels"].items()] == args.selector
    assert args.service_discovery_namespace == "sgl"
    assert args.service_discovery_port == 30000
    env = {e["name"]: e.get("valueFrom", {}) for e in c["env"]}
    assert env["NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}


def test_worker_command_parses_with_the_server_cli():
    from sgl.launch_server import build_parser

    c = _container(by_kind("StatefulSet", "sgl-worker"))
    argv = _shell_command(c, {"WORKER_ARGS": _config()["worker-args"]})
    assert argv[:3] == ["python", "-m", "sgl.launch_server"]
    args = build_parser().parse_args(argv[3:])
    assert (args.host, args.port, args.dp_size) == ("0.0.0.0", 30000, 1)
    json.loads(_config()["kv-events-config"])  # read by the engine from SGL_KV_EVENTS_CONFIG
    assert {e["name"] for e in c["env"]} >= {"WORKER_ARGS", "SGL_KV_EVENTS_CONFIG"}


# -- the Grafana dashboard ---------------------------------------------------------------

DASHBOARD = DEPLOY / "grafana" / "sgl-dashboard.json"
METRIC = re.compile(r"\b(sglang:[a-z_:]+|sgl_router_[a-z_]+)")


def _panels() -> list[dict]:
    dash = json.loads(DASHBOARD.read_text())
    return [p for p in dash["panels"] if p["type"] != "row"]


def test_dashboard_has_a_datasource_variable_used_by_every_panel():
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in _panels():
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]


def test_every_panel_queries_known_metrics_and_every_metric_is_shown():
    shown: set[str] = set()
    for p in _panels():
        for t in p["targets"]:
            names = set(METRIC.findall(t["expr"]))
            assert names, (p["title"], t["expr"])
            assert names <= WORKER_METRICS | ROUTER_METRICS, (p["title"], names - WORKER_METRICS - ROUTER_METRICS)
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            shown |= names
    assert shown == WORKER_METRICS | ROUTER_METRICS


def test_dashboard_panels_do_not_overlap():
    cells: set[tuple[int, int]] = set()
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, p["title"]
        cells |= mine
