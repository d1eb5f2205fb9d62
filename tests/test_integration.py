"""End to end through real drafter / verifier processes on loopback ports."""

from __future__ import annotations

import asyncio

import collections
import concurrent.futures
import json
import re
import subprocess
import socket
import sys
import time

import grpc
import pytest
import torch

from client.speculative import ClientClosed, IncompatibleModels, NoServerAvailable, SpeculativeClient, check_compatible
from gateway.upstream import upstream_error
from specdec.sampling import SamplingParams, logits_to_probs
from specdec.serving import ModelInfo
from specdec_rpc import specdec_pb2 as pb
from specdec_rpc import specdec_pb2_grpc as pb_grpc
from tests.conftest import chi_square_pvalue, free_port, wait_for

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,"]
GREEDY = pb.SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def verifier_stub(verifier_proc):
    with grpc.insecure_channel(verifier_proc.address) as ch:
        yield pb_grpc.VerifierStub(ch)


@pytest.fixture(scope="module")
def drafter_stub(drafter_proc):
    with grpc.insecure_channel(drafter_proc.address) as ch:
        yield pb_grpc.DrafterStub(ch)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_speculative_equals_target_only_and_transformers_generate(client, target_lm, prompt):
    params = SamplingParams(temperature=0.0, max_tokens=20)
    base = client.generate(prompt, params, target_only=True)
    ids = client.encode_prompt(prompt)
    with torch.inference_mode():
        hf = target_lm.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=20)[0, len(ids):].tolist()
    assert base.token_ids == hf
    for gamma in (1, 3, 5):
        spec = client.generate(prompt, params, num_speculative_tokens=gamma)
        assert spec.token_ids == base.token_ids, f"gamma={gamma}"
        assert spec.num_draft_tokens > 0 and spec.num_rounds < len(spec.token_ids)


def test_target_only_rounds_of_several_decode_steps_give_the_tokens_of_single_steps(client, verifier_proc):
    """decode_steps (the default client's 4, and 7) against a call per token: the same tokens,
    logprobs and stop, greedy and seeded with penalties, in fewer rounds; a stop string inside
    a round's tokens ends the text there; streaming yields a chunk per round."""
    from client.speculative import SpeculativeClient

    with SpeculativeClient(verifier_proc.address, decode_steps=1) as single, \
            SpeculativeClient(verifier_proc.address, decode_steps=7) as seven:
        for params in (SamplingParams(temperature=0.0, max_tokens=20, logprobs=1),
                       SamplingParams(temperature=1.0, max_tokens=20, seed=11, presence_penalty=0.5,
                                      repetition_penalty=1.2, logprobs=1)):
            one = single.generate(PROMPTS[2], params, target_only=True)
            assert one.num_rounds == 20
            for other, rounds in ((client, 1 + 5), (seven, 1 + 3)):  # the first round: one step (TTFT)
                got = other.generate(PROMPTS[2], params, target_only=True)
                assert got.token_ids == one.token_ids and got.num_rounds == rounds, params
                assert [e["logprob"] for e in got.logprobs] == pytest.approx([e["logprob"] for e in one.logprobs],
                                                                             abs=1e-4)
        greedy = SamplingParams(temperature=0.0, max_tokens=20)
        text = single.generate(PROMPTS[2], greedy, target_only=True).text
        stop = text[len(text) // 2:len(text) // 2 + 3]
        want = single.generate(PROMPTS[2], greedy.replace(stop=[stop]), target_only=True)
        got = seven.generate(PROMPTS[2], greedy.replace(stop=[stop]), target_only=True)
        assert got.finish_reason == want.finish_reason == "stop" and got.text == want.text
        chunks = list(seven.stream(PROMPTS[2], greedy, target_only=True))
        assert [len(c.token_ids) for c in chunks] == [1, 7, 7, 5]


def test_streaming_yields_the_same_tokens_round_by_round(client):
    params = SamplingParams(temperature=0.0, max_tokens=16)
    chunks = list(client.stream(PROMPTS[0], params, num_speculative_tokens=3))
    result = chunks[-1].result
    assert [t for c in chunks for t in c.token_ids] == result.token_ids
    assert "".join(c.text for c in chunks) == result.text
    assert len(chunks) == result.num_rounds


def test_sampled_generation_with_rejections_keeps_kv_in_step(int8_client):
    """The client checks every reported kv_length against its own bookkeeping and raises
    on any mismatch; rounds with rejections exercise truncation on both sides."""
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=5, ignore_eos=True)
    result = int8_client.generate(PROMPTS[2], params, num_speculative_tokens=4)
    assert len(result.token_ids) == 40
    assert 0 < result.num_accepted_tokens < result.num_draft_tokens  # there were rejections
    again = int8_client.generate(PROMPTS[2], params, num_speculative_tokens=4)
    assert again.token_ids == result.token_ids  # seeded: reproducible


