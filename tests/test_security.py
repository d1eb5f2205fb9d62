"""TLS, mutual TLS and bearer tokens on real service processes, with certificates made
here by the openssl CLI. Wrong credentials fail the TLS handshake (UNAVAILABLE) or the
token check (UNAUTHENTICATED); a session is usable only with the token that opened it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cli import main
from client.launcher import start_service
from client.speculative import SpeculativeClient
from specdec.sampling import SamplingParams
from specdec_rpc import specdec_pb2 as pb
from specdec_rpc import specdec_pb2_grpc as pb_grpc
from specdec_rpc.ops import TLSFiles, open_channel

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")]
ARGS = ["--max-draft-tokens", "8", "--log-level", "WARNING"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
TOKEN_A, TOKEN_B = "token-a-7f3c9e1d2b", "token-b-0a8e44c6f1"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=d)


def _leaf(d: Path, name: str, ca: str, *, server: bool) -> None:
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", cwd=d)
    ext = d / f"{name}.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n" if server
                   else "extendedKeyUsage=clientAuth\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "2", "-extfile", ext.name, "-out", f"{name}.pem", cwd=d)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """ca signs server and client; rogue-ca signs rogue-client (a certificate the servers must refuse)."""
    d = tmp_path_factory.mktemp("certs")
    _ca(d, "ca")
    _ca(d, "rogue-ca")
    _leaf(d, "server", "ca", server=True)
    _leaf(d, "client", "ca", server=False)
    _leaf(d, "rogue-client", "rogue-ca", server=False)
    (d / "tokens").write_text(f"# accepted tokens\n{TOKEN_A}\n\n{TOKEN_B}\n")
    return d


def _code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


@pytest.fixture(scope="module")
def tls_token_verifier(certs):
    """Server-side TLS plus bearer tokens."""
    svc = start_service("verifier", ARGS + ["--tls-cert", str(certs / "server.pem"), "--tls-key",
                                            str(certs / "server.key"), "--auth-token-file", str(certs / "tokens")],
                        threads=1)
    yield svc
    svc.stop()


@pytest.mark.parametrize("batch_verify", [False, True], ids=["unary", "stream"])
def test_tls_with_the_right_ca_and_token_generates(certs, tls_token_verifier, batch_verify):
    with SpeculativeClient(tls_token_verifier.address, tls_ca=str(certs / "ca.pem"), auth_token=TOKEN_A,
                           batch_verify=batch_verify) as client:
        result = client.generate("The capital of France is", GREEDY, target_only=True)
        # the decode rounds went on a VerifyStream, which carried the token too
        assert [b._front for b in (client._batchers or {}).values()] == (["stream"] if batch_verify else [])
    assert len(result.token_ids) == GREEDY.max_tokens


def test_a_drafter_that_refuses_the_clients_token_leaves_the_generations_target_only(certs, tls_token_verifier,
                                                                                   tmp_path):
    """Drafts are optional: a drafter restarted with other tokens (UNAUTHENTICATED) is a lost
    drafter, as an unreachable one. It used to fail the client's start, every generation after,
    and the gateway, whose 503 blamed the verifier."""
    (tmp_path / "other-tokens").write_text("a-token-this-client-does-not-have\n")
    drafter = start_service("drafter", ARGS + ["--tls-cert", str(certs / "server.pem"), "--tls-key",
                                               str(certs / "server.key"), "--auth-token-file",
                                               str(tmp_path / "other-tokens")], threads=1)
    try:
        with SpeculativeClient(tls_token_verifier.address, drafter=drafter.address, tls_ca=str(certs / "ca.pem"),
                               auth_token=TOKEN_A) as client:
            result = client.generate("The capital of France is", GREEDY, num_speculative_tokens=4)
    finally:
        drafter.stop()
    assert len(result.token_ids) == GREEDY.max_tokens and result.num_draft_tokens == 0


@pytest.mark.parametrize("tls", [TLSFiles(), TLSFiles(ca="rogue-ca.pem")], ids=["plaintext", "untrusted-ca"])
def test_tls_handshake_failures_are_unavailable(certs, tls_token_verifier, tls):
    if tls.ca:
        tls = TLSFiles(ca=str(certs / tls.ca))
    with open_channel(tls_token_verifier.address, tls=tls, auth_token=TOKEN_A) as ch:
        assert _code_of(lambda: pb_grpc.VerifierStub(ch).GetModelInfo(pb.ModelInfoRequest(), timeout=10)) \
            == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN_A + "x", ""], ids=["none", "wrong", "longer", "empty"])
def test_missing_or_wrong_token_is_unauthenticated(certs, tls_token_verifier, token):
    with open_channel(tls_token_verifier.address, tls=TLSFiles(ca=str(certs / "ca.pem")), auth_token=token) as ch:
        stub = pb_grpc.VerifierStub(ch)
        assert _code_of(lambda: stub.OpenSession(pb.OpenSessionRequest(), timeout=10)) \
            == grpc.StatusCode.UNAUTHENTICATED
        # Bytes that are no message: the missing token is still what the caller is told.
        raw = ch.unary_unary("/specdec.v1.Verifier/Verify", request_serializer=None, response_deserializer=None)
        assert _code_of(lambda: raw(b"\xff\xff\xff\xff", timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
        # Health stays open: probes carry no credentials.
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_session_opened_with_token_a_is_not_found_with_token_b(certs, tls_token_verifier):
    tls = TLSFiles(ca=str(certs / "ca.pem"))
    with open_channel(tls_token_verifier.address, tls=tls, auth_token=TOKEN_A) as ch_a, \
            open_channel(tls_token_verifier.address, tls=tls, auth_token=TOKEN_B) as ch_b:
        a, b = pb_grpc.VerifierStub(ch_a), pb_grpc.VerifierStub(ch_b)
        sid = a.OpenSession(pb.OpenSessionRequest(), timeout=10).session_id
        verify = pb.VerifyRequest(session_id=sid, append_token_ids=[504, 3575], sampling=pb.SamplingParams(temperature=0))
        with pytest.raises(grpc.RpcError) as err:
            b.Verify(verify, timeout=30)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        # The same words as for an id that never existed: nothing reveals that it does.
        assert err.value.details() == f"unknown session {sid!r}; open one with OpenSession"
        assert _code_of(lambda: b.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)) \
            == grpc.StatusCode.NOT_FOUND
        # The same in a batch, and on B's VerifyStream: that entry is NOT_FOUND.
        for reply in (b.VerifyBatch(pb.VerifyBatchRequest(requests=[verify]), timeout=30),
                      next(b.VerifyStream(iter([pb.VerifyBatchRequest(requests=[verify], tag=5)]), timeout=30))):
            assert [r.code for r in reply.results] == [grpc.StatusCode.NOT_FOUND.value[0]]
            assert reply.results[0].message == f"unknown session {sid!r}; open one with OpenSession"
        assert a.Verify(verify, timeout=30).kv_length == 2  # still A's, untouched by B
        a.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)


@pytest.fixture(scope="module")
def mtls_services(certs):
    """Both services with mutual TLS: client certificates signed by ca.pem required."""
    args = ARGS + ["--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key"),
                   "--tls-ca", str(certs / "ca.pem")]
    started = []
    try:
        for role in ("verifier", "drafter"):
            started.append(start_service(role, args, threads=1))
        yield {svc.role: svc for svc in started}
    finally:
        for svc in started:
            svc.stop()


def test_mutual_tls_with_a_client_certificate_generates_speculatively(certs, mtls_services):
    with SpeculativeClient(mtls_services["verifier"].address, drafter=mtls_services["drafter"].address,
                           tls_ca=str(certs / "ca.pem"), tls_cert=str(certs / "client.pem"),
                           tls_key=str(certs / "client.key")) as client:
        spec = client.generate("The capital of France is", GREEDY, num_speculative_tokens=4)
        base = client.generate("The capital of France is", GREEDY, target_only=True)
    assert spec.token_ids == base.token_ids and spec.num_draft_tokens > 0


@pytest.mark.parametrize("client_cert", [None, "rogue-client"], ids=["no-client-cert", "untrusted-client-cert"])
@pytest.mark.parametrize("role", ["drafter", "verifier"])
def test_mutual_tls_refuses_clients_without_a_trusted_certificate(certs, mtls_services, client_cert, role):
    tls = TLSFiles(ca=str(certs / "ca.pem"), cert=client_cert and str(certs / f"{client_cert}.pem"),
                   key=client_cert and str(certs / f"{client_cert}.key"))
    stub_class = pb_grpc.DrafterStub if role == "drafter" else pb_grpc.VerifierStub
    with open_channel(mtls_services[role].address, tls=tls) as ch:
        assert _code_of(lambda: stub_class(ch).GetModelInfo(pb.ModelInfoRequest(), timeout=10)) \
            == grpc.StatusCode.UNAVAILABLE


def test_generate_cli_takes_tls_and_token_flags(certs, tls_token_verifier):
    base = [sys.executable, "-m", "cli", "generate", "--verifier", tls_token_verifier.address, "--target-only",
            "--prompt", "Hello", "--max-tokens", "4", "--json", "--tls-ca", str(certs / "ca.pem")]
    (certs / "client-token").write_text(TOKEN_B + "\n")
    ok = subprocess.run(base + ["--auth-token-file", str(certs / "client-token")], capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0, ok.stderr
    refused = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr


def test_bench_takes_tls_and_token_flags(certs, tls_token_verifier, tmp_path, monkeypatch):
    """The load generator against a secured deployment: bench serve and bench verifier had
    no TLS or token options (UNAVAILABLE: Socket closed). The service's healthcheck reads
    the same SPECDEC_TLS_* variables the service does."""
    (certs / "client-token").write_text(TOKEN_A + "\n")
    security = ["--tls-ca", str(certs / "ca.pem"), "--auth-token-file", str(certs / "client-token")]
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--verifier", tls_token_verifier.address, "--target-only", "--num-prompts", "2",
                 "--max-tokens", "3", "--warmup-requests", "0", "--disable-tqdm", "--result-json", str(out),
                 *security]) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 2 and result["server_stats"]["verifier"]["delta"]["requests"] > 0
    assert main(["bench", "verifier", "--verifier", tls_token_verifier.address, "--concurrency", "1",
                 "--seconds", "0.5", "--empty-calls", "5", "--front", "stream", *security]) == 0
    assert main(["bench", "verifier", "--verifier", tls_token_verifier.address, "--concurrency", "1",
                 "--seconds", "0.5", "--empty-calls", "0", "--tls-ca", str(certs / "ca.pem")]) != 0  # no token
    monkeypatch.setenv("SPECDEC_TLS_CA", str(certs / "ca.pem"))
    health = subprocess.run([sys.executable, "-m", "cli", "health", "--address", tls_token_verifier.address],
                            capture_output=True, text=True, timeout=60)
    assert (health.returncode, health.stdout.strip()) == (0, "SERVING"), health.stderr


def test_health_url_of_an_https_gateway_trusts_the_tls_ca_flag(certs):
    """`specdec health --url https://...` verifies the gateway's certificate against --tls-ca
    (it used the system store only: CERTIFICATE_VERIFY_FAILED for a private CA). The gateway's
    verifier is unreachable, so a verified connection gets its /health answer: 503 connecting."""
    with start_service("gateway", ["--verifier", "127.0.0.1:1", "--ssl-certfile", str(certs / "server.pem"),
                                   "--ssl-keyfile", str(certs / "server.key"), "--log-level", "ERROR"]) as gw:
        url = f"https://{gw.address}/health"
        health = [sys.executable, "-m", "cli", "health", "--url", url, "--timeout-s", "10"]
        trusted = subprocess.run(health + ["--tls-ca", str(certs / "ca.pem")], capture_output=True, text=True,
                                 timeout=60)
        untrusted = subprocess.run(health, capture_output=True, text=True, timeout=60)
    assert trusted.returncode == 1 and "HTTP 503" in trusted.stderr, trusted.stderr
    assert untrusted.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr, untrusted.stderr
