"""Sampling parameters end to end: real services on loopback, the real model."""

from __future__ import annotations

import collections
import concurrent.futures

import grpc
import pytest
import torch

from specdec.errors import InvalidArgument
from specdec.proposals import DENSE, SPARSE, ProposalFormat
from specdec.sampling import SamplingParams, TokenContext, logits_to_probs, process_logits
from specdec_rpc import specdec_pb2 as pb
from specdec_rpc import specdec_pb2_grpc as pb_grpc
from specdec_rpc.adapters import proposal_format_to_pb, sampling_from_pb, sampling_to_pb
from tests.conftest import chi_square_pvalue


@pytest.fixture(scope="module")
def stubs(verifier_proc, int8_drafter_proc):
    with grpc.insecure_channel(verifier_proc.address) as vc, grpc.insecure_channel(int8_drafter_proc.address) as dc:
        yield pb_grpc.DrafterStub(dc), pb_grpc.VerifierStub(vc)


@pytest.mark.parametrize(
    "field,sampling",
    [
        ("repetition_penalty", pb.SamplingParams(repetition_penalty=0.0)),
        ("presence_penalty", pb.SamplingParams(presence_penalty=2.5)),
        ("frequency_penalty", pb.SamplingParams(frequency_penalty=-2.5)),
        ("min_tokens", pb.SamplingParams(min_tokens=-1)),
        ("logprobs", pb.SamplingParams(logprobs=50)),
        ("posterior_threshold", pb.SamplingParams(posterior_threshold=2.0)),
        ("posterior_alpha", pb.SamplingParams(posterior_alpha=-1.0)),
        ("acceptance_method", pb.SamplingParams(temperature=1.0, acceptance_method=pb.GREEDY)),
        ("acceptance_method", pb.SamplingParams(acceptance_method=99)),
        ("stop_token_ids", pb.SamplingParams(stop_token_ids=[49152])),
        ("temperature", pb.SamplingParams(temperature=float("nan"))),
        ("min_p", pb.SamplingParams(min_p=1.5)),
        # every id a stop id: min_tokens would leave no token (a NaN distribution, which sampled id V)
        ("stop_token_ids", pb.SamplingParams(min_tokens=2, stop_token_ids=range(49152))),
        # past 65,536 entries: every round re-sends and re-checks them (a million stalled everyone)
        ("stop_token_ids", pb.SamplingParams(stop_token_ids=[7] * 65_537)),
        ("allowed_token_ids", pb.SamplingParams(allowed_token_ids=[7] * 65_537)),
        ("logit_bias", pb.SamplingParams(logit_bias={i: 1.0 for i in range(65_537)})),
    ],
)
def test_invalid_sampling_parameter_is_invalid_argument_naming_it(stubs, field, sampling):
    drafter, verifier = stubs
    calls = [
        lambda: drafter.Draft(pb.DraftRequest(session_id="x", append_token_ids=[1], num_draft_tokens=1,
                                              sampling=sampling)),
        lambda: verifier.Verify(pb.VerifyRequest(session_id="x", append_token_ids=[1], sampling=sampling)),
    ]
    for call in calls:  # validated before the session is looked up: the unknown id never matters
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()


def test_one_params_object_per_sampling_message_and_rejections_are_never_remembered():
    """Every round re-sends its session's SamplingParams; the services build it once."""
    first = sampling_from_pb(pb.SamplingParams(temperature=0.5, top_p=0.9, seed=3))
    again = sampling_from_pb(pb.SamplingParams(seed=3, top_p=0.9, temperature=0.5))
    assert again is first and (first.temperature, first.seed) == (0.5, 3) and first.top_p == pytest.approx(0.9)
    other = sampling_from_pb(pb.SamplingParams(temperature=0.5, top_p=0.9, seed=4))
    assert other is not first and other.seed == 4
    for _ in range(2):  # raised each time, never stored
        with pytest.raises(InvalidArgument, match="min_p"):
            sampling_from_pb(pb.SamplingParams(min_p=1.5))
    # A long id list is built per call, never kept: the memo's keys are the messages themselves
    # (4,096 calls of a million stop ids each grew a verifier by gigabytes).
    from specdec_rpc import adapters

    before = adapters._remembered_sampling.cache_info().currsize
    long = pb.SamplingParams(stop_token_ids=range(1000))
    assert sampling_from_pb(long) == sampling_from_pb(long) and sampling_from_pb(long) is not sampling_from_pb(long)
    assert adapters._remembered_sampling.cache_info().currsize == before


