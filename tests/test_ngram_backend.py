"""The prompt-lookup drafter (`specdec drafter --backend ngram`): its session bookkeeping,
its error codes, and end to end against the real verifier (greedy identity, seeded
reproducibility, and losslessness of its one-hot proposals at temperature 1)."""

from __future__ import annotations

import collections
import concurrent.futures

import grpc
import pytest
import torch

from client.launcher import start_service
from drafter_service.ngram_engine import NgramDrafterEngine
from specdec.errors import InvalidArgument, OutOfRange, SessionNotFound
from specdec.models import ModelSpec
from specdec.proposals import DENSE, IDS_ONLY, ProposalFormat
from specdec.sampling import SamplingParams, logits_to_probs
from specdec.serving import EngineConfig
from specdec_rpc import specdec_pb2 as pb
from specdec_rpc import specdec_pb2_grpc as pb_grpc
from specdec_rpc.adapters import sampling_to_pb
from tests.conftest import SERVICE_THREADS, chi_square_pvalue

GREEDY = SamplingParams(temperature=0.0)


# ---- the engine in-process ----------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    eng = NgramDrafterEngine(ModelSpec(), EngineConfig(max_draft_tokens=8))
    yield eng
    eng.shutdown()


def test_model_info_is_the_models_without_its_weights(engine, target_lm):
    info = engine.info
    assert info.role == "drafter" and info.model.startswith("ngram[1-4]:") and info.dtype == "none"
    assert info.vocab_size == target_lm.vocab_size
    assert info.eos_token_ids == tuple(target_lm.eos_token_ids)
    assert info.max_context == target_lm.max_context
    assert info.tokenizer_fingerprint == target_lm.tokenizer_fingerprint


def test_session_holds_committed_plus_all_drafts_but_the_last(engine):
    sid = engine.open_session()
    out = engine.draft(sid, 0, [5, 6, 7, 8, 1, 5, 6], 3, GREEDY)
    assert out.draft_token_ids == [7, 8, 1]
    assert out.kv_length == 9 and engine.sessions._sessions[sid].tokens == [5, 6, 7, 8, 1, 5, 6, 7, 8]
    # The verifier accepted 7 and emitted 9: keep the agreeing prefix (8 tokens), append the new token.
    out = engine.draft(sid, 8, [9], 2, GREEDY)
    assert out.draft_token_ids == [] and out.kv_length == 9  # "9" never occurred before
    assert engine.sessions._sessions[sid].tokens == [5, 6, 7, 8, 1, 5, 6, 7, 9]
    # Or it emitted 8: "5 6 7 8" recurs, followed by 1 5.
    out = engine.draft(sid, 8, [8], 2, GREEDY)
    assert out.draft_token_ids == [1, 5] and out.kv_length == 10
    assert engine.sessions._sessions[sid].tokens == [5, 6, 7, 8, 1, 5, 6, 7, 8, 1]
    engine.close_session(sid)


def test_truncation_drops_the_tail_and_drafts_follow_the_new_suffix(engine):
    sid = engine.open_session()
    engine.draft(sid, 0, [1, 2, 3, 4, 9, 9, 1, 2], 2, GREEDY)  # holds ... 1 2 3 (drafts 3 4)
    out = engine.draft(sid, 4, [4, 9], 2, GREEDY)  # back to [1 2 3 4], then 4 9: "9" recurs nowhere before
    assert out.draft_token_ids == [] and out.kv_length == 6
    assert engine.sessions._sessions[sid].tokens == [1, 2, 3, 4, 4, 9]
    engine.close_session(sid)


def test_no_recurring_suffix_gives_zero_drafts_and_an_empty_ids_only_proposal(engine):
    sid = engine.open_session()
    out = engine.draft(sid, 0, [10, 11, 12], 4, SamplingParams(temperature=1.0), ProposalFormat(kind=DENSE))
    assert out.draft_token_ids == [] and out.kv_length == 3
    assert out.proposal.kind == IDS_ONLY and out.proposal.shape == (0,)
    engine.close_session(sid)