def test_services_hold_exactly_the_requested_kv_length(drafter_stub, verifier_stub):
    prompt = list(range(1000, 1012))
    d = drafter_stub.OpenSession(pb.OpenSessionRequest()).session_id
    v = verifier_stub.OpenSession(pb.OpenSessionRequest()).session_id
    r = drafter_stub.Draft(pb.DraftRequest(session_id=d, truncate_to=0, append_token_ids=prompt,
                                           num_draft_tokens=4, sampling=GREEDY))
    assert r.kv_length == len(prompt) + 3 and len(r.draft_token_ids) == 4
    # Verify deliberately wrong drafts: greedy rejects at the first, nothing past it stays cached.
    bad_drafts = [(t + 1) % 49152 for t in r.draft_token_ids]
    vr = verifier_stub.Verify(pb.VerifyRequest(session_id=v, truncate_to=0, append_token_ids=prompt,
                                               draft_token_ids=bad_drafts, sampling=GREEDY))
    assert vr.num_accepted == 0 and vr.kv_length == len(prompt)
    assert list(vr.output_token_ids) == [r.draft_token_ids[0]]  # the target's own argmax
    # Drafter truncates back to the committed prefix and drafts after the recovered token.
    r2 = drafter_stub.Draft(pb.DraftRequest(session_id=d, truncate_to=len(prompt), num_draft_tokens=2,
                                            append_token_ids=list(vr.output_token_ids), sampling=GREEDY))
    assert r2.kv_length == len(prompt) + 1 + 1
    assert list(r2.draft_token_ids) == list(r.draft_token_ids[1:3])
    # truncate_to beyond the cache: OUT_OF_RANGE, and the session keeps working unchanged.
    with pytest.raises(grpc.RpcError) as err:
        verifier_stub.Verify(pb.VerifyRequest(session_id=v, truncate_to=len(prompt) + 5,
                                              append_token_ids=[1], sampling=GREEDY))
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
    ok = verifier_stub.Verify(pb.VerifyRequest(session_id=v, truncate_to=len(prompt),
                                               append_token_ids=list(vr.output_token_ids),
                                               draft_token_ids=list(r2.draft_token_ids), sampling=GREEDY))
    assert ok.num_accepted == 2 and ok.kv_length == len(prompt) + 3
    for stub, sid in ((drafter_stub, d), (verifier_stub, v)):
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


def _code_and_details(call):
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def test_an_unknown_session_id_is_echoed_escaped_and_cut(drafter_stub, verifier_stub):
    """A 30 kB id echoed whole in the details passed gRPC's metadata limit (RESOURCE_EXHAUSTED
    instead of NOT_FOUND); a newline in one forged a line of the server's log."""
    forged = "abc\nts=0 level=WARNING logger=specdec.rpc FORGED"
    for sid in ("x" * 30_000, forged):
        for call in (lambda: verifier_stub.Verify(pb.VerifyRequest(session_id=sid, append_token_ids=[1], sampling=GREEDY)),
                     lambda: drafter_stub.CloseSession(pb.CloseSessionRequest(session_id=sid))):
            code, details = _code_and_details(call)
            assert code == grpc.StatusCode.NOT_FOUND and "unknown session" in details
            assert len(details) < 200 and "\n" not in details


