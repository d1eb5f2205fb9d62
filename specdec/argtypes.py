"""argparse types shared by every command line: the `specdec` CLI and the bench modules' own
`python -m bench.engine|sampler` entry points (which must run on a bare GPU image without grpc)."""

from __future__ import annotations

import argparse
import json
import os

MAX_WAIT_MS = 60_000.0  # --max-wait-ms above this is a typo (inf overflowed queue.get and stopped the engine)
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")  # vLLM's --logprobs-mode values we do
# A verify round's target-only decode steps (VerifyRequest.decode_steps): the row holds its session
# for that many steps, and its caller's deadline must cover them.
MAX_DECODE_STEPS = 64
# A client's default (SpeculativeClient's decode_steps): docs/benchmarks.md, "Target-only rounds
# of several steps".
DEFAULT_DECODE_STEPS = 4
MAX_TIMEOUT_S = 86_400.0  # a day: gRPC deadlines past this (inf) failed every call DEADLINE_EXCEEDED


def positive(name: str, kind=int, zero: bool = False, maximum: float | None = None):
    """An argparse type: a number > 0 (>= 0 with zero=True), at most `maximum` if given
    (NaN is never one; inf only without a maximum)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{name} must be {what}, got {text!r}") from None
        if not (value >= 0 if zero else value > 0):
            raise argparse.ArgumentTypeError(f"{name} must be {'>=' if zero else '>'} 0, got {text!r}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{name} must be <= {maximum:g}, got {text!r}")
        return value

    return parse


def positive_list(name: str, kind=int):
    """An argparse type: comma-separated numbers > 0 ("1,4,16"; with kind=float also inf),
    each once: a repeated point would be measured twice and reported as two."""
    def parse(text: str) -> list:
        values = []
        for item in (i.strip() for i in text.split(",")):
            if not item:
                continue
            try:
                value = kind(item)
            except ValueError:
                what = "integers" if kind is int else "numbers (or inf)"
                raise argparse.ArgumentTypeError(f"{name} takes comma-separated {what}, got {item!r}") from None
            if not value > 0:  # NaN too
                raise argparse.ArgumentTypeError(f"{name} values must be > 0, got {item!r}")
            if value in values:
                raise argparse.ArgumentTypeError(f"{name} repeats {item}")
            values.append(value)
        if not values:
            raise argparse.ArgumentTypeError(f"{name} is empty")
        return values

    return parse


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def string_list(name: str):
    """vLLM's form, a JSON list ('["https://a.example", "https://b.example"]'), or a comma-separated
    one ('https://a.example,https://b.example'), as a tuple of strings."""
    def parse(text: str) -> tuple[str, ...]:
        text = text.strip()
        if text.startswith("["):
            try:
                values = json.loads(text)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(f"{name}: not a JSON list: {exc}") from None
            if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
                raise argparse.ArgumentTypeError(f"{name}: a JSON list of non-empty strings, got {text}")
            return tuple(values)  # [] allows none, as in vLLM
        values = [v.strip() for v in text.split(",")]
        if not all(values):
            raise argparse.ArgumentTypeError(f"{name}: an empty entry in {text!r}")
        return tuple(values)

    return parse


def log_level(text: str) -> str:
    """An argparse type: a logging level name, any case (Python's WARN and FATAL too), as its
    canonical upper-case name (uvicorn took no "warn" and failed with a KeyError traceback)."""
    name = {"WARN": "WARNING", "FATAL": "CRITICAL"}.get(text.strip().upper(), text.strip().upper())
    if name.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return name


def output_file(text: str) -> str:
    """An argparse type: a file path whose directory exists (checked before a run of minutes,
    not when its result is written)."""
    path = os.path.abspath(text)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    if not os.path.isdir(os.path.dirname(path)):
        raise argparse.ArgumentTypeError(f"no directory {os.path.dirname(text) or '.'!r} to write "
                                         f"{os.path.basename(text)!r} in")
    if not os.access(os.path.dirname(path), os.W_OK):  # e.g. a bind mount the container's user cannot write
        raise argparse.ArgumentTypeError(f"directory {os.path.dirname(text) or '.'!r} is not writable")
    return text


def device(auto: bool = False):
    """An argparse type: cpu or cuda[:N] (or "auto" where `auto`), refused at once when this
    torch cannot use it (a traceback from deep inside the run, before)."""
    def parse(text: str) -> str:
        if auto and text == "auto":
            return text
        import torch  # here, not at import: `specdec health` parses without torch

        try:
            dev = torch.device(text)
        except RuntimeError:
            dev = None
        if dev is None or dev.type not in ("cpu", "cuda"):
            raise argparse.ArgumentTypeError(f"{text!r} is not a device: cpu or cuda[:N]{' or auto' if auto else ''}")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text}: no CUDA device is usable here (torch {torch.__version__}"
                                             f"{', built without CUDA' if torch.version.cuda is None else ''})")
        if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text}: this host has {torch.cuda.device_count()} CUDA device(s)")
        return text

    parse.__name__ = "device"
    return parse


def port(name: str):
    """An argparse type: a TCP port, 0-65535 (0: any free port)."""
    def parse(text: str) -> int:
        value = positive(name, zero=True)(text)
        if value > 65535:
            raise argparse.ArgumentTypeError(f"{name} must be a TCP port (0-65535), got {text!r}")
        return value

    return parse


class AddressList(argparse.Action):
    """A repeatable HOST:PORT option (default None): `--x A --x B` and `--x A,B` both give
    "A,B", a pool the client splits. The command line's list replaces a default (one from
    $SPECDEC_GATEWAY_VERIFIER, say) instead of adding to it."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        given = f"_{self.dest}_given"
        previous = getattr(namespace, self.dest, None) if getattr(namespace, given, False) else None
        setattr(namespace, given, True)
        setattr(namespace, self.dest, f"{previous},{values}" if previous else values)