def test_a_tiny_positive_temperature_is_raised_to_vllms_floor_on_both_services(stubs):
    """temperature 1e-39 divided the logits into ±inf and the softmax into NaN: the verifier
    answered token id V (past the vocabulary; INTERNAL with logprobs) and the drafter failed
    every session of the step. As vLLM, a positive temperature below 0.01 is 0.01."""
    assert SamplingParams(temperature=1e-39).temperature == SamplingParams(temperature=0.001).temperature == 0.01
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=0.02).temperature == 0.02
    drafter, verifier = stubs
    tiny = pb.SamplingParams(temperature=1e-39, seed=1, logprobs=2)
    vocab = verifier.GetModelInfo(pb.ModelInfoRequest()).vocab_size
    prompt = [1, 2, 3, 4]
    for stub, method in ((verifier, "Verify"), (drafter, "Draft")):
        sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
        try:
            if method == "Verify":
                out = list(stub.Verify(pb.VerifyRequest(session_id=sid, append_token_ids=prompt, sampling=tiny))
                           .output_token_ids)
            else:
                out = list(stub.Draft(pb.DraftRequest(session_id=sid, append_token_ids=prompt, num_draft_tokens=3,
                                                      sampling=tiny, proposal_format=proposal_format_to_pb(
                                                          ProposalFormat(kind=DENSE)))).draft_token_ids)
        finally:
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        assert out and all(0 <= t < vocab for t in out), (method, out)


def test_prompt_length_past_the_sequence_is_invalid_argument(stubs):
    _, verifier = stubs
    with pytest.raises(grpc.RpcError) as err:
        verifier.Verify(pb.VerifyRequest(session_id="x", append_token_ids=[1, 2], prompt_length=3,
                                         sampling=pb.SamplingParams(temperature=0.0)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_length" in err.value.details()


def test_first_token_with_top_p_and_sparse_proposals_follows_target(stubs, target_lm, int8_lm):
    """H0: the first token ~ p processed with top_p 0.9 (temperature 1). 400 rounds over gRPC
    with the int8 drafter, sparse top-16 proposals, gamma 2, seeds 0..399, from 8 sessions
    per side at once (the services batch their rounds); each session is prefilled once and
    every later round truncates back to the prompt."""
    params = SamplingParams(top_p=0.9)
    drafter, verifier = stubs
    ids = target_lm.tokenizer("My favourite animal is the", add_special_tokens=False).input_ids
    fmt = proposal_format_to_pb(ProposalFormat(kind=SPARSE, top_n=16))
    n, workers = 400, 8

    def rounds(seeds: range) -> list[tuple[int, int]]:
        """(first output token, accepted drafts) per seed, over one session per side."""
        d = drafter.OpenSession(pb.OpenSessionRequest()).session_id
        v = verifier.OpenSession(pb.OpenSessionRequest()).session_id
        out = []
        for i, seed in enumerate(seeds):
            sampling = sampling_to_pb(params.replace(seed=seed))
            keep = 0 if i == 0 else len(ids) - 1  # after the first round, re-send only the last prompt token
            r = drafter.Draft(pb.DraftRequest(session_id=d, truncate_to=keep, append_token_ids=ids[keep:],
                                              num_draft_tokens=2, sampling=sampling, proposal_format=fmt,
                                              prompt_length=len(ids)))
            assert r.proposal.kind == pb.SPARSE_TOP_N and list(r.proposal.shape) == [2, 16]
            vr = verifier.Verify(pb.VerifyRequest(session_id=v, truncate_to=keep, append_token_ids=ids[keep:],
                                                  draft_token_ids=list(r.draft_token_ids), proposal=r.proposal,
                                                  sampling=sampling, prompt_length=len(ids)))
            out.append((vr.output_token_ids[0], vr.num_accepted))
        drafter.CloseSession(pb.CloseSessionRequest(session_id=d))
        verifier.CloseSession(pb.CloseSessionRequest(session_id=v))
        return out

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        samples = [s for part in pool.map(rounds, (range(w, n, workers) for w in range(workers))) for s in part]
    assert len(samples) == n
    counts = collections.Counter(t for t, _ in samples)
    accepted = sum(a for _, a in samples)
    with torch.inference_mode():
        p = logits_to_probs(target_lm.model(torch.tensor([ids])).logits[:, -1], params)[0]
        q = logits_to_probs(int8_lm.model(torch.tensor([ids])).logits[:, -1], params)[0]
    assert 0 < accepted < 2 * n  # both paths (accept and resample) were taken
    expected = {t: float(p[t]) for t in range(p.numel())}
    assert chi_square_pvalue(counts, expected, n) > 0.001
    # Power: output following the drafter's q would be rejected at this n.
    from_q = collections.Counter(torch.multinomial(q, n, replacement=True,
                                                   generator=torch.Generator().manual_seed(0)).tolist())
    assert chi_square_pvalue(from_q, expected, n) < 0.001


def _reference_logprobs(lm, prompt_ids, out_ids, params):
    """Processed target distribution at every generated position, from one full forward."""
    seq = list(prompt_ids) + list(out_ids)
    with torch.inference_mode():
        logits = lm.model(torch.tensor([seq])).logits[0, len(prompt_ids) - 1 : len(seq) - 1].float()
    ctx = TokenContext(prefix=list(prompt_ids), prompt_length=len(prompt_ids), eos_token_ids=tuple(lm.eos_token_ids))
    return torch.log(process_logits(logits, params, ctx, out_ids))  # [T, V]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=10, logprobs=3),
                                    SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=10, logprobs=3,
                                                   ignore_eos=True)],
                         ids=["greedy", "temperature_top_k"])