def test_bad_input_gets_clear_status_codes_and_the_session_survives(drafter_stub, verifier_stub):
    code, details = _code_and_details(lambda: verifier_stub.Verify(
        pb.VerifyRequest(session_id="no-such-session", truncate_to=0, append_token_ids=[1], sampling=GREEDY)))
    assert code == grpc.StatusCode.NOT_FOUND and "unknown session" in details
    d = drafter_stub.OpenSession(pb.OpenSessionRequest()).session_id
    v = verifier_stub.OpenSession(pb.OpenSessionRequest()).session_id
    cases = [
        ("append_token_ids", dict(append_token_ids=[49152]), None),
        ("num_draft_tokens", dict(append_token_ids=[1], num_draft_tokens=-1), None),
        ("num_draft_tokens", dict(append_token_ids=[1], num_draft_tokens=9), None),
        ("temperature", dict(append_token_ids=[1], num_draft_tokens=1), pb.SamplingParams(temperature=-1)),
        ("top_p", dict(append_token_ids=[1], num_draft_tokens=1), pb.SamplingParams(top_p=0.0)),
        ("top_p", dict(append_token_ids=[1], num_draft_tokens=1), pb.SamplingParams(top_p=1.5)),
        ("top_k", dict(append_token_ids=[1], num_draft_tokens=1), pb.SamplingParams(top_k=-2)),
        ("append_token_ids", dict(append_token_ids=[]), None),
        ("truncate_to", dict(append_token_ids=[1], truncate_to=-5), None),
    ]
    for field, fields, sampling in cases:
        req = pb.DraftRequest(session_id=d, sampling=sampling or GREEDY, **{"truncate_to": 0, **fields})
        code, details = _code_and_details(lambda: drafter_stub.Draft(req))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details, (field, code, details)
    for field, req in [
        ("draft_token_ids", pb.VerifyRequest(session_id=v, append_token_ids=[1], draft_token_ids=[10**6],
                                             sampling=GREEDY)),
        ("draft_token_ids", pb.VerifyRequest(session_id=v, append_token_ids=[1], draft_token_ids=[1] * 9,
                                             sampling=GREEDY)),
        ("proposal", pb.VerifyRequest(session_id=v, append_token_ids=[1], draft_token_ids=[1],
                                      sampling=pb.SamplingParams(temperature=1.0))),
        ("truncate_to", pb.VerifyRequest(session_id=v, truncate_to=-5, append_token_ids=[1], sampling=GREEDY)),
        ("proposal.probs", pb.VerifyRequest(session_id=v, append_token_ids=[1], draft_token_ids=[1],
                                            sampling=pb.SamplingParams(temperature=1.0),
                                            proposal=pb.Proposal(kind=pb.DENSE, shape=[1, 49152], probs=b"x"))),
    ]:
        code, details = _code_and_details(lambda: verifier_stub.Verify(req))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details, (field, code, details)
    # Nothing was corrupted: both sessions still serve a normal round.
    r = drafter_stub.Draft(pb.DraftRequest(session_id=d, truncate_to=0, append_token_ids=[1, 2, 3],
                                           num_draft_tokens=2, sampling=GREEDY))
    assert r.kv_length == 4
    vr = verifier_stub.Verify(pb.VerifyRequest(session_id=v, truncate_to=0, append_token_ids=[1, 2, 3],
                                               draft_token_ids=list(r.draft_token_ids), sampling=GREEDY))
    assert vr.kv_length == 3 + vr.num_accepted
    drafter_stub.CloseSession(pb.CloseSessionRequest(session_id=d))
    verifier_stub.CloseSession(pb.CloseSessionRequest(session_id=v))
    code, _ = _code_and_details(lambda: drafter_stub.CloseSession(pb.CloseSessionRequest(session_id=d)))
    assert code == grpc.StatusCode.NOT_FOUND


def test_client_refuses_mismatched_vocabularies_and_oversized_requests(client):
    info = client.verifier_info
    other = ModelInfo(**{**info.__dict__, "tokenizer_fingerprint": "0" * 64, "model": "other"})
    with pytest.raises(IncompatibleModels, match="different tokenizers"):
        check_compatible(other, info)
    with pytest.raises(IncompatibleModels, match="vocab_size .* is larger than verifier vocab_size"):
        check_compatible(ModelInfo(**{**info.__dict__, "vocab_size": info.vocab_size + 128}), info)
    check_compatible(ModelInfo(**{**info.__dict__, "vocab_size": info.vocab_size - 128}), info)  # a padded target head
    with pytest.raises(ValueError, match="maximum context"):  # "hello" is one token: two past what fits
        client.generate("hello", SamplingParams(max_tokens=info.max_context + 1))


def test_the_python_client_takes_text_token_ids_or_chat_messages_and_names_what_it_refuses(client):
    greedy = SamplingParams(temperature=0, max_tokens=6)
    messages = [{"role": "user", "content": "Name a colour."}]
    as_messages = client.generate(messages, greedy)
    assert as_messages.token_ids == client.generate("Name a colour.", greedy, chat=True).token_ids
    assert as_messages.prompt_token_ids == client.encode_chat(messages)
    ids = client.encode_prompt("The capital of France is")
    assert client.generate(tuple(ids), greedy).token_ids == client.generate("The capital of France is", greedy).token_ids
    with pytest.raises(ValueError, match="chat=True applies the chat template to a string or to messages"):
        client.generate(ids, greedy, chat=True)  # the ids went out without a template before
    with pytest.raises(ValueError, match=f"token id {client.verifier_info.vocab_size} is outside"):
        client.generate([1, client.verifier_info.vocab_size], greedy)  # refused before any session opens
    with pytest.raises(TypeError, match="params must be a SamplingParams, got dict"):
        client.generate("hello", {"max_tokens": 3})
    for not_a_prompt in (None, b"hello", [True, False]):  # bytes and bools iterate as ints
        with pytest.raises(TypeError, match="prompt must be a string"):
            client.generate(not_a_prompt, greedy)
    vocab = client.verifier_info.vocab_size
    with pytest.raises(ValueError, match=f"stop_token_ids: token id {vocab} is outside"):
        client.generate("hello", greedy.replace(stop_token_ids=(vocab,)))  # not the services' raw RpcError
    for bad, expected in (({"logit_bias": {vocab: 5.0}}, f"logit_bias: token id {vocab} is outside"),
                          ({"allowed_token_ids": [5, vocab]}, f"allowed_token_ids: token id {vocab} is outside"),
                          ({"allowed_token_ids": list(client.verifier_info.eos_token_ids), "min_tokens": 2},
                           "min_tokens masks every allowed token")):
        with pytest.raises(ValueError, match=expected):  # also before any session opens
            client.generate("hello", greedy.replace(**bad))
    # no content is the empty string, as the gateway and vLLM read it (the client refused it before)
    assert client.encode_chat([{"role": "user"}]) == client.encode_chat([{"role": "user", "content": ""}])
    for bad_chat, expected in (([{"role": "user", "content": 5}], r"messages\[0\] \(user\) needs a 'content' string"),
                               ([{"content": "hi"}], r"messages\[0\] must be a dict with a string 'role'")):
        with pytest.raises(ValueError, match=expected):
            client.generate(bad_chat, greedy)
    for gamma in (-1, "4", 1.5, True):
        with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 0 or 'auto'"):
            client.generate("hello", greedy, num_speculative_tokens=gamma)
    with pytest.raises(ValueError, match="fanout must be an integer >= 0"):
        client.generate("hello", greedy, fanout="2")


