"""deploy/kubernetes.yaml: a fleet that really syncs (the manifests agree with each other and the code)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import yaml

from lookahead.contract import SYNC_ENV
from lookahead.state.sync import check_url

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes.yaml"


def documents() -> dict[tuple[str, str], dict]:
    loaded = [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in loaded}


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def test_the_manifest_holds_the_fleet_redis_and_their_services() -> None:
    assert set(documents()) == {
        ("Deployment", "lookahead"),
        ("Service", "lookahead"),
        ("Deployment", "lookahead-redis"),
        ("Service", "lookahead-redis"),
    }


def test_every_service_selects_its_deployments_pods_on_declared_ports() -> None:
    docs = documents()
    for name in ("lookahead", "lookahead-redis"):
        deployment, service = docs[("Deployment", name)], docs[("Service", name)]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert service["spec"]["selector"].items() <= labels.items()
        declared = {port["name"] for port in container(deployment)["ports"]}
        assert {port["targetPort"] for port in service["spec"]["ports"]} <= declared


def test_the_replicas_sync_through_the_redis_service() -> None:
    docs = documents()
    fleet = docs[("Deployment", "lookahead")]
    assert fleet["spec"]["replicas"] >= 2
    tritonserver = container(fleet)
    assert tritonserver["image"].startswith("lookahead-triton")  # the README's docker build tag
    env = {item["name"]: item["value"] for item in tritonserver["env"]}
    url = urlsplit(check_url(env[SYNC_ENV]))
    redis_service = docs[("Service", "lookahead-redis")]
    assert url.hostname == redis_service["metadata"]["name"]
    assert url.port in {port["port"] for port in redis_service["spec"]["ports"]}
    assert {port["containerPort"] for port in tritonserver["ports"]} == {8000, 8001, 8002}
    assert tritonserver["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    redis_image = container(docs[("Deployment", "lookahead-redis")])["image"]
    assert redis_image.split(":")[1][0].isdigit()  # a pinned version, never latest