def test_logprobs_are_the_targets_processed_logprobs(int8_client, target_lm, params):
    r = int8_client.generate("The three primary colours are", params, num_speculative_tokens=3)
    assert len(r.logprobs) == len(r.token_ids) > 0
    ref = _reference_logprobs(target_lm, r.prompt_token_ids, r.token_ids, params)
    for i, (tok, lp) in enumerate(zip(r.token_ids, r.logprobs)):
        assert lp["token_id"] == tok
        assert abs(lp["logprob"] - float(ref[i, tok])) < 1e-3
        top = torch.topk(ref[i], 3)
        assert list(lp["top_logprobs"]) == top.indices.tolist()
        assert lp["rank"] == int((ref[i] > ref[i, tok] + 1e-4).sum()) + 1
        if params.greedy:
            assert lp["rank"] == 1


def test_penalties_speculative_equals_target_only_and_transformers(client, target_lm):
    """Both services apply the penalty at each draft position with the drafts before it in the
    history, so speculative greedy output equals target-only output; repetition_penalty
    alone also equals transformers' RepetitionPenaltyLogitsProcessor."""
    prompt = "List the days of the week: Monday, Tuesday,"
    rep = SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.5, ignore_eos=True)
    plain = client.generate(prompt, rep.replace(repetition_penalty=1.0), target_only=True)
    base = client.generate(prompt, rep, target_only=True)
    assert base.token_ids != plain.token_ids  # the penalty changes the text
    ids = client.encode_prompt(prompt)
    with torch.inference_mode():
        hf = target_lm.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24,
                                      repetition_penalty=1.5)[0, len(ids):].tolist()
    assert base.token_ids == hf
    for params in (rep, rep.replace(repetition_penalty=1.0, presence_penalty=1.0, frequency_penalty=0.5)):
        target_only = client.generate(prompt, params, target_only=True)
        spec = client.generate(prompt, params, num_speculative_tokens=4)
        assert spec.token_ids == target_only.token_ids
        assert spec.num_accepted_tokens > 0


