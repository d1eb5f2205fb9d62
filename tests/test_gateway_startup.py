"""The gateway started before its upstream: a request that arrives while it is still
connecting waits for the connection (up to --recovery-timeout-s) instead of failing at once,
and gets a 503 that says what it waited for when the upstream never comes. Real gateway and
service processes on loopback ports, driven by the official `openai` package."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import openai
import pytest

from client.launcher import start_service
from tests.conftest import SERVICE_THREADS, free_port

UNREACHABLE = "127.0.0.1:1"  # nothing listens: every connection attempt is refused at once
SHORT_WAIT_S = 2.0


def _openai(gateway, timeout_s: float) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0,
                         timeout=timeout_s)


@pytest.fixture(scope="module")
def unreachable_gateway():
    with start_service("gateway", ["--verifier", UNREACHABLE, "--recovery-timeout-s", str(SHORT_WAIT_S),
                                   "--log-level", "WARNING"]) as gw:
        yield gw


@pytest.mark.slow
def test_a_chat_completion_sent_before_the_services_start_waits_for_them_and_succeeds():
    verifier_port, drafter_port = free_port(), free_port()
    with ExitStack() as stack:
        gw = stack.enter_context(start_service(
            "gateway", ["--verifier", f"127.0.0.1:{verifier_port}", "--drafter", f"127.0.0.1:{drafter_port}",
                        "--recovery-timeout-s", "60", "--log-level", "WARNING"]))
        reply: dict = {}

        def ask() -> None:
            try:
                with _openai(gw, 90) as oai:
                    reply["value"] = oai.chat.completions.create(
                        model="", messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0)
            except Exception as exc:  # reported by the assertion below
                reply["value"] = exc

        asking = threading.Thread(target=ask)
        asking.start()
        time.sleep(2.0)
        assert asking.is_alive(), f"the request did not wait for the upstream: {reply.get('value')!r}"
        assert httpx.get(f"http://{gw.address}/health").status_code == 503  # the truth: still connecting
        with ThreadPoolExecutor(2) as pool:
            verifier = pool.submit(start_service, "verifier", ["--max-draft-tokens", "8", "--log-level", "WARNING"],
                                   port=verifier_port, threads=SERVICE_THREADS)
            drafter = pool.submit(start_service, "drafter",
                                  ["--max-draft-tokens", "8", "--prefill-dtype", "none", "--quantize", "none",
                                   "--log-level", "WARNING"], port=drafter_port, threads=SERVICE_THREADS)
            for started in (verifier, drafter):
                stack.enter_context(started.result())
        asking.join(90)
        result = reply.get("value")
        assert not isinstance(result, BaseException), f"{result!r}\n" + "\n".join(gw.output[-20:])
        assert result.choices[0].finish_reason in ("stop", "length") and result.usage.completion_tokens > 0
        assert httpx.get(f"http://{gw.address}/health").status_code == 200
    assert not any("Traceback" in line for line in gw.output), gw.output[-30:]


@pytest.mark.slow
def test_a_request_to_an_unreachable_upstream_gets_a_503_saying_what_it_waited_for_within_the_bound(
        unreachable_gateway):
    start = time.monotonic()
    with _openai(unreachable_gateway, 30) as oai, pytest.raises(openai.APIStatusError) as caught:
        oai.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    elapsed = time.monotonic() - start
    assert caught.value.status_code == 503
    error = caught.value.body
    assert error["code"] == "upstream_unavailable" and error["type"] == "service_unavailable"
    assert f"waited {SHORT_WAIT_S:g} s" in error["message"] and UNREACHABLE in error["message"]
    assert SHORT_WAIT_S - 0.5 <= elapsed < SHORT_WAIT_S + 3.0


@pytest.mark.slow
def test_a_pair_that_cannot_serve_together_is_a_503_at_once_naming_why_not_a_wait(verifier_proc, drafter_proc):
    """Both services answer but cannot work as configured (here each address given as the
    other's role: the same IncompatibleModels as mismatched tokenizers). The gateway started,
    then answered every request after --recovery-timeout-s with "not reachable"; now at once,
    saying why, and /health says `incompatible`."""
    with start_service("gateway", ["--verifier", drafter_proc.address, "--drafter", verifier_proc.address,
                                   "--recovery-timeout-s", "60", "--log-level", "WARNING"]) as gw:
        with _openai(gw, 90) as oai:
            start = time.monotonic()
            with pytest.raises(openai.APIStatusError) as caught:
                oai.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            assert time.monotonic() - start < 20  # the first connection attempt's answer, not the 60 s wait
            assert caught.value.status_code == 503 and caught.value.body["code"] == "upstream_incompatible"
            assert "does not serve the verifier API" in caught.value.body["message"]
            start = time.monotonic()
            with pytest.raises(openai.APIStatusError) as again:  # later requests: at once
                oai.models.list()
            assert again.value.status_code == 503 and time.monotonic() - start < 2
        health = httpx.get(f"http://{gw.address}/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "incompatible"


@pytest.mark.slow
def test_a_request_queued_for_a_generation_slot_past_timeout_s_is_a_503_not_a_long_wait(verifier_proc):
    """--max-concurrent-requests 1: a second request waited, unbounded, for the first one's
    whole generation (55 s in a hunt, answered 200). It now waits at most --timeout-s for a
    slot, then gets 503 server_busy; the running generation is not disturbed."""
    with start_service("gateway", ["--verifier", verifier_proc.address, "--max-concurrent-requests", "1",
                                   "--timeout-s", "3", "--log-level", "WARNING"]) as gw:
        with _openai(gw, 120) as oai:
            stream = oai.completions.create(model="", prompt="Once upon a time", max_tokens=200, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
            chunks = iter(stream)
            next(chunks)  # the first generation holds the only slot now
            gauges = []  # (running, waiting) while the second request waits: vLLM's two gauges

            def scrape() -> None:
                for _ in range(20):
                    text = httpx.get(f"http://{gw.address}/metrics", timeout=10).text
                    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                              if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{"))}
                    gauges.append((values.get("vllm:num_requests_running"), values.get("vllm:num_requests_waiting")))
                    if gauges[-1] == (1.0, 1.0):
                        return
                    time.sleep(0.1)

            scraper = threading.Thread(target=scrape)
            start = time.monotonic()
            scraper.start()
            with pytest.raises(openai.APIStatusError) as busy:
                oai.completions.create(model="", prompt="Hi", max_tokens=2)
            waited = time.monotonic() - start
            scraper.join()
            assert gauges[-1] == (1.0, 1.0), gauges  # it was counted as running before
            assert busy.value.status_code == 503 and busy.value.body["code"] == "server_busy", busy.value.body
            assert 2.5 <= waited < 10, waited
            rest = list(chunks)
            assert rest and rest[-1].choices[0].finish_reason == "length"
            # the slot is free again (ignore_eos: sampled at temperature 1, "Hi" once drew EOS second)
            done = oai.completions.create(model="", prompt="Hi", max_tokens=2, extra_body={"ignore_eos": True})
            assert done.usage.completion_tokens == 2
            # More choices than slots: its second choice waited for its first one's slot, then 503.
            with pytest.raises(openai.BadRequestError) as too_many:
                oai.completions.create(model="", prompt="Hi", max_tokens=2, n=2)
            assert too_many.value.body["param"] == "n" and "--max-concurrent-requests 1" in too_many.value.message
        # A lone surrogate echoed in an error: rendering it failed (500, connection reset).
        odd = httpx.post(f"http://{gw.address}/v1/completions", content=b'{"prompt": "hi", "model": "\\ud800"}',
                         headers={"Content-Type": "application/json"}, timeout=30)
        assert odd.status_code == 404 and odd.json()["error"]["param"] == "model", odd.text


@pytest.mark.slow
def test_the_gateway_sends_proposals_in_the_wire_form_its_flags_or_environment_name(verifier_proc, int8_drafter_proc):
    """--proposal / --proposal-dtype / --top-n (here from $SPECDEC_GATEWAY_*, as compose sets
    them) reach the gateway's client: a sampled request's proposals are sparse top-8 float16,
    8 x (4 + 2) bytes per draft, against a dense float32 q of the vocabulary by default."""
    request = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 1.0, "seed": 3, "ignore_eos": True}
    sizes = {}
    for name, env in (("dense", {}), ("sparse", {"SPECDEC_GATEWAY_PROPOSAL": "sparse", "SPECDEC_GATEWAY_TOP_N": "8",
                                                "SPECDEC_GATEWAY_PROPOSAL_DTYPE": "float16"})):
        with start_service("gateway", ["--verifier", verifier_proc.address, "--drafter", int8_drafter_proc.address,
                                       "--num-speculative-tokens", "4", "--log-level", "WARNING"], env=env) as gw:
            reply = httpx.post(f"http://{gw.address}/v1/completions", json=request, timeout=120).json()
            spec = reply["speculative"]
            assert spec["num_draft_tokens"] > 0, reply
            sizes[name] = spec["proposal_bytes"] / spec["num_draft_tokens"]
    assert sizes["sparse"] == 8 * (4 + 2) and sizes["dense"] == 49152 * 4, sizes


@pytest.mark.slow
def test_health_answers_at_once_while_connecting_and_models_waits_like_a_completion(unreachable_gateway):
    url = f"http://{unreachable_gateway.address}"
    start = time.monotonic()
    health = httpx.get(f"{url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "connecting"
    assert time.monotonic() - start < 1.0
    start = time.monotonic()
    models = httpx.get(f"{url}/v1/models", timeout=10)
    assert models.status_code == 503 and f"waited {SHORT_WAIT_S:g} s" in models.json()["error"]["message"]
    assert SHORT_WAIT_S - 0.5 <= time.monotonic() - start < SHORT_WAIT_S + 3.0


@pytest.mark.slow
def test_after_a_redeploy_with_another_model_the_gateway_serves_the_new_one(tmp_path):
    """The verifier is replaced, on the same address, by one serving another model: the next
    request fails (503 upstream_incompatible: its session cannot move to another target), and
    the gateway reconnects for what is served now, /v1/models included, without a restart."""
    import subprocess
    import sys

    models = {}
    for name in ("old", "new"):
        models[name] = str(tmp_path / name)
        subprocess.run([sys.executable, "-m", "cli", "random-model", "--preset", "tiny", "--out", models[name]],
                       check=True, capture_output=True, timeout=300)
    port = free_port()
    args = ["--log-level", "WARNING"]
    with ExitStack() as stack:
        verifier = stack.enter_context(start_service("verifier", args + ["--model", models["old"]], port=port,
                                                     threads=SERVICE_THREADS))
        gw = stack.enter_context(start_service("gateway", ["--verifier", f"127.0.0.1:{port}",
                                                           "--recovery-timeout-s", "5", "--log-level", "WARNING"]))
        with _openai(gw, 60) as oai:
            assert oai.models.list().data[0].root.startswith(models["old"])
            oai.completions.create(model="", prompt="Hello", max_tokens=2)
            verifier.kill()
            stack.enter_context(start_service("verifier", args + ["--model", models["new"]], port=port,
                                              threads=SERVICE_THREADS))
            with pytest.raises(openai.APIStatusError) as first:
                oai.completions.create(model="", prompt="Hello", max_tokens=2)
            assert first.value.status_code == 503, first.value
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the reconnection runs in the background
                try:
                    roots = [m.root for m in oai.models.list().data]
                except openai.APIStatusError:
                    roots = []
                if roots and roots[0].startswith(models["new"]):
                    break
                time.sleep(0.2)
            assert roots and roots[0].startswith(models["new"]), (roots, gw.output[-20:])
            reply = oai.completions.create(model="", prompt="Hello", max_tokens=2, extra_body={"ignore_eos": True})
            assert reply.usage.completion_tokens == 2 and reply.model.startswith(models["new"])


def test_browser_pages_get_cors_headers_as_from_vllm_and_an_origin_list_restricts_them():
    """vLLM's CORS defaults (any origin, method and header): a browser's preflight is answered
    without the API key it cannot carry, and a refusal (401) carries the headers so the page can
    read it. --allowed-origins (here from the environment, comma-separated) restricts them. Before,
    a preflight got 405 and no answer carried Access-Control-Allow-Origin."""
    preflight = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    with ExitStack() as stack:
        open_gw, narrow_gw = (stack.enter_context(start_service(
            "gateway", ["--verifier", UNREACHABLE, "--api-key", "k", "--log-level", "WARNING"], env=env))
            for env in ({}, {"SPECDEC_GATEWAY_ALLOWED_ORIGINS": "https://ui.example,https://b.example"}))
        for gw in (open_gw, narrow_gw):
            reply = httpx.options(f"http://{gw.address}/v1/chat/completions", headers=preflight)
            assert reply.status_code == 200, reply.text
            assert reply.headers["access-control-allow-origin"] in ("*", "https://ui.example")
            assert "POST" in reply.headers["access-control-allow-methods"]
            assert "authorization" in reply.headers["access-control-allow-headers"].lower()
            refused = httpx.get(f"http://{gw.address}/v1/models", headers={"Origin": "https://ui.example"})
            assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] in (
                "*", "https://ui.example")
        other = {**preflight, "Origin": "https://elsewhere.example"}
        assert httpx.options(f"http://{open_gw.address}/v1/chat/completions", headers=other).status_code == 200
        assert httpx.options(f"http://{narrow_gw.address}/v1/chat/completions", headers=other).status_code == 400
        plain = httpx.get(f"http://{narrow_gw.address}/health", headers={"Origin": "https://elsewhere.example"})
        assert "access-control-allow-origin" not in plain.headers