def test_proposal_is_ids_only_whatever_format_was_asked(engine):
    sid = engine.open_session()
    out = engine.draft(sid, 0, [3, 4, 5, 3, 4], 2, SamplingParams(temperature=1.0, seed=1),
                       ProposalFormat(kind="sparse", top_n=8))
    assert out.draft_token_ids == [5, 3]
    assert out.proposal.kind == IDS_ONLY and out.proposal.shape == (2,) and out.proposal.nbytes == 0
    engine.close_session(sid)


def test_bad_requests_raise_the_model_drafters_errors_and_leave_the_session_intact(engine):
    sid = engine.open_session()
    engine.draft(sid, 0, [1, 2, 3], 1, GREEDY)
    with pytest.raises(InvalidArgument, match="append_token_ids"):
        engine.draft(sid, 0, [49152], 1, GREEDY)
    with pytest.raises(InvalidArgument, match="num_draft_tokens"):
        engine.draft(sid, 0, [1], 9, GREEDY)
    with pytest.raises(InvalidArgument, match="fanout"):
        engine.draft(sid, 0, [1], 1, GREEDY, fanout=-1)
    with pytest.raises(OutOfRange):
        engine.draft(sid, 4, [1], 1, GREEDY)
    with pytest.raises(SessionNotFound):
        engine.draft("nope", 0, [1], 1, GREEDY)
    assert engine.sessions._sessions[sid].tokens == [1, 2, 3]
    engine.close_session(sid)
    with pytest.raises(SessionNotFound, match="closed"):
        engine.draft(sid, 0, [1], 1, GREEDY)


def test_ngram_bounds_are_checked():
    with pytest.raises(ValueError, match="--ngram-max"):
        NgramDrafterEngine(ModelSpec(), n_min=3, n_max=2, lm=object())


# ---- the service, end to end --------------------------------------------------------


@pytest.fixture(scope="module")
def ngram_drafter_proc():
    with start_service("drafter", ["--backend", "ngram", "--max-draft-tokens", "8", "--log-level", "WARNING"],
                       threads=SERVICE_THREADS) as svc:
        yield svc


@pytest.fixture(scope="module")
def ngram_client(verifier_proc, ngram_drafter_proc):
    from client.speculative import SpeculativeClient

    with SpeculativeClient(verifier_proc.address, drafter=ngram_drafter_proc.address) as c:
        yield c


@pytest.fixture(scope="module")
def drafter_stub(ngram_drafter_proc):
    with grpc.insecure_channel(ngram_drafter_proc.address) as ch:
        yield pb_grpc.DrafterStub(ch)


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def test_service_answers_with_the_model_drafters_status_codes(drafter_stub):
    greedy = pb.SamplingParams(temperature=0.0)
    assert _code(lambda: drafter_stub.Draft(pb.DraftRequest(session_id="nope", append_token_ids=[1],
                                                            sampling=greedy))) == grpc.StatusCode.NOT_FOUND
    sid = drafter_stub.OpenSession(pb.OpenSessionRequest()).session_id
    r = drafter_stub.Draft(pb.DraftRequest(session_id=sid, append_token_ids=[7, 8, 9, 7], num_draft_tokens=3,
                                           sampling=pb.SamplingParams(temperature=1.0),
                                           proposal_format=pb.ProposalFormat(kind=pb.DENSE)))
    assert list(r.draft_token_ids) == [8, 9, 7] and r.kv_length == 6 and r.proposal.kind == pb.IDS_ONLY
    for req, code in [
        (pb.DraftRequest(session_id=sid, append_token_ids=[49152], sampling=greedy), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.DraftRequest(session_id=sid, append_token_ids=[], sampling=greedy), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.DraftRequest(session_id=sid, truncate_to=7, append_token_ids=[1], sampling=greedy),
         grpc.StatusCode.OUT_OF_RANGE),
    ]:
        assert _code(lambda: drafter_stub.Draft(req)) == code
    stats = drafter_stub.GetStats(pb.StatsRequest())
    assert stats.role == "drafter" and stats.draft_tokens >= 3 and stats.live_sessions >= 1
    drafter_stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    assert _code(lambda: drafter_stub.CloseSession(pb.CloseSessionRequest(session_id=sid))) == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("prompt", [
    "Repeat exactly: The quick brown fox jumps over the lazy dog near the river bank.",
    "Extract all the names from this text: Alice met Bob at the station. Later, Carol and Dave joined Alice "
    "and Bob for lunch.",
], ids=["repeat", "extract"])
def test_greedy_output_equals_target_only_and_copies_get_accepted(ngram_client, prompt):
    params = SamplingParams(temperature=0.0, max_tokens=40)
    base = ngram_client.generate(prompt, params, chat=True, target_only=True)
    spec = ngram_client.generate(prompt, params, chat=True, num_speculative_tokens=4)
    assert spec.token_ids == base.token_ids
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens > 0
    assert spec.num_rounds < len(spec.token_ids)


