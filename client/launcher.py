"""Start drafter / verifier services, and the HTTP gateway, as local processes on free
loopback ports.

Used by `specdec demo`, the benchmarks and the integration tests: the same topology as
docker-compose, as plain processes.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


ROLES = ("drafter", "verifier", "gateway")


class ServiceStartError(RuntimeError):
    """A service exited before it served: its role and its last lines of output."""

    def __init__(self, role: str, output: list[str]) -> None:
        super().__init__(f"{role} exited before serving:\n" + "\n".join(output))
        self.role, self.output = role, output


@dataclass
class ServiceProcess:
    role: str
    proc: subprocess.Popen
    address: str
    output: list[str] = field(default_factory=list)  # lines the process printed, for diagnosis

    def stop(self, grace_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after grace_s; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "ServiceProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_service(role: str, args: list[str] | None = None, *, host: str = "127.0.0.1", port: int = 0,
                  threads: int | None = None, timeout_s: float = 600.0,
                  env: dict[str, str] | None = None) -> ServiceProcess:
    """Run `specdec <role> ...` and wait until it prints the address it bound. `env` adds
    variables (e.g. SPECDEC_DTYPE, SPECDEC_METRICS_PORT: the container configuration)."""
    return start_services([(role, args)], host=host, threads=threads, timeout_s=timeout_s, env=env,
                          ports=[port])[0]


class ServiceGroup(list):
    """start_services' processes, in order; as a context manager, stops them all at exit."""

    def __enter__(self) -> "ServiceGroup":
        return self

    def __exit__(self, *exc) -> None:
        for service in reversed(self):
            service.stop()


def start_services(specs: list[tuple[str, list[str] | None]], *, host: str = "127.0.0.1",
                   threads: int | None = None, timeout_s: float = 600.0, env: dict[str, str] | None = None,
                   ports: list[int] | None = None) -> ServiceGroup:
    """start_service for several (role, args) at once: every process is spawned before the
    first is waited for, so their imports and model loads overlap (a drafter and a verifier
    convert the embedded model once, under a file lock). If one fails, all are stopped."""
    ports = ports or [0] * len(specs)
    # Checked before any process starts, so that none is left running.
    if bad := [role for role, _ in specs if role not in ROLES]:
        raise ValueError(f"role must be drafter, verifier or gateway, got {bad[0]!r}")
    if len(ports) != len(specs):
        raise ValueError(f"one port per service: {len(ports)} ports for {len(specs)} services")
    spawned: list[tuple[ServiceProcess, threading.Event]] = []
    try:
        for (role, args), port in zip(specs, ports):
            spawned.append(_spawn(role, args, host, port, threads, env))
        deadline = time.monotonic() + timeout_s
        waiting = list(spawned)
        while waiting:  # whichever is ready (or failed) first: a service that fails fast is told at once
            waiting[0][1].wait(0.1)
            for service, ready in [w for w in waiting if w[1].is_set()]:
                _wait_ready(service, ready, deadline, timeout_s)
                waiting.remove((service, ready))
            if waiting and time.monotonic() > deadline:
                _wait_ready(*waiting[0], deadline, timeout_s)  # raises the TimeoutError
    except BaseException:
        for service, _ in spawned:
            service.kill()
        raise
    return ServiceGroup(service for service, _ in spawned)


def _spawn(role: str, args: list[str] | None, host: str, port: int, threads: int | None,
           env: dict[str, str] | None) -> tuple[ServiceProcess, threading.Event]:
    cmd = [sys.executable, "-m", "cli", role, "--host", host, "--port", str(port), *(args or [])]
    if threads and role != "gateway":
        cmd += ["--threads", str(threads)]
    env = {**os.environ, **(env or {})}
    env.setdefault("PYTHONUNBUFFERED", "1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    service = ServiceProcess(role=role, proc=proc, address="")
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            service.output.append(line.rstrip())
            if len(service.output) > 2000:
                del service.output[:1000]
            marker = f"{role} listening on "
            if not service.address and marker in line:
                service.address = line.split(marker, 1)[1].split()[0]
                ready.set()
        ready.set()

    threading.Thread(target=pump, name=f"{role}-output", daemon=True).start()
    return service, ready


def _wait_ready(service: ServiceProcess, ready: threading.Event, deadline: float, timeout_s: float) -> None:
    role = service.role
    while not ready.wait(0.2):
        if time.monotonic() > deadline:
            service.kill()
            raise TimeoutError(f"{role} did not start within {timeout_s:g} s: " + "\n".join(service.output[-20:]))
    if not service.address:
        service.kill()
        raise ServiceStartError(role, service.output[-40:])
    log.info("%s pid=%d at %s", role, service.proc.pid, service.address)


def start_gateway(verifier: str, drafter: str | None = None, args: list[str] | None = None, *,
                  host: str = "127.0.0.1", port: int = 0, timeout_s: float = 120.0,
                  env: dict[str, str] | None = None) -> ServiceProcess:
    """Run `specdec gateway` in front of `verifier` (and `drafter`), and wait until its
    /health answers 200 (the upstream is connected). `address` is its HOST:PORT."""
    upstream = ["--verifier", verifier] + (["--drafter", drafter] if drafter else [])
    service = start_service("gateway", upstream + list(args or []), host=host, port=port, timeout_s=timeout_s,
                            env=env)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://{service.address}/health", timeout=5):
                return service
        except (urllib.error.URLError, OSError) as exc:
            if service.proc.poll() is not None or time.monotonic() > deadline:
                service.kill()
                raise RuntimeError(f"gateway not healthy ({exc}):\n" + "\n".join(service.output[-20:])) from None
        time.sleep(0.2)