def test_the_client_constructor_names_a_bad_address_gamma_or_timeout(verifier_proc):
    verifier = verifier_proc.address
    for kwargs, expected in (({"verifier": "127.0.0.1"}, "needs a port: HOST:PORT"),
                             ({"verifier": verifier, "drafter": "[::1]"}, "needs a port"),
                             ({"verifier": "127.0.0.1:70000"}, "the port must be in 1-65535"),
                             ({"verifier": verifier, "num_speculative_tokens": -2}, "num_speculative_tokens"),
                             ({"verifier": verifier, "fanout": -1}, "fanout must be"),
                             ({"verifier": verifier, "timeout_s": 0}, "timeout_s must be a positive number")):
        with pytest.raises(ValueError, match=expected):
            SpeculativeClient(**kwargs)


def test_a_timeout_s_too_short_for_any_call_is_named_and_its_sessions_are_closed(verifier_proc, verifier_stub):
    """A healthy verifier and a per-call deadline it cannot meet (a hunt set 2 ms): the error
    names timeout_s, not only "no verifier answered", and the sessions the client learnt of do
    not stay open (a CloseSession gets at least _CLOSE_MIN_S: with the same 2 ms a slower host
    left them to the server's TTL)."""
    from client.speculative import NoServerAvailable

    before = verifier_stub.GetStats(pb.StatsRequest()).live_sessions
    client = SpeculativeClient(verifier_proc.address, recovery_timeout_s=2)  # connects with the default timeout
    client.timeout_s = 0.002
    try:
        with pytest.raises(NoServerAvailable, match=r"timeout_s = 0\.002 s"):
            client.generate("Hello " * 300, SamplingParams(temperature=0, max_tokens=20), target_only=True)
    finally:
        client.close()
    # A session whose OpenSession answered after the client's deadline is one the client never
    # learnt of: the server closes it when it sees the deadline passed, but one whose deadline
    # passes after that check stays until the TTL, so the bound is the sessions opened in time.
    opened = verifier_stub.GetStats(pb.StatsRequest()).live_sessions - before
    assert opened <= 2, opened