def test_min_tokens_defers_eos_and_stop_strings(client):
    prompt = "Reply with exactly one word: yes or no?"
    free = client.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40), chat=True, target_only=True)
    assert free.finish_reason == "stop" and len(free.token_ids) < 20
    want = len(free.token_ids) + 6
    for target_only in (True, False):
        r = client.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, min_tokens=want,
                                                   stop=[free.text.strip()[:2] or "y"]),
                            chat=True, target_only=target_only, num_speculative_tokens=3)
        assert len(r.token_ids) >= want
        eos = set(client.verifier_info.eos_token_ids)
        assert not eos & set(r.token_ids[: want - 1])


def test_seeded_sampling_is_reproducible_alone_and_among_concurrent_requests(int8_client):
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=16, ignore_eos=True)
    prompt = "Once upon a time"
    alone = [int8_client.generate(prompt, params, num_speculative_tokens=3).token_ids for _ in range(2)]
    assert alone[0] == alone[1]
    others = [("The weather today is", params.replace(seed=7)), ("In 1492,", params.replace(seed=None))]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(int8_client.generate, p, sp, num_speculative_tokens=2) for p, sp in others]
        mine = pool.submit(int8_client.generate, prompt, params, num_speculative_tokens=3)
        assert mine.result().token_ids == alone[0]
        assert all(len(f.result().token_ids) == 16 for f in futures)
    # gamma changes which draws are used for drafting, never the seeded output's law; with
    # the same gamma the output is identical, and a different seed changes it.
    assert int8_client.generate(prompt, params.replace(seed=43), num_speculative_tokens=3).token_ids != alone[0]


def test_typical_acceptance_thresholds_reach_the_verifier(int8_client):
    """Two deterministic ends of vLLM's rule, min(threshold, alpha * e^-H):
    threshold 0 accepts every draft with p > 0; threshold 1 with alpha 1e6 (e^-H >= 1/V
    keeps the min at 1) accepts none, so every token is a recovered argmax: the output is
    the target's greedy output."""
    prompt = "The history of Rome"
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=20, ignore_eos=True, acceptance_method="typical",
                            posterior_threshold=0.0, posterior_alpha=0.0)
    r = int8_client.generate(prompt, params, num_speculative_tokens=4)
    assert r.num_draft_tokens > 0 and r.acceptance_rate == 1.0
    strict = int8_client.generate(prompt, params.replace(posterior_threshold=1.0, posterior_alpha=1e6),
                                  num_speculative_tokens=4)
    assert strict.num_draft_tokens > 0 and strict.acceptance_rate == 0.0
    # The first round never drafts: its token is the verifier's own sample. Every later one that
    # verified drafts emitted a recovered argmax, i.e. greedy decoding after that first token.
    assert strict.gamma_per_round[0] == 0 and all(g > 0 for g in strict.gamma_per_round[1:-1])
    first = int8_client.encode_prompt(prompt) + strict.token_ids[:1]
    greedy = int8_client.generate(first, SamplingParams(temperature=0.0, max_tokens=19, ignore_eos=True),
                                  target_only=True)
    assert strict.token_ids[1:-1] == greedy.token_ids[:-1]


