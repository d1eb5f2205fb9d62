"""Deployment files: the compose topology and Dockerfile targets are what the code accepts,
and the same topology runs as local processes configured only through the environment."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from client.launcher import start_service
from cli import build_parser
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = "/models"


class _Reset:
    """Compose's `!reset` tag: the override removes the key."""


class _ComposeLoader(yaml.SafeLoader):
    pass


_ComposeLoader.add_constructor("!reset", lambda loader, node: _Reset())


def _load(name: str) -> dict:
    with open(ROOT / name, encoding="utf-8") as f:
        return yaml.load(f, Loader=_ComposeLoader)  # noqa: S506 - a SafeLoader subclass


def _merge(base, override):
    """Compose's merge of an override file, as far as these files use it."""
    if isinstance(override, _Reset):
        return None
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            merged = _merge(base.get(key), value)
            if merged is None and isinstance(value, _Reset):
                out.pop(key, None)
            else:
                out[key] = merged
        return out
    return override


@pytest.fixture(scope="module")
def compose() -> dict:
    return _load("docker-compose.yml")


@pytest.fixture(scope="module")
def compose_cpu(compose) -> dict:
    return _merge(compose, _load("docker-compose.cpu.yml"))


def _service_argv(service: dict) -> list[str]:
    """argv after the image's `specdec` entrypoint."""
    entrypoint = service.get("entrypoint", ["specdec"])
    assert entrypoint == ["specdec"], entrypoint
    return list(service["command"])


def _parse(argv: list[str], env: dict[str, str], monkeypatch):
    """Parse argv exactly as the container's `specdec` would, with its environment."""
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse rejected it
        raise AssertionError(f"`specdec {' '.join(argv)}` is not accepted by the cli: exit {exc.code}") from None
    finally:
        for key in env:
            monkeypatch.delenv(key)


def _interpolate(env: dict) -> dict[str, str]:
    """Compose's `${VAR:-default}` with VAR unset: the default."""
    return {k: re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(v)) for k, v in env.items()}


def test_compose_has_drafter_verifier_gateway_and_a_loadgen_profile(compose):
    assert set(compose["services"]) == {"drafter", "verifier", "gateway", "loadgen"}
    for name in ("drafter", "verifier", "gateway"):
        assert "profiles" not in compose["services"][name], name
    assert compose["services"]["loadgen"]["profiles"] == ["loadgen"]
    healthy = {"drafter": {"condition": "service_healthy"}, "verifier": {"condition": "service_healthy"}}
    assert compose["services"]["loadgen"]["depends_on"] == healthy
    assert compose["services"]["gateway"]["depends_on"] == healthy


def test_the_command_line_beats_the_environment_and_an_empty_variable_is_unset(monkeypatch):
    """A flag given on the command line replaces its $SPECDEC_* default (the gateway's
    --verifier was added to $SPECDEC_GATEWAY_VERIFIER's as a pool of both); an empty variable,
    compose's `${VAR:-}`, leaves the flag at its default (it became None, past the flag's type:
    --grace-s None drained nothing, --max-sessions None crashed after the model load)."""
    env = {"SPECDEC_GATEWAY_VERIFIER": "10.0.0.1:50052", "SPECDEC_GATEWAY_GRACE_S": "",
           "SPECDEC_GATEWAY_TIMEOUT_S": "", "SPECDEC_GRACE_S": "", "SPECDEC_MAX_SESSIONS": ""}
    gateway = _parse(["gateway", "--verifier", "127.0.0.1:50052", "--verifier", "127.0.0.1:50053"], env, monkeypatch)
    assert gateway.verifier == "127.0.0.1:50052,127.0.0.1:50053"
    assert (gateway.grace_s, gateway.timeout_s) == (5.0, 60.0)
    assert _parse(["gateway"], env, monkeypatch).verifier == "10.0.0.1:50052"  # the environment's, alone
    verifier = _parse(["verifier"], env, monkeypatch)
    defaults = build_parser().parse_args(["verifier"])
    assert (verifier.grace_s, verifier.max_sessions) == (defaults.grace_s, defaults.max_sessions)
    assert verifier.grace_s is not None
    # Python's own level names, any case: uvicorn took no "warn" (a KeyError traceback at start)
    assert _parse(["gateway", "--log-level", "warn"], env, monkeypatch).log_level == "WARNING"
    assert _parse(["verifier", "--log-level", "Fatal"], env, monkeypatch).log_level == "CRITICAL"