def test_first_token_over_grpc_follows_target_distribution(int8_client, target_lm, int8_lm):
    """H0: the first token ~ p (temperature 1). 300 end-to-end generations with the int8
    drafter (gamma = 1), seeds 0..299, 8 at a time (the services batch their rounds; a seed's
    draws do not depend on the batch), chi-square over cells with expected count >= 5."""
    prompt = "My favourite animal is the"
    n = 300

    def first_token(seed: int) -> int:
        r = int8_client.generate(prompt, SamplingParams(temperature=1.0, max_tokens=2, seed=seed, ignore_eos=True),
                                 num_speculative_tokens=1)
        return r.token_ids[0]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        counts = collections.Counter(pool.map(first_token, range(n)))
    ids = torch.tensor([int8_client.encode_prompt(prompt)])
    with torch.inference_mode():
        p = logits_to_probs(target_lm.model(ids).logits[:, -1], SamplingParams())[0]
        q = logits_to_probs(int8_lm.model(ids).logits[:, -1], SamplingParams())[0]
    assert chi_square_pvalue(counts, {t: float(p[t]) for t in range(p.numel())}, n) > 0.001
    # Power: had the output followed the drafter's q, the same test at this n would reject it.
    gen = torch.Generator().manual_seed(0)
    from_q = collections.Counter(torch.multinomial(q, n, replacement=True, generator=gen).tolist())
    assert chi_square_pvalue(from_q, {t: float(p[t]) for t in range(p.numel())}, n) < 0.001


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_the_readmes_demo_runs_both_services_and_the_gateway_and_stops_them():
    """`specdec demo` (the README's first command), shortened: both services start, speculative
    output equals target-only, the gateway answers on the port --gateway-args names, and every
    process is gone after it exits."""
    port = free_port()  # for the gateway
    run = _cli("demo", "--prompt", "Name a colour.", "--max-tokens", "8", "--gateway-args",
               f"--port {port} --api-key sk-demo", timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "identical to target-only" in run.stdout and "speedup" in run.stdout and "it answers: '" in run.stdout
    # the gateway's key is the demo's too (it read a 401 as an answer), and its curl line says how to keep it up
    assert "-H 'Authorization: Bearer sk-demo'" in run.stdout and "--keep-running" in run.stdout
    addresses = re.search(r"drafter at (\S+), verifier at (\S+)", run.stdout).groups()
    gateway = re.search(r"gateway at http://(\S+)/v1", run.stdout).group(1)
    assert gateway == f"127.0.0.1:{port}"
    for address in (*addresses, gateway):  # stopped: nothing listens there any more
        host, port = address.rsplit(":", 1)
        with socket.socket() as s:
            assert s.connect_ex((host, int(port))) != 0, address


def test_a_demo_whose_gateway_cannot_start_says_why_in_one_line():
    """The gateway's port is taken: the demo ran its comparison, then ended in a traceback
    (ServiceStartError); it says the gateway's own error, as for the services, and stops them."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        run = _cli("demo", "--prompt", "Name a colour.", "--max-tokens", "4", "--gateway-args", f"--port {port}",
                   timeout=600)
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert "the gateway did not start" in run.stderr and str(port) in run.stderr, run.stderr[-2000:]


def test_cli_generate_json_speculative_and_target_only(drafter_proc, verifier_proc):
    common = ["generate", "--verifier", verifier_proc.address, "--prompt", "Name a colour.", "--chat",
              "--max-tokens", "12", "--json"]
    spec = _cli(*common, "--drafter", drafter_proc.address, "--num-speculative-tokens", "20")
    base = _cli(*common, "--target-only")
    assert spec.returncode == 0 and base.returncode == 0, spec.stderr + base.stderr
    # the services cap γ at their --max-draft-tokens (8): said on stderr, not done silently
    assert "num_speculative_tokens 20 is past the services' max_draft_tokens" in spec.stderr
    s, b = json.loads(spec.stdout), json.loads(base.stdout)
    for key in ("text", "token_ids", "num_rounds", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate",
                "elapsed_s"):
        assert key in s and key in b
    assert s["token_ids"] == b["token_ids"] and b["num_draft_tokens"] == 0 and s["num_draft_tokens"] > 0


def test_cli_generate_prints_logprobs_without_json_as_json_gives_them(verifier_proc):
    """--logprobs without --json: a line per generated token after the text, with the
    logprob, rank and top-N that --json's result holds for the same (greedy) generation."""
    common = ["generate", "--verifier", verifier_proc.address, "--target-only", "--prompt", "Name a colour.",
              "--chat", "--max-tokens", "6", "--ignore-eos", "--logprobs", "2"]
    text, js = _cli(*common), _cli(*common, "--json")
    assert text.returncode == 0 and js.returncode == 0, text.stderr + js.stderr
    entries = json.loads(js.stdout)["logprobs"]
    lines = text.stdout.splitlines()[-6:]
    assert len(entries) == 6 and len(lines) == 6, text.stdout
    for line, entry in zip(lines, entries):
        numbers = re.findall(r"-?\d+\.\d+", line)
        assert float(numbers[0]) == pytest.approx(entry["logprob"], abs=1e-4), (line, entry)
        assert f"rank {entry['rank']} " in line and len(numbers) == 1 + len(entry["top_logprobs"]) == 3, line
    # top_k 1: the runner-up has logprob -inf under the processed distribution; strict JSON (jq)
    # has no -Infinity, so it is -9999.0, as vLLM's server writes it.
    filtered = _cli(*common, "--json", "--temperature", "1", "--top-k", "1", "--seed", "1")
    assert filtered.returncode == 0, filtered.stderr
    entries = json.loads(filtered.stdout, parse_constant=lambda c: pytest.fail(f"{c} in --json output"))["logprobs"]
    assert all(sorted(e["top_logprobs"].values()) == [-9999.0, 0.0] for e in entries), entries


@pytest.mark.parametrize("flag,value", [("--temperature", "-1"), ("--top-p", "2"), ("--top-k", "-3"),
                                        ("--max-tokens", "0"), ("--timeout-s", "0"), ("--timeout-s", "-1")])
def test_cli_bad_argument_exits_nonzero_naming_it(flag, value):
    r = _cli("generate", "--verifier", "127.0.0.1:1", "--target-only", "--prompt", "x", flag, value, timeout=60)
    assert r.returncode != 0
    assert flag in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_closing_a_client_closes_the_sessions_of_a_stream_left_unfinished(drafter_proc, verifier_proc,
                                                                          verifier_stub, drafter_stub):
    """A `stream` taken for two chunks and then abandoned (still referenced): close() ends its
    sessions on both services; the generator, closed later, raises nothing, and one resumed
    says that its output is incomplete (ClientClosed), not that it ended. The gateway answers
    that as 503."""

    def live() -> tuple[int, int]:
        return (verifier_stub.GetStats(pb.StatsRequest(), timeout=10).live_sessions,
                drafter_stub.GetStats(pb.StatsRequest(), timeout=10).live_sessions)

    before = live()
    client = SpeculativeClient(verifier_proc.address, drafter=drafter_proc.address, num_speculative_tokens=2)
    stream = client.stream(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=32))
    next(stream)
    next(stream)  # a drafting round: the drafter holds a session too
    assert live()[0] == before[0] + 1
    resumed = client.stream(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=32))
    next(resumed)
    client.close()
    assert live() == before
    stream.close()  # its own end finds the sessions closed already
    with pytest.raises(ClientClosed, match="cancelled"):
        for _ in resumed:  # chunks made before close(), then the error
            pass
    assert upstream_error(ClientClosed("closing")).status == 503
    # every verifier down and none due for a retry within the wait: 503, not a bare 500
    unavailable = upstream_error(NoServerAvailable("no verifier could be tried within 1 s"))
    assert (unavailable.status, unavailable.code) == (503, "upstream_unavailable")
    with pytest.raises(ClientClosed, match="closed"):
        next(client.stream(PROMPTS[0]))