def test_the_lookup_reports_its_step_so_the_load_model_counts_the_drafter(drafter_stub, ngram_client, verifier_proc):
    """Each Draft answers with the load of its step (rows, milliseconds per draft), as the model
    drafter does: with none, the client's load model never had a draft-cost sample and γ ignored
    how many sessions share the verifier."""
    sid = drafter_stub.OpenSession(pb.OpenSessionRequest()).session_id
    try:
        r = drafter_stub.Draft(pb.DraftRequest(session_id=sid, append_token_ids=[7, 8, 9, 7], num_draft_tokens=3,
                                               sampling=pb.SamplingParams(temperature=0.0)))
    finally:
        drafter_stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    assert r.load.step_rows >= 1 and r.load.running_sessions >= 1 and 0 < r.load.step_ms < 50
    ngram_client.generate("Repeat exactly: one two three four five six seven eight nine ten, one two three four "
                          "five six seven eight nine ten.", SamplingParams(temperature=0.0, max_tokens=24), chat=True)
    assert ngram_client.costs(verifier_proc.address).draft.weight > 0


def test_seeded_sampling_is_reproducible(ngram_client):
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True)
    prompt = "Repeat exactly: one, two, three, four, five, six, seven."
    runs = [ngram_client.generate(prompt, params, chat=True, num_speculative_tokens=4) for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids and runs[0].num_draft_tokens > 0


# The n-gram proposes " there", "\n" after this prompt; the target gives them p ~ 0.40 and
# ~ 0.60, so both draft positions are accepted and rejected often.
STAT_PROMPT = "A: hello there\nB: hello"
STAT_N = 600
STAT_PARAMS = SamplingParams(temperature=1.0, ignore_eos=True)
STAT_WORKERS = 24  # concurrent sessions: the verifier batches their rounds


def _target_pairs(lm, prompt_ids: list[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """p(t1) [V], and p(t2 | t1) [V] for the 40 likeliest t1, processed like the verifier."""
    with torch.inference_mode():
        p1 = logits_to_probs(lm.model(torch.tensor([prompt_ids])).logits[:, -1].float(), STAT_PARAMS)[0]
        top = torch.topk(p1, 40).indices.tolist()
        rows = torch.tensor([prompt_ids + [t] for t in top])
        p2 = logits_to_probs(lm.model(rows).logits[:, -1].float(), STAT_PARAMS)
    return p1, dict(zip(top, p2))


def _sample_two_tokens(drafter, verifier, prompt_ids: list[int], seeds: range) -> list[tuple[int, int, list[int]]]:
    """(t1, t2, first round's drafts) per seed, by the client's rounds over one session per
    side: γ = 2, then (first draft rejected) a second round with γ = 1 decides t2. Each
    sample truncates both sides back to the prompt, so only its last token is re-sent."""
    d = drafter.OpenSession(pb.OpenSessionRequest()).session_id
    v = verifier.OpenSession(pb.OpenSessionRequest()).session_id
    n = len(prompt_ids)

    def round_(sampling, keep: int, append: list[int], gamma: int) -> tuple[list[int], list[int]]:
        r = drafter.Draft(pb.DraftRequest(session_id=d, truncate_to=keep, append_token_ids=append,
                                          num_draft_tokens=gamma, sampling=sampling, prompt_length=n))
        assert r.proposal.kind == pb.IDS_ONLY  # though the client's default at temperature 1 is dense
        vr = verifier.Verify(pb.VerifyRequest(session_id=v, truncate_to=keep, append_token_ids=append,
                                              draft_token_ids=list(r.draft_token_ids), proposal=r.proposal,
                                              sampling=sampling, prompt_length=n))
        return list(r.draft_token_ids), list(vr.output_token_ids)

    out = []
    for i, seed in enumerate(seeds):
        sampling = sampling_to_pb(STAT_PARAMS.replace(seed=seed))
        keep = 0 if i == 0 else n - 1
        drafts, toks = round_(sampling, keep, prompt_ids[keep:], 2)
        if len(toks) == 1:
            toks += round_(sampling, n, toks, 1)[1]
        out.append((toks[0], toks[1], drafts))
    drafter.CloseSession(pb.CloseSessionRequest(session_id=d))
    verifier.CloseSession(pb.CloseSessionRequest(session_id=v))
    return out


def test_first_two_tokens_follow_the_target_distribution(drafter_stub, verifier_proc, target_lm):
    """H0: (t1, t2) ~ p(t1) p(t2 | t1), p the target at temperature 1. N = 600 samples
    (seeds 0..599) through the n-gram drafter and the verifier service; chi-square over the
    cells with >= 5 expected."""
    prompt_ids = target_lm.tokenizer(STAT_PROMPT, add_special_tokens=False).input_ids
    draft = target_lm.tokenizer(" there\n", add_special_tokens=False).input_ids
    with grpc.insecure_channel(verifier_proc.address) as ch, \
            concurrent.futures.ThreadPoolExecutor(STAT_WORKERS) as pool:
        verifier = pb_grpc.VerifierStub(ch)
        parts = pool.map(lambda w: _sample_two_tokens(drafter_stub, verifier, prompt_ids,
                                                      range(w, STAT_N, STAT_WORKERS)), range(STAT_WORKERS))
        samples = [s for part in parts for s in part]
    assert len(samples) == STAT_N and all(drafts == draft for _, _, drafts in samples)
    # Both draft positions were accepted and rejected (t1 equals the draft iff it was accepted).
    first = collections.Counter(t1 == draft[0] for t1, _, _ in samples)
    second = collections.Counter(t2 == draft[1] for t1, t2, _ in samples if t1 == draft[0])
    assert first[True] > 50 and first[False] > 50 and second[True] > 20 and second[False] > 20
    p1, p2 = _target_pairs(target_lm, prompt_ids)
    expected = {(a, b): float(p1[a] * p2[a][b]) for a in p2 for b in range(p1.numel())
                if float(p1[a] * p2[a][b]) * STAT_N >= 5}
    assert len(expected) >= 10
    pairs = collections.Counter((t1, t2) for t1, t2, _ in samples)
    assert chi_square_pvalue(pairs, expected, STAT_N) > 0.001
    # Power: a verifier that resampled from p instead of p without the rejected draft
    # (t1 = x with p(x) + (1 - p(x)) p(x)) would be rejected at this N.
    x = draft[0]
    wrong = (1 - p1[x]) * p1
    wrong[x] += p1[x]
    gen = torch.Generator().manual_seed(0)
    t1s = torch.multinomial(wrong, STAT_N, replacement=True, generator=gen).tolist()
    from_wrong = collections.Counter(
        (a, int(torch.multinomial(p2[a], 1, generator=gen)) if a in p2 else -1) for a in t1s)
    assert chi_square_pvalue(from_wrong, expected, STAT_N) < 0.001
