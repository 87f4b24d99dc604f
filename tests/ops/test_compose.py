"""compose/: the stack file is valid Compose, wired the way operators expect, and every service
it runs is scraped by Prometheus. No Docker engine and no network: the Compose Specification
schema is vendored in tests/ops/schema (see SOURCE.md there)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose"
SCHEMA = Path(__file__).parent / "schema" / "compose-spec.json"


@pytest.fixture(scope="module")
def stack() -> dict:
    return yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())


def voltserve_services(stack: dict) -> dict[str, dict]:
    return {
        name: svc
        for name, svc in stack["services"].items()
        if "compose/Dockerfile" in str(svc.get("build", {}).get("dockerfile", ""))
    }


def test_compose_file_matches_the_compose_specification(stack: dict) -> None:
    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(stack), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_schema_rejects_a_broken_file(stack: dict) -> None:
    # The validation above must be able to fail: break the file in a random-but-real way.
    import copy
    import random

    broken = copy.deepcopy(stack)
    name = random.choice(sorted(broken["services"]))
    broken["services"][name][random.choice(["ports", "deploy", "depends_on"])] = 12345
    schema = json.loads(SCHEMA.read_text())
    assert list(jsonschema.Draft7Validator(schema).iter_errors(broken))


def test_redis_has_a_password_and_is_not_published(stack: dict) -> None:
    redis = stack["services"]["redis"]
    assert "ports" not in redis, "Redis must not be published to the host"
    cmd = redis["command"]
    assert "--requirepass" in cmd
    password = cmd[cmd.index("--requirepass") + 1]
    assert password.startswith("${VOLTSERVE_REDIS_PASSWORD")
    # Every voltserve service connects with that password.
    for name, svc in voltserve_services(stack).items():
        urls = [a for a in svc["command"] if str(a).startswith("redis://")]
        assert urls and all("${VOLTSERVE_REDIS_PASSWORD" in u for u in urls), name


def test_gateway_published_renderers_replicated_executors_on_gpus(stack: dict) -> None:
    services = stack["services"]
    assert any(str(p).endswith(":8000") for p in services["gateway"]["ports"])
    assert services["renderer"]["deploy"]["replicas"] == 2
    executors = {n: s for n, s in services.items() if s.get("command", [None])[0] == "executor"}
    assert executors, "no executor service"
    gpus = []
    for name, svc in executors.items():
        (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"], name
        gpus += dev["device_ids"]
        assert svc["environment"]["VOLTSERVE_EXECUTOR_ID"] == name
    assert len(gpus) == len(set(gpus)), f"two executors share a GPU: {gpus}"


def test_prometheus_scrapes_every_service(stack: dict) -> None:
    prom = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    targets: set[str] = set()
    for job in jobs.values():
        for sc in job.get("static_configs", []):
            targets |= {t.split(":")[0] for t in sc["targets"]}
        for sd in job.get("dns_sd_configs", []):
            targets |= set(sd["names"])
    for name, svc in voltserve_services(stack).items():
        aliases = set()
        nets = svc.get("networks")
        if isinstance(nets, dict):
            for cfg in nets.values():
                aliases |= set((cfg or {}).get("aliases", []))
        assert name in targets or aliases & targets, f"Prometheus does not scrape {name}"
        cmd = svc["command"]
        if cmd[0] != "gateway":
            assert "--metrics-port=9100" in cmd, f"{name} exposes no /metrics on 9100"


def test_grafana_provisioning_points_at_prometheus_and_the_dashboard() -> None:
    ds = yaml.safe_load((COMPOSE / "grafana/provisioning/datasources/prometheus.yml").read_text())[
        "datasources"
    ][0]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    dash = json.loads((COMPOSE / "grafana/dashboards/voltserve.json").read_text())
    uids = {p["datasource"]["uid"] for p in dash["panels"]}
    assert uids == {ds["uid"]}
    prov = yaml.safe_load((COMPOSE / "grafana/provisioning/dashboards/voltserve.yml").read_text())[
        "providers"
    ][0]
    assert prov["options"]["path"] == "/var/lib/grafana/dashboards"