def test_a_caller_that_stops_at_the_last_chunk_leaves_no_session_open(verifier_proc, verifier_stub):
    """A caller that stops reading as soon as it has the result (the gateway ends every stream
    so) may cancel the generation while it closes its sessions: the close still happens. Each
    side of the race is tried: 12 streams stopped at the last chunk, 4 blocking, 8 from
    another event loop."""

    def live() -> int:
        return verifier_stub.GetStats(pb.StatsRequest(), timeout=10).live_sessions

    before = live()
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with SpeculativeClient(verifier_proc.address) as client:
        for i in range(4):
            for chunk in client.stream(PROMPTS[i % len(PROMPTS)], params, target_only=True):
                if chunk.result is not None:
                    break  # closes the generator with the generation still finishing

        async def stop_at_the_result(prompt) -> None:
            async for chunk in client.astream(prompt, params, target_only=True):
                if chunk.result is not None:
                    return

        async def main() -> None:
            await asyncio.gather(*(stop_at_the_result(PROMPTS[i % len(PROMPTS)]) for i in range(8)))

        asyncio.run(main())
        deadline = time.monotonic() + 10  # the last closes may still be on their way
        while live() != before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert live() == before


def test_max_tokens_none_generates_up_to_the_verifiers_context(drafter_proc):
    """vLLM's SamplingParams(max_tokens=None): up to the context, prompt + max_tokens =
    max_context; a prompt that fills the context is refused naming max_tokens."""
    from client.launcher import start_service
    from specdec.errors import InvalidArgument

    with start_service("verifier", ["--max-model-len", "24", "--log-level", "WARNING"], threads=1) as svc, \
            SpeculativeClient(svc.address, drafter=drafter_proc.address) as client:
        assert client.verifier_info.max_context == 24
        ids = client.encode_prompt(PROMPTS[2])
        unbounded = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
        spec = client.generate(ids, unbounded, num_speculative_tokens=3)
        base = client.generate(ids, unbounded.replace(max_tokens=24 - len(ids)), target_only=True)
        assert len(spec.token_ids) == 24 - len(ids) and spec.finish_reason == "length"
        assert spec.token_ids == base.token_ids and spec.num_draft_tokens > 0
        with pytest.raises(InvalidArgument, match="fill the verifier's maximum context 24") as err:
            client.generate(list(range(100, 124)), unbounded)
        assert err.value.field == "max_tokens"
        with pytest.raises(InvalidArgument, match="tokens left in the verifier's context 24") as err:
            client.generate(ids, unbounded.replace(min_tokens=24 - len(ids) + 1))  # not "max_tokens=..." it never set
        assert err.value.field == "min_tokens"


