"""Shared fixtures: real service processes on free loopback ports, the real model in-process."""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest
import torch
from scipy import stats

from client.launcher import start_service, start_services

SERVICE_THREADS = 1  # two pytest workers, each with its test services, share 2 cores

if not torch.cuda.is_available():
    # Triton kernels run numpy-interpreted on CPU tensors (tests/test_triton_sampler.py). Triton's own
    # library functions (tl.cumsum, ...) are built at its import, so this must precede any import of it.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def _default_pair():
    """The default verifier and drafter, started together (their loads overlap)."""
    with start_services([("verifier", ["--max-draft-tokens", "8", "--log-level", "WARNING"]),
                         ("drafter", ["--max-draft-tokens", "8", "--prefill-dtype", "none", "--quantize", "none",
                                      "--log-level", "WARNING"])], threads=SERVICE_THREADS) as services:
        yield services


@pytest.fixture(scope="session")
def verifier_proc(_default_pair):
    return _default_pair[0]


@pytest.fixture(scope="session")
def drafter_proc(_default_pair):
    """The embedded weights in float16 throughout, prompts included (acceptance ~1: its drafts are
    the target's argmax) on every host; the services' default may pick int4 weights and a
    prefill copy (test_goodput.py, test_quantized.py)."""
    return _default_pair[1]


@pytest.fixture(scope="session")
def int8_drafter_proc():
    """A real low-acceptance drafter (dynamic int8 decoder layers), so rejections happen."""
    with start_service(
        "drafter", ["--quantize", "int8", "--dtype", "float32", "--max-draft-tokens", "8", "--log-level", "WARNING"],
        threads=SERVICE_THREADS,
    ) as svc:
        yield svc


@pytest.fixture(scope="session")
def client(verifier_proc, drafter_proc):
    """A client of the default pair (float16 drafter, acceptance ~1)."""
    from client.speculative import SpeculativeClient

    with SpeculativeClient(verifier_proc.address, drafter=drafter_proc.address) as c:
        yield c


@pytest.fixture(scope="session")
def int8_client(verifier_proc, int8_drafter_proc):
    """A client of the low-acceptance pair, so rejections happen."""
    from client.speculative import SpeculativeClient

    with SpeculativeClient(verifier_proc.address, drafter=int8_drafter_proc.address) as c:
        yield c


@pytest.fixture(scope="session")
def target_lm():
    from specdec.models import CausalLM, ModelSpec

    return CausalLM(ModelSpec(dtype="float32"))


@pytest.fixture(scope="session")
def int8_lm():
    from specdec.models import CausalLM, ModelSpec

    return CausalLM(ModelSpec(dtype="float32", quantize="int8"))


def chi_square_pvalue(observed: dict, expected_probs: dict, n: int, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit over cells with expected count >= min_expected, plus one
    'other' cell holding the remaining probability mass and observations."""
    cells = [c for c, p in expected_probs.items() if p * n >= min_expected]
    obs = [observed.get(c, 0) for c in cells]
    exp = [expected_probs[c] * n for c in cells]
    rest_obs = n - sum(obs)
    rest_exp = n - sum(exp)
    if rest_exp >= min_expected:
        obs.append(rest_obs)
        exp.append(rest_exp)
    elif rest_obs:  # observations in a cell of ~no mass: fold into the largest cell's test
        exp[-1] += rest_exp
        obs[-1] += rest_obs
    obs_arr, exp_arr = np.asarray(obs, float), np.asarray(exp, float)
    exp_arr *= obs_arr.sum() / exp_arr.sum()
    return float(stats.chisquare(obs_arr, exp_arr).pvalue)


def free_port() -> int:
    """A loopback port nothing listens on now (for a service that must come back on the same one)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def target_only_outputs(client, prompts: list, params) -> list[list[int]]:
    """Each prompt's target-only token ids, the generations run at once (the verifier batches
    them; a greedy row's output does not depend on its batch mates, which tests check)."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: client.generate(p, params, target_only=True).token_ids, prompts))


def stream_concurrently(client, jobs: list, progress, chunks: dict | None = None,
                        gamma: int = 4) -> tuple[list, list[threading.Thread]]:
    """One streaming thread per (prompt, params) job, started; progress[i] counts the rounds
    job i has done, chunks[i] (if given) gets (arrival time.monotonic(), tokens) per round.
    Returns (results, threads): a GenerationResult or the exception, per job."""
    results: list = [RuntimeError("not run")] * len(jobs)

    def run(i: int) -> None:
        try:
            for chunk in client.stream(jobs[i][0], jobs[i][1], num_speculative_tokens=gamma):
                if chunks is not None:
                    chunks[i].append((time.monotonic(), len(chunk.token_ids)))
                progress[i] += 1
                if chunk.result is not None:
                    results[i] = chunk.result
        except Exception as exc:  # reported by the assertion on results
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    return results, threads


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def rss_mb(pid: int) -> float:
    """Resident memory of process `pid`, MiB."""
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20
