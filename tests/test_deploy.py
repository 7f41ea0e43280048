"""deploy/: every command in the compose file and the Kubernetes manifests parses, and every
PAGEDSERVE_* variable they set is a real setting of the right type."""

from __future__ import annotations

from pathlib import Path

import yaml

from config import load_settings
from service.cli import build_parser

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def _containers():
    """(where, command, env) of every pagedserve container in deploy/."""
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    for name, service in compose["services"].items():
        if "command" in service and service["command"][0] == "pagedserve":
            yield f"compose:{name}", service["command"], {k: str(v) for k, v in service["environment"].items()}
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        docs = list(yaml.safe_load_all(path.read_text()))
        config = next(d["data"] for d in docs if d and d["kind"] == "ConfigMap") if path.name == "config.yaml" else None
        if config:
            continue
        for doc in docs:
            if doc["kind"] not in ("Deployment", "StatefulSet"):
                continue
            for container in doc["spec"]["template"]["spec"]["containers"]:
                if container.get("command", [""])[0] == "pagedserve":
                    env = {e["name"]: e.get("value", "from-cluster") for e in container.get("env", [])}
                    yield f"{path.name}:{container['name']}", container["command"], env


def _k8s_config() -> dict[str, str]:
    docs = yaml.safe_load_all((DEPLOY / "kubernetes" / "config.yaml").read_text())
    return next(d["data"] for d in docs if d["kind"] == "ConfigMap")


def test_every_deployed_command_parses_and_its_settings_load():
    seen = []
    for where, command, env in _containers():
        if where.endswith(".yaml:worker") or where.endswith(".yaml:front-door"):
            env = {**_k8s_config(), **env}
            command = [word.replace("$(MODEL_DIR)", env["MODEL_DIR"]) for word in command]
        args = build_parser().parse_args(command[1:])
        settings = load_settings(environ={k: v for k, v in env.items() if k.startswith("PAGEDSERVE_SERVER_") or
                                          k.startswith("PAGEDSERVE_ENGINE_") or k.startswith("PAGEDSERVE_DISTRIBUTED_")})
        assert settings.distributed.discovery_dir == "/var/lib/pagedserve/dynamo", where
        if args.command == "serve":
            assert args.router == "dynamo", where
        seen.append(where)
    assert sorted(seen) == sorted(["compose:worker-1", "compose:worker-2", "compose:worker-3", "compose:front-door",
                                   "workers.yaml:worker", "front-door.yaml:front-door"])