def test_a_fixed_gamma_past_the_services_cap_is_said_once_at_start(drafter_proc, verifier_proc, caplog):
    """The services' --max-draft-tokens (8 here) caps every round's drafts: a client (or a
    gateway) asked for 20 says so in one warning at start, instead of drafting 8 silently."""
    with caplog.at_level("WARNING", logger="client.speculative"), \
            SpeculativeClient(verifier_proc.address, drafter=drafter_proc.address, num_speculative_tokens=20) as c:
        result = c.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=12))
    warned = [r.getMessage() for r in caplog.records if "num_speculative_tokens" in r.getMessage()]
    assert warned == ["num_speculative_tokens 20 is past the services' max_draft_tokens (drafter 8, verifier 8): "
                      "rounds draft at most 8"]
    assert 0 < result.num_draft_tokens <= 8 * result.num_rounds


def test_random_model_refuses_an_out_path_that_is_a_file(tmp_path):
    target = tmp_path / "model.txt"
    target.write_text("keep me")
    r = _cli("random-model", "--preset", "tiny", "--out", str(target), timeout=120)
    assert r.returncode == 2 and "is a file" in r.stderr
    assert target.read_text() == "keep me"


def _first_call(service, stub: str, sid: str, append: list[int], **fields):
    """The future of a greedy Verify, or of a Draft of 2 tokens, appending `append` to an empty session."""
    sampling = pb.SamplingParams(temperature=0)
    if stub == "verifier":
        return service.Verify.future(pb.VerifyRequest(session_id=sid, truncate_to=0, append_token_ids=append,
                                                      sampling=sampling, **fields))
    return service.Draft.future(pb.DraftRequest(session_id=sid, truncate_to=0, append_token_ids=append,
                                                num_draft_tokens=2, sampling=sampling, **fields))


@pytest.mark.parametrize("stub", ["verifier", "drafter"])
def test_closing_a_session_drops_the_rest_of_its_calls_prefill(verifier_stub, drafter_stub, client, stub):
    """A client that gives up on a generation (a cancelled HTTP request) closes its sessions:
    the rest of a long prompt's chunked prefill is dropped, its call fails NOT_FOUND saying
    why, and the engine stops stepping for it. Before, the prefill ran to its end, ahead of
    every other session's rounds (8 abandoned 1,800-token prompts: a CPU verifier busy 50 s)."""
    service = verifier_stub if stub == "verifier" else drafter_stub
    ids = client.encode_prompt("a long shared document about nothing in particular " * 200)[:1800]
    sid = service.OpenSession(pb.OpenSessionRequest()).session_id
    call = _first_call(service, stub, sid, ids, prompt_length=len(ids))
    stats = service.GetStats(pb.StatsRequest())
    before = stats.forwards
    deadline = time.monotonic() + 60
    while service.GetStats(pb.StatsRequest()).forwards == before and not call.done():  # its first chunk ran
        assert time.monotonic() < deadline
        time.sleep(0.005)
    service.CloseSession(pb.CloseSessionRequest(session_id=sid))
    with pytest.raises(grpc.RpcError) as err:
        call.result(timeout=60)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "closed while its call was in flight" in err.value.details()
    after = service.GetStats(pb.StatsRequest())
    time.sleep(0.5)
    assert service.GetStats(pb.StatsRequest()).forwards == after.forwards  # nothing more ran for it
    # A client giving up is no engine failure (alerts watch failed_requests).
    assert (after.cancelled_requests, after.failed_requests) == (stats.cancelled_requests + 1, stats.failed_requests)