def test_compose_gateway_config_is_what_the_cli_parses(compose, monkeypatch):
    service = compose["services"]["gateway"]
    env = _interpolate(service["environment"])
    args = _parse(_service_argv(service), env, monkeypatch)
    assert args.command == "gateway"
    assert (args.host, args.port) == ("0.0.0.0", 8000)
    assert (args.verifier, args.drafter) == ("verifier:50052", "drafter:50051")  # the service names
    assert args.num_speculative_tokens == "auto" and args.api_key is None  # no key unless GATEWAY_API_KEY is set
    unknown = [k for k in env if k != "SPECDEC_CACHE"
               and not (k.startswith("SPECDEC_GATEWAY_") and hasattr(args, k.removeprefix("SPECDEC_GATEWAY_").lower()))]
    assert not unknown, f"{unknown} name no flag of `specdec gateway`"
    assert float(service["stop_grace_period"].rstrip("s")) > args.grace_s
    assert f"{args.port}:{args.port}" in service["ports"]
    assert "deploy" not in service  # no GPU


def test_compose_gateway_healthcheck_is_an_http_check_of_its_health(compose, monkeypatch):
    service = compose["services"]["gateway"]
    test = service["healthcheck"]["test"]
    assert test[:2] == ["CMD", "specdec"]
    args = _parse(test[2:], {}, monkeypatch)
    port = _parse(_service_argv(service), _interpolate(service["environment"]), monkeypatch).port
    assert args.command == "health" and args.url == f"http://127.0.0.1:{port}/health"


@pytest.mark.parametrize("role,port", [("drafter", 50051), ("verifier", 50052)])
def test_compose_service_config_is_what_the_cli_parses(compose, monkeypatch, role, port):
    service = compose["services"][role]
    env = service["environment"]
    args = _parse(_service_argv(service), env, monkeypatch)
    assert args.command == role
    assert (args.host, args.port, args.device, args.metrics_port) == ("0.0.0.0", port, "cuda", 9100)
    # The drafter keeps its default dtype (float16; int4 under --quantize auto on a bfloat16 CPU,
    # which an explicit dtype would turn off in the CPU override).
    assert args.dtype == {"drafter": None, "verifier": "float32"}[role]
    assert args.grace_s == 20.0 and args.max_draft_tokens == 16
    # Every SPECDEC_* variable but the cache dir names a real flag of the service.
    unknown = [k for k in env if k != "SPECDEC_CACHE" and not hasattr(args, k.removeprefix("SPECDEC_").lower())]
    assert not unknown, f"{unknown} name no flag of `specdec {role}`"
    # docker must not SIGKILL before the drain (SPECDEC_GRACE_S) is over.
    assert float(service["stop_grace_period"].rstrip("s")) > args.grace_s
    assert f"{port}:{port}" in service["ports"]


@pytest.mark.parametrize("role,port", [("drafter", 50051), ("verifier", 50052)])
def test_compose_healthcheck_is_a_grpc_health_check_of_the_service(compose, monkeypatch, role, port):
    test = compose["services"][role]["healthcheck"]["test"]
    assert test[:2] == ["CMD", "specdec"]
    args = _parse(test[2:], {}, monkeypatch)
    assert args.command == "health" and args.address == f"127.0.0.1:{port}"
    assert compose["services"][role]["healthcheck"]["start_period"]  # first start converts the model


def test_the_healthcheck_command_imports_no_torch():
    """Run every few seconds in the container of a busy service, within compose's 5 s timeout:
    importing torch alone took 7-13 s on a loaded 2-core host."""
    code = ("import sys, cli; rc = cli.main(['health', '--address', '127.0.0.1:1', '--timeout-s', '0.2']); "
            "print(rc, 'torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["1", "False", "False"], (out.stdout, out.stderr)


@pytest.mark.parametrize("role,gpu", [("drafter", "${DRAFTER_GPU:-0}"), ("verifier", "${VERIFIER_GPU:-1}")])
def test_compose_reserves_one_gpu_per_service(compose, role, gpu):
    devices = compose["services"][role]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "device_ids": [gpu], "capabilities": ["gpu"]}]
    assert compose["services"][role]["build"]["target"] == "cuda"