def gamma_arg(text: str) -> int | str:
    """--num-speculative-tokens: an integer >= 0, or 'auto'."""
    if text == "auto":
        return text
    return positive("--num-speculative-tokens", zero=True)(text)


def add_decode_steps_arg(p: argparse.ArgumentParser) -> None:
    """A client's --decode-steps (generate, gateway, bench)."""
    p.add_argument("--decode-steps", type=positive("--decode-steps", maximum=MAX_DECODE_STEPS),
                   default=DEFAULT_DECODE_STEPS,
                   help="a round without drafts (target-only, or adaptive gamma choosing 0) may decode up to N "
                        "tokens on the verifier in one call, answered together: one call per N tokens instead "
                        "of one per token (1 = off; default %(default)s)")


def add_client_security_args(p: argparse.ArgumentParser, auth: bool = True) -> None:
    """The client side of the services' TLS and bearer tokens (generate, health, bench)."""
    p.add_argument("--tls-ca", default=None, help="PEM CA bundle that signed the servers' certificates: use TLS")
    p.add_argument("--tls-cert", default=None, help="PEM client certificate for mutual TLS (with --tls-key)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    if auth:
        p.add_argument("--auth-token-file", default=None, help="send the first token in this file as a bearer token")


def check_port(address: str, role: str) -> None:
    """HOST:PORT, [IPV6]:PORT, or a gRPC target with a scheme (dns:///..., unix:...). Without a
    port gRPC would dial 443, which is never what a bare host meant here."""
    if "://" in address or address.startswith(("unix:", "unix-abstract:", "vsock:")):
        return
    host, sep, port = address.rpartition(":")
    if not sep or not host or host.endswith(":") or (":" in host and not host.startswith("[")):
        raise ValueError(f"{role} address {address!r} needs a port: HOST:PORT (or [IPV6]:PORT)")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{role} address {address!r}: the port must be in 1-65535")