@pytest.mark.parametrize("stub", ["verifier", "drafter"])
def test_a_call_its_client_cancelled_stops_its_prefill_and_frees_its_session(verifier_stub, drafter_stub, client, stub):
    """A caller that gives up on a call (cancels it, or its deadline passes) without closing
    the session: the rest of the call's chunked prefill is dropped and the session is free at
    once, cropped back to where the call started. Before, the dead call prefilled on to its
    end, and a retry on the session was refused FAILED_PRECONDITION meanwhile."""
    service = verifier_stub if stub == "verifier" else drafter_stub
    ids = client.encode_prompt("a long shared document about nothing in particular " * 200)[:1800]
    chunks = -(-len(ids) // 256)  # the CPU's default --max-num-batched-tokens

    def call(sid: str, append: list[int]):
        return _first_call(service, stub, sid, append)

    sid = service.OpenSession(pb.OpenSessionRequest()).session_id
    before = service.GetStats(pb.StatsRequest())
    dead = call(sid, ids)
    wait_for(lambda: service.GetStats(pb.StatsRequest()).forwards > before.forwards, 60, "the prefill's first chunk")
    dead.cancel()
    short = ids[:5]
    deadline = time.monotonic() + 30
    while True:  # the server drops the dead call at its next step
        try:
            retried = call(sid, short).result(timeout=60)
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION and time.monotonic() < deadline, exc
            time.sleep(0.01)
    after = service.GetStats(pb.StatsRequest())
    # A client giving up is no engine failure (alerts watch failed_requests).
    assert (after.cancelled_requests, after.failed_requests) == (before.cancelled_requests + 1, before.failed_requests)
    fresh = call(service.OpenSession(pb.OpenSessionRequest()).session_id, short).result(timeout=60)
    retry_forwards = service.GetStats(pb.StatsRequest()).forwards - after.forwards  # what the retry's call ran
    assert 1 <= after.forwards - before.forwards - retry_forwards <= chunks // 2  # the dead prefill stopped early
    # Cropped back to 0 before the retry appended (a drafter's length also counts its first draft).
    assert retried.kv_length == fresh.kv_length == len(short) + (stub == "drafter")
    field = "output_token_ids" if stub == "verifier" else "draft_token_ids"
    assert list(getattr(retried, field)) == list(getattr(fresh, field))


@pytest.mark.slow
def test_cli_generate_says_its_verifier_is_gone_once_recovery_gives_up(drafter_proc):
    """The verifier is killed mid-output: generate prints the pool's error as soon as recovery
    gives up (it came after the client's close, whose last try at the lost session waits for
    the channel, and a CloseSession warning before it), then exits 1, nothing else on stderr
    but the loss it recovered from."""
    import select

    from client.launcher import start_service

    verifier = start_service("verifier", ["--log-level", "WARNING"], threads=1)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "generate", "--verifier", verifier.address,
                                 "--drafter", drafter_proc.address, "--prompt", "Tell me a long story.",
                                 "--max-tokens", "1500", "--ignore-eos", "--recovery-timeout-s", "1"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert select.select([proc.stdout], [], [], 120)[0] and proc.stdout.read(1), proc.stderr.read()
            verifier.kill()
            assert proc.wait(timeout=60) == 1
            lines = proc.stderr.read().decode().splitlines()
            assert lines[-1].startswith(f"specdec generate: error: no verifier of {verifier.address} answered "
                                        "within 1 s; the last error: UNAVAILABLE"), lines
            assert all("lost session" in line for line in lines[:-1]), lines
        finally:
            proc.kill()
    finally:
        verifier.kill()


@pytest.mark.slow
def test_sigterm_sighup_or_a_reader_gone_end_cli_generate_as_ctrl_c_does_closing_its_sessions():
    """`timeout`, `docker stop` and a compose run's teardown send SIGTERM; a closed terminal
    SIGHUP; `specdec generate ... | head` closes its pipe. Each stops generate as Ctrl-C does,
    its sessions closed on both services (SIGTERM's and SIGHUP's were held until their 10-minute
    TTL), with 128 + the signal's number (SIGPIPE's for the pipe, and no error printed: it was
    "error: [Errno 32] Broken pipe", exit 1). Services of its own: the shared pair's live counts
    move with other tests' sessions (one expiring at its TTL in this window failed the check)."""
    import select
    import signal

    from client.launcher import start_services

    with start_services([("verifier", ["--log-level", "WARNING"]), ("drafter", ["--log-level", "WARNING"])],
                        threads=1) as (verifier, drafter), \
            grpc.insecure_channel(verifier.address) as vc, grpc.insecure_channel(drafter.address) as dc:
        stubs = (pb_grpc.VerifierStub(vc), pb_grpc.DrafterStub(dc))

        def live() -> tuple[int, int]:
            return tuple(stub.GetStats(pb.StatsRequest(), timeout=10).live_sessions for stub in stubs)

        for ending in (signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
            proc = subprocess.Popen([sys.executable, "-m", "cli", "generate", "--verifier", verifier.address,
                                     "--drafter", drafter.address, "--prompt", "Tell me a long story.", "--chat",
                                     "--max-tokens", "2000", "--ignore-eos", "--num-speculative-tokens", "4"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            try:
                # Its first text, then both sessions open: the first token is the verifier's alone,
                # and on one device the drafter's session opens with the second round, after it.
                assert select.select([proc.stdout], [], [], 120)[0] and proc.stdout.read(1), proc.stderr.read()
                deadline = time.monotonic() + 60
                while live() != (1, 1) and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert live() == (1, 1), ending.name
                if ending == signal.SIGPIPE:
                    proc.stdout.close()  # the reader leaves: its next write fails
                else:
                    proc.send_signal(ending)
                assert proc.wait(timeout=30) == 128 + ending, (ending.name, proc.stderr.read())
                errors = proc.stderr.read()
                assert b"Traceback" not in errors and b"error" not in errors, (ending.name, errors)
                assert live() == (0, 0), ending.name  # closed by the client before it exited, not left to the TTL
            finally:
                proc.kill()