def test_compose_mounts_the_model_cache_volume_at_specdec_cache(compose):
    assert "model-cache" in compose["volumes"]
    for name, service in compose["services"].items():
        assert f"model-cache:{CACHE_DIR}" in service["volumes"], name
        # every service, loadgen too (its own list replaces the anchor's): bench loads the tokenizer
        # of a VERIFIER_MODEL=/models/user/<folder> from there
        assert "${MODELS_DIR:-./models}:/models/user:ro" in service["volumes"], name
        assert service["environment"]["SPECDEC_CACHE"] == CACHE_DIR, name


def test_compose_loadgen_runs_bench_serve_against_the_service_names(compose, monkeypatch, tmp_path):
    service = compose["services"]["loadgen"]
    assert "deploy" not in service  # a client: no GPU
    mount = next(v.split(":")[1] for v in service["volumes"] if v.startswith("./results:"))
    # In the container the bind mount is there (and --result-json checks its directory): here, tmp_path.
    argv = [a.replace(mount, str(tmp_path)) for a in _service_argv(service)]
    args = _parse(argv, service["environment"], monkeypatch)
    assert (args.command, args.bench_command) == ("bench", "serve")
    assert (args.drafter, args.verifier) == ("drafter:50051", "verifier:50052")
    assert args.result_json == str(tmp_path / "serve.json")


def test_cpu_override_drops_gpu_reservations_and_sets_device_cpu(compose_cpu, monkeypatch):
    for role in ("drafter", "verifier"):
        service = compose_cpu["services"][role]
        assert "deploy" not in service
        assert service["build"] == {"context": ".", "target": "cpu"} and service["image"] == "specdec:cpu"
        args = _parse(_service_argv(service), service["environment"], monkeypatch)
        assert args.device == "cpu"
        assert service["healthcheck"]["test"] == _load("docker-compose.yml")["services"][role]["healthcheck"]["test"]
    assert compose_cpu["services"]["loadgen"]["image"] == "specdec:cpu"
    assert compose_cpu["services"]["gateway"]["image"] == "specdec:cpu"


def test_dockerfile_has_cpu_and_cuda_targets_with_the_specdec_entrypoint():
    text = (ROOT / "Dockerfile").read_text()
    stages = {name: base for base, name in re.findall(r"^FROM\s+(\S+)\s+AS\s+(\S+)", text, re.M | re.I)}
    assert set(stages) == {"cpu", "cuda"}
    assert stages["cpu"].startswith("python:") and "slim" in stages["cpu"]
    cuda_base = re.search(r"^ARG CUDA_BASE=(\S+)", text, re.M).group(1)
    assert stages["cuda"] == "${CUDA_BASE}" and re.fullmatch(r"pytorch/pytorch:[\w.]+-cuda[\w.-]+-runtime", cuda_base)
    assert "pip install torch==2.13.0" in text
    assert text.count('ENTRYPOINT ["specdec"]') == 2 and text.count("SPECDEC_CACHE=/models") == 2
    assert ".venv" in (ROOT / ".dockerignore").read_text().split()