def test_logit_bias_and_allowed_token_ids_shape_the_output_on_both_services(int8_client, stubs, target_lm):
    """vLLM's logit_bias and allowed_token_ids, applied to the raw logits by both services:
    greedy speculative output equals target-only output under the same bias; sampled output
    stays inside the allowed set, its logprobs are the filtered target's, and the drafter
    drafts only allowed tokens (it filters too, so its drafts are worth verifying)."""
    prompt = "The three primary colours are"
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = int8_client.generate(prompt, greedy, target_only=True)
    banned = sorted(set(plain.token_ids[:3]))
    biased = greedy.replace(logit_bias={t: -100.0 for t in banned})
    reference = int8_client.generate(prompt, biased, target_only=True)
    spec = int8_client.generate(prompt, biased, num_speculative_tokens=3)
    assert spec.token_ids == reference.token_ids != plain.token_ids
    assert not set(banned) & set(reference.token_ids) and spec.num_accepted_tokens > 0

    allowed = sorted(set(int8_client.encode_prompt(" red green blue yellow, and the colours of light are")))
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, logprobs=2,
                            allowed_token_ids=allowed, logit_bias={allowed[0]: 2.0})
    r = int8_client.generate(prompt, params, num_speculative_tokens=3)
    assert set(r.token_ids) <= set(allowed) and r.num_draft_tokens > 0
    ref = _reference_logprobs(target_lm, r.prompt_token_ids, r.token_ids, params)
    assert all(abs(lp["logprob"] - float(ref[i, tok])) < 1e-3
               for i, (tok, lp) in enumerate(zip(r.token_ids, r.logprobs)))
    drafter, verifier = stubs
    ids = int8_client.encode_prompt(prompt)
    sid = drafter.OpenSession(pb.OpenSessionRequest()).session_id
    try:
        drafts = drafter.Draft(pb.DraftRequest(session_id=sid, append_token_ids=ids, num_draft_tokens=4,
                                               sampling=sampling_to_pb(params), prompt_length=len(ids)))
    finally:
        drafter.CloseSession(pb.CloseSessionRequest(session_id=sid))
    assert len(drafts.draft_token_ids) == 4 and set(drafts.draft_token_ids) <= set(allowed)


def test_token_filters_the_verifier_cannot_apply_are_invalid_argument(stubs, int8_client):
    drafter, verifier = stubs
    vocab = int8_client.verifier_info.vocab_size
    past = pb.SamplingParams(logit_bias={vocab: 1.0})
    with pytest.raises(grpc.RpcError) as err:
        verifier.Verify(pb.VerifyRequest(session_id="x", append_token_ids=[1], sampling=past))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logit_bias" in err.value.details()
    # A drafter skips ids past its head (a smaller drafter head is allowed): the session is what fails here.
    with pytest.raises(grpc.RpcError) as err:
        drafter.Draft(pb.DraftRequest(session_id="x", append_token_ids=[1], num_draft_tokens=1, sampling=past))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    eos = list(int8_client.verifier_info.eos_token_ids)
    only_eos = pb.SamplingParams(allowed_token_ids=eos, min_tokens=2)  # every row before min_tokens: -inf everywhere
    for call in (lambda: drafter.Draft(pb.DraftRequest(session_id="x", append_token_ids=[1], num_draft_tokens=1,
                                                       sampling=only_eos)),
                 lambda: verifier.Verify(pb.VerifyRequest(session_id="x", append_token_ids=[1], sampling=only_eos))):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "allowed_token_ids" in err.value.details()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_extreme_repetition_penalty_saturates_instead_of_overflowing(stubs, int8_client, temperature):
    """repetition_penalty 1e-39 is > 0, hence valid, and divided a seen token's logit into
    float32's inf: softmax gave NaN, the verifier emitted id V (its logprobs failed INTERNAL)
    and the drafter failed. Penalised logits now saturate: the seen tokens dominate."""
    drafter, verifier = stubs
    vocab = int8_client.verifier_info.vocab_size
    ids = int8_client.encode_prompt("Why is the sky blue?")
    sampling = pb.SamplingParams(temperature=temperature, seed=1, repetition_penalty=1e-39, logprobs=2)
    d, v = drafter.OpenSession(pb.OpenSessionRequest()).session_id, verifier.OpenSession(pb.OpenSessionRequest()).session_id
    try:
        drafts = drafter.Draft(pb.DraftRequest(session_id=d, append_token_ids=ids, num_draft_tokens=3, sampling=sampling,
                                               prompt_length=len(ids)))
        out = verifier.Verify(pb.VerifyRequest(session_id=v, append_token_ids=ids, sampling=sampling,
                                               prompt_length=len(ids)))
    finally:
        drafter.CloseSession(pb.CloseSessionRequest(session_id=d))
        verifier.CloseSession(pb.CloseSessionRequest(session_id=v))
    assert all(0 <= t < vocab for t in [*drafts.draft_token_ids, *out.output_token_ids])
    assert out.output_token_ids[0] in ids  # a seen token: its logit is now the largest there is
    assert all(lp.logprob == lp.logprob for lp in out.logprobs)  # not NaN