@pytest.mark.slow
def test_compose_topology_as_local_processes_configured_by_environment():
    """What compose does, with processes: flags come only from SPECDEC_* variables."""
    from client.speculative import SpeculativeClient
    from specdec.sampling import SamplingParams
    from specdec_rpc import specdec_pb2 as pb
    from specdec_rpc import specdec_pb2_grpc as pb_grpc

    metrics_port = free_port()
    common = {"SPECDEC_MAX_DRAFT_TOKENS": "6", "SPECDEC_LOG_LEVEL": "WARNING", "SPECDEC_THREADS": "1",
              "SPECDEC_GRACE_S": "3"}
    verifier = start_service("verifier", env={**common, "SPECDEC_METRICS_PORT": str(metrics_port)})
    drafter = gateway = None
    try:
        # Role-prefixed variables win over the shared ones (one environment, two services).
        drafter = start_service("drafter", env={**common, "SPECDEC_DTYPE": "bfloat16",
                                                "SPECDEC_DRAFTER_DTYPE": "float32"})
        with grpc.insecure_channel(drafter.address) as ch:
            info = pb_grpc.DrafterStub(ch).GetModelInfo(pb.ModelInfoRequest(), timeout=30)
        assert (info.dtype, info.max_draft_tokens) == ("float32", 6)
        health = subprocess.run([sys.executable, "-m", "cli", "health", "--address", verifier.address],
                                capture_output=True, text=True, timeout=60)
        assert (health.returncode, health.stdout.strip()) == (0, "SERVING"), health.stderr
        with SpeculativeClient(verifier.address, drafter=drafter.address) as client:
            params = SamplingParams(temperature=0.0, max_tokens=12)
            spec = client.generate("The capital of France is", params, num_speculative_tokens=8)
            base = client.generate("The capital of France is", params, target_only=True)
        assert spec.token_ids == base.token_ids and spec.num_draft_tokens > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
            assert b"specdec_forwards_total" in reply.read()
        # The gateway, configured only by SPECDEC_GATEWAY_*; the shared SPECDEC_* above do not reach it.
        gateway = start_service("gateway", env={**common, "SPECDEC_GATEWAY_VERIFIER": verifier.address,
                                                "SPECDEC_GATEWAY_DRAFTER": drafter.address,
                                                "SPECDEC_GATEWAY_API_KEY": "k", "SPECDEC_GATEWAY_PORT": "0"})
        url = f"http://{gateway.address}"
        health = [sys.executable, "-m", "cli", "health", "--url", f"{url}/health"]  # the compose healthcheck
        deadline = time.monotonic() + 60
        while subprocess.run(health, capture_output=True, timeout=30).returncode != 0:
            assert time.monotonic() < deadline, "the gateway never became healthy"
            time.sleep(0.5)
        request = urllib.request.Request(f"{url}/v1/completions", method="POST", headers={
            "Authorization": "Bearer k", "Content-Type": "application/json"},
            data=json.dumps({"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}).encode())
        with urllib.request.urlopen(request, timeout=120) as reply:
            assert json.loads(reply.read())["choices"][0]["text"] == spec.text
    finally:
        if gateway is not None:
            gateway.stop()
        for svc in (drafter, verifier):
            if svc is not None:
                svc.stop()
    assert not any("Traceback" in line for line in verifier.output), verifier.output[-20:]


def test_bad_environment_value_is_refused_naming_the_variable(monkeypatch, capsys):
    from cli import main

    monkeypatch.setenv("SPECDEC_VERIFIER_DTYPE", "float8")
    assert main(["verifier"]) == 2  # before any model is loaded
    assert "$SPECDEC_VERIFIER_DTYPE='float8' is not one of float32, float16, bfloat16" in capsys.readouterr().err


def test_the_first_start_converts_the_embedded_gguf_and_clears_a_killed_conversion(tmp_path):
    """What a fresh machine's first start does (this host's cache is converted already, so
    nothing else runs it): the pinned GGUF becomes a safetensors folder with the same
    tokenizer. A `.convert-*` folder left by a start killed mid-conversion (540 MB) is
    removed by the next conversion, which holds the lock no other one can."""
    from specdec.models import (EMBEDDED_NAME, ModelSpec, _embedded_gguf, cache_dir, ensure_embedded_model,
                                load_tokenizer, tokenizer_fingerprint)

    (tmp_path / _embedded_gguf(cache_dir()).name).symlink_to(_embedded_gguf(cache_dir()))
    stale = tmp_path / ".convert-killed"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half written")
    target = ensure_embedded_model(tmp_path)
    assert target == tmp_path / EMBEDDED_NAME and (target / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".convert-*"))
    converted = tokenizer_fingerprint(load_tokenizer(ModelSpec(model=str(target))))
    assert converted == tokenizer_fingerprint(load_tokenizer(ModelSpec()))
    config = json.loads((target / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["vocab_size"] == 49152
    assert ensure_embedded_model(tmp_path) == target  # converted once: the marker short-cuts the second call
