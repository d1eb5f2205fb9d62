"""Speculation cache (DraftRequest.fanout): the bookkeeping alone, the drafter engine on
the real model (drafts, proposals and KV lengths identical to plain Draft calls, hit or
miss), and the gRPC pair (greedy = target-only; seeded sampling the same with and
without the cache)."""

from __future__ import annotations

import time

import pytest

from specdec.errors import ResourceExhausted
from specdec.speculation import SpeculationCache, SpeculationJob


class FakeSlot:
    def __init__(self, name: str) -> None:
        self.name, self.length, self.data = name, 0, []

    def __repr__(self) -> str:
        return self.name


def _copy(dst: FakeSlot, src: FakeSlot, n: int) -> None:
    dst.data, dst.length = list(src.data[:n]), n


def _cache(max_slots: int) -> tuple[SpeculationCache, list[FakeSlot]]:
    made: list[FakeSlot] = []

    def new_slot() -> FakeSlot:
        made.append(FakeSlot(f"s{len(made)}"))
        return made[-1]

    return SpeculationCache(max_slots, new_slot, _copy), made


def _job(sid: str, prefix=(1, 2, 3), last=4, gamma=2, fanout=2, key="k") -> SpeculationJob:
    src = FakeSlot(f"main-{sid}")
    src.data, src.length = list(prefix), len(prefix)
    return SpeculationJob(sid, src, list(prefix), last, gamma, fanout, key)


def _step(cache: SpeculationCache, candidates=(7, 8)) -> bool:
    """One idle step as the engine runs it: each job's probe (then its branches start), or
    one draft of its current branch (draft = 100 + its index). False when there is no work."""
    work = cache.work(limit=8)
    for w in work:
        job, branch = w.job, w.branch
        if branch is None:
            w.slot.length = len(job.prefix)
            cache.start(job, list(candidates)[: job.fanout], builder_factory)
        else:
            branch.tokens.extend(w.tokens)
            branch.drafts.append(100 + len(branch.drafts))
            branch.pending = [] if branch.done(job.gamma) else [branch.drafts[-1]]
    return bool(work)


def _run_to_completion(cache: SpeculationCache) -> None:
    for _ in range(100):
        if not _step(cache):
            return
    raise AssertionError("speculation never finished")


class _Builder:
    def __init__(self) -> None:
        self.kept = None

    def keep(self, n: int) -> None:
        self.kept = n


def builder_factory() -> _Builder:
    return _Builder()


def test_hit_returns_the_matching_branch_and_releases_the_others():
    cache, made = _cache(max_slots=4)
    cache.submit(_job("a"))
    _run_to_completion(cache)
    assert cache.candidates("a") == [7, 8]
    branch = cache.take("a", [1, 2, 3, 4, 8], "k")  # all accepted, bonus = second candidate
    assert branch is not None and branch.candidate == 8 and branch.drafts == [100, 101]
    assert branch.tokens == [1, 2, 3, 4, 8, 100] and branch.slot.data == [1, 2, 3]  # forked from the prefix
    assert not cache.pending("a")
    assert cache.slots_in_use() == 1  # the other branch's slot is free for reuse; the hit's belongs to the session
    cache.adopt(FakeSlot("old-main"))
    assert cache.slots_in_use() == 2
    assert cache.stats.dropped_branches == 1 and cache.stats.misses == 0


@pytest.mark.parametrize("sequence,key", [
    ([1, 2, 3, 4, 9], "k"),  # bonus not among the candidates
    ([1, 2, 3, 5, 7], "k"),  # d_γ rejected, another token in its place
    ([1, 2, 3, 4], "k"),  # shorter (a rejection earlier)
    ([1, 2, 0, 4, 7], "k"),  # a different prefix
    ([1, 2, 3, 4, 7], "other sampling params"),
])
def test_miss_when_the_sequence_or_the_request_differs(sequence, key):
    cache, _ = _cache(max_slots=4)
    cache.submit(_job("a"))
    _run_to_completion(cache)
    assert cache.take("a", sequence, key) is None
    assert cache.stats.misses == 1 and cache.stats.dropped_branches == 2
    assert cache.take("a", [1, 2, 3, 4, 7], "k") is None  # the job is gone after the miss
    assert cache.stats.misses == 1  # no job, no miss counted


def test_partial_branch_is_returned_with_its_drafts_so_far_and_an_unstarted_one_is_not():
    cache, _ = _cache(max_slots=4)
    for bonus, expect_hit in ((8, False), (7, True)):
        cache.submit(_job("a", gamma=3))
        _step(cache)  # the probe
        _step(cache)  # branch 7 drafts its first token; branch 8 has not started
        branch = cache._jobs["a"].branches[0]
        assert branch.candidate == 7 and branch.drafts == [100] and branch.pending == [100]
        got = cache.take("a", [1, 2, 3, 4, bonus], "k")
        assert (got is branch) if expect_hit else (got is None)


def test_slots_are_bounded_reused_and_the_oldest_job_gives_way():
    cache, made = _cache(max_slots=3)
    for sid in ("a", "b", "c"):
        cache.submit(_job(sid))
    _run_to_completion(cache)
    assert len(made) == 3 and cache.slots_in_use() == 3  # never more than max_slots
    # a (oldest) lost its slots to b and c; b then lost one to c at most: the newest job is complete
    assert cache.candidates("c") == [7, 8]
    assert cache.take("c", [1, 2, 3, 4, 7], "k") is not None
    cache.adopt(FakeSlot("old-main-c"))
    cache.drop("a")
    cache.drop("b")
    assert cache.slots_in_use() == 3 and not cache.pending("b")
    cache.submit(_job("d"))
    _run_to_completion(cache)
    assert len(made) == 3  # d ran in reused slots, nothing new allocated
    assert cache.candidates("d") == [7, 8]


def test_one_forward_never_evicts_a_job_it_already_holds():
    """A full cache gives the oldest job's slots to a newer one, but not within one forward:
    each row of it keeps its own slot (the drafter's idle step failed with IndexError, its
    probe's branches cleared by the next job's eviction)."""
    cache, made = _cache(max_slots=1)
    cache.submit(_job("a", fanout=1))
    cache.submit(_job("b", fanout=1))
    work = cache.work(limit=8)
    assert [(w.job.session_id, w.slot) for w in work] == [("a", made[0])]  # b waits: no slot to take
    assert cache._jobs["a"].branches[0].slot is made[0]
    _run_to_completion(cache)  # then b, the newer job, takes a's slot in a later forward
    assert len(made) == 1 and cache.candidates("b") == [7] and not cache.pending("a")


def test_a_dropped_job_leaves_the_chosen_rows_intact():
    """work() reads each row's slot and ids under the lock: a gRPC thread may close the
    session between the choice and the forward."""
    cache, made = _cache(max_slots=2)
    cache.submit(_job("a"))
    work = cache.work(limit=8)
    cache.drop("a")  # the session closed meanwhile
    assert work[0].slot is made[0] and work[0].tokens == [4] and work[0].job.branches == []
    cache.start(work[0].job, [7, 8], builder_factory)  # the engine's next move: a no-op now
    assert not cache.pending("a") and cache.work(limit=8) == []


def test_a_new_job_supersedes_the_sessions_old_one_and_dead_sessions_are_dropped():
    cache, _ = _cache(max_slots=4)
    cache.submit(_job("a"))
    _run_to_completion(cache)
    cache.submit(_job("a", prefix=(1, 2, 3, 4, 7, 100)))
    assert cache.stats.dropped_branches == 2
    assert cache.work(8, alive=lambda sid: False) == []
    assert not cache.pending("a") and cache.slots_in_use() == 2  # slots kept on the free list
    off, _ = _cache(max_slots=0)
    off.submit(_job("a"))
    assert not off.pending("a")


# ---- the drafter engine on the real model -----------------------------------------------


@pytest.fixture(scope="module")
def engines():
    from drafter_service.engine import DrafterEngine
    from specdec.models import ModelSpec
    from specdec.serving import EngineConfig

    plain = DrafterEngine(ModelSpec(dtype="float16"), EngineConfig(speculation_slots=0, max_draft_tokens=8))
    cached = DrafterEngine(ModelSpec(dtype="float16"), EngineConfig(speculation_slots=4, max_draft_tokens=8),
                           lm=plain.lm)
    assert plain.speculation is None and cached.speculation is not None
    yield plain, cached
    plain.shutdown()
    cached.shutdown()


def _wait_candidates(engine, sid: str, timeout_s: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = engine.speculation.candidates(sid)
        if got is not None:
            return got
        time.sleep(0.005)
    raise AssertionError("the speculation did not finish")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engine_drafts_are_the_same_with_the_cache_hit_or_miss(engines, temperature):
    """Rounds with every verdict kind; the cached engine's answers (drafts, proposal bytes,
    KV length) equal the plain engine's for the same requests, and its KV stays consistent."""
    from specdec.proposals import ProposalFormat
    from specdec.sampling import SamplingParams

    plain, cached = engines
    params = SamplingParams(temperature=temperature, seed=11)
    fmt = ProposalFormat(kind="ids") if temperature == 0 else ProposalFormat(kind="dense", dtype="float16")
    prompt = plain.lm.tokenizer("The quick brown fox jumps over the lazy dog. The quick brown",
                                add_special_tokens=False).input_ids
    # Each round: γ, then the verdict: accepted drafts (None = all) and the next token, a
    # bonus candidate of the drafter ("c0", "c1") or a token that is none of them ("x").
    plan = [(4, None, "c0"),
            (3, None, "c1"),  # a hit answering a smaller γ than the branch drafted
            (4, 1, "x"),  # a partial hit (the branch drafted 3), then a rejection
            (4, None, "c0"),  # a miss
            (4, None, "x"),  # a hit
            (4, 2, "c0"),  # a miss
            (4, None, "c0"),  # a miss (rejection before)
            (4, None, "c0")]  # a hit
    answers, sequences = {}, {}
    for name, engine in (("cached", cached), ("plain", plain)):
        sid = engine.open_session()
        committed, kv, out_rounds = list(prompt), 0, []
        for i, (gamma, accepted, bonus) in enumerate(plan):
            out = engine.draft(sid, kv, committed[kv:], gamma, params, fmt, fanout=2)
            session = engine.sessions._sessions[sid]
            assert out.kv_length == session.length == len(session.tokens) == len(committed) + gamma - 1
            assert session.tokens == committed + out.draft_token_ids[:-1]
            if name == "cached":
                candidates = _wait_candidates(engine, sid)
                token = (next(t for t in range(100, 200) if t not in candidates) if bonus == "x"
                         else candidates[int(bonus[1])])
                sequences[i] = out.draft_token_ids[:accepted] + [token]
            committed = committed + sequences[i]
            kv = min(out.kv_length, len(committed) - 1)
            out_rounds.append((out.draft_token_ids, out.proposal, out.kv_length, out.cached_draft_tokens))
        answers[name] = out_rounds
        engine.close_session(sid)
    for (d1, p1, k1, c1), (d2, p2, k2, _) in zip(answers["cached"], answers["plain"]):
        assert (d1, k1) == (d2, k2)
        assert p1 == p2  # the same q rows, byte for byte
    cached_counts = [c for *_, c in answers["cached"]]
    assert cached_counts == [0, 3, 3, 0, 4, 0, 0, 4]
    stats = cached.snapshot_stats()
    assert stats["speculation_hits"] >= 3 and stats["speculation_partial_hits"] >= 1


def test_engine_cache_is_off_without_fanout_and_closing_drops_branches(engines):
    from specdec.sampling import SamplingParams

    _, cached = engines
    params = SamplingParams(temperature=0)
    sid = cached.open_session()
    cached.draft(sid, 0, [1, 2, 3, 4], 4, params)
    assert not cached.speculation.pending(sid)
    cached.draft(sid, 6, [5, 6], 4, params, fanout=1)
    assert cached.speculation.pending(sid)
    cached.close_session(sid)
    assert not cached.speculation.pending(sid)


def test_a_huge_fanout_starts_no_more_branches_than_the_cache_has_slots(engines):
    """fanout 2**31 - 1 at temperature 1 made every id of the vocabulary a candidate, each
    branch a copy of the prefix: 600 MB for one Draft of a 2,000-token session."""
    from specdec.sampling import SamplingParams

    _, cached = engines
    sid = cached.open_session()
    try:
        cached.draft(sid, 0, list(range(100, 140)), 3, SamplingParams(temperature=1.0, seed=2), fanout=2**31 - 1)
        assert 1 <= len(_wait_candidates(cached, sid)) <= cached.speculation.max_branch_slots
    finally:
        cached.close_session(sid)


def test_a_session_closed_while_its_draft_runs_leaves_no_job(engines, monkeypatch):
    """CloseSession landing while the session's Draft is in the engine: the removal found no
    job to drop, and the job the Draft then planned held the session's KV slot until some
    later idle step noticed (none runs while requests keep coming: here, none runs at all).
    The close is made to land at the worst moment: after the step, before the job is planned."""
    from specdec.sampling import SamplingParams

    _, cached = engines
    sid = cached.open_session()
    finish = cached._finish

    def close_then_finish(r, load):
        cached.close_session(sid)
        return finish(r, load)

    monkeypatch.setattr(cached, "_finish", close_then_finish)
    monkeypatch.setattr(cached.speculation, "work", lambda *args, **kwargs: [])  # no idle step drops it
    cached.draft(sid, 0, [1, 2, 3, 4, 5], 4, SamplingParams(temperature=0), fanout=1)
    assert sid not in cached.sessions and not cached.speculation.pending(sid)


def test_an_evicted_or_expired_sessions_job_lets_its_kv_slot_go():
    """On the fast path a KV slot returns to the pool with its last reference, and a session's
    speculation job holds its slot (`source`). Jobs of evicted and expired sessions were dropped
    only by the next Draft's idle step: until then the pool stayed full and OpenSession failed
    (RESOURCE_EXHAUSTED, 'all 4 KV slots of the pool are in use'). Now the store tells the
    engine when a session leaves it, however it leaves."""
    from drafter_service.engine import DrafterEngine
    from specdec.models import ModelSpec
    from specdec.sampling import SamplingParams
    from specdec.serving import EngineConfig

    engine = DrafterEngine(ModelSpec(dtype="float32", fast_path="on", max_model_len=256),
                           EngineConfig(speculation_slots=1, max_sessions=2, max_draft_tokens=4, evict_after_idle_s=0,
                                        session_ttl_s=600))
    try:
        params = SamplingParams(temperature=0)
        for leave in ("evicted", "expired"):
            sids = [engine.open_session() for _ in range(2)]
            for sid in sids:
                engine.draft(sid, 0, list(range(10, 30)), 3, params, fanout=1)
            assert all(engine.speculation.pending(s) for s in sids)  # each job holds its session's slot
            # the idle steps done (the newer job pre-drafted in the one branch slot): none holds a slot meanwhile
            _wait_candidates(engine, sids[1])
            if leave == "expired":
                engine.sessions.ttl_s = 0.0
                time.sleep(0.01)
                assert engine.sessions.expire_idle() == 2
                engine.sessions.ttl_s = 600.0
            opened = [engine.open_session() for _ in range(4)]  # evicts (or finds gone) both, then each other
            assert not any(engine.speculation.pending(s) for s in sids) and len(opened) == 4
            for sid in opened[-2:]:
                engine.close_session(sid)
    finally:
        engine.shutdown()


def test_a_failed_slot_allocation_is_not_counted():
    """The KV pool full when the cache forks a slot: the job waits for a later step. It used
    to count the slot anyway, and after max_branch_slots such failures the cache held none and
    could never draft ahead again."""
    made, full = [], [True]

    def new_slot() -> FakeSlot:
        if full[0]:
            raise ResourceExhausted("all 4 KV slots of the pool are in use")
        made.append(FakeSlot(f"s{len(made)}"))
        return made[-1]

    cache = SpeculationCache(2, new_slot, _copy)
    cache.submit(_job("a", fanout=1))
    for _ in range(3):
        assert cache.work(limit=8) == [] and cache.slots_in_use() == 0
    full[0] = False
    _run_to_completion(cache)
    assert cache.candidates("a") == [7] and cache.slots_in_use() == 1


# ---- over gRPC ----------------------------------------------------------------------------


PROMPTS = ["Write a haiku about the sea.", "List three prime numbers and explain why they are prime."]


@pytest.fixture(scope="module")
def fanout_client(verifier_proc, drafter_proc):
    from client.speculative import SpeculativeClient

    with SpeculativeClient(verifier_proc.address, drafter=drafter_proc.address, fanout=2) as c:
        yield c


def test_grpc_greedy_with_the_cache_equals_target_only_and_hits(client, fanout_client):
    from specdec.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=40)
    hits = 0
    for prompt in PROMPTS:
        base = client.generate(prompt, params, target_only=True, chat=True)
        spec = fanout_client.generate(prompt, params, num_speculative_tokens=4, chat=True)
        assert spec.token_ids == base.token_ids
        hits += spec.cached_draft_tokens
    assert hits > 0  # the float16 drafter's verdicts are mostly "all accepted": branches get used


def test_grpc_seeded_sampling_is_the_same_with_and_without_the_cache(int8_drafter_proc, verifier_proc):
    """The low-acceptance drafter, so rejections (misses) and hits both happen."""
    from client.speculative import SpeculativeClient
    from specdec.sampling import SamplingParams

    params = SamplingParams(temperature=0.9, seed=5, max_tokens=40)
    with SpeculativeClient(verifier_proc.address, drafter=int8_drafter_proc.address) as off, \
            SpeculativeClient(verifier_proc.address, drafter=int8_drafter_proc.address, fanout=2) as on:
        cached = 0
        for prompt in PROMPTS:
            a = off.generate(prompt, params, num_speculative_tokens=3, chat=True)
            b = on.generate(prompt, params, num_speculative_tokens=3, chat=True)
            assert a.token_ids == b.token_ids
            assert a.num_accepted_tokens == b.num_accepted_tokens and a.num_rounds == b.num_rounds
            assert b.cached_draft_tokens <= b.num_draft_tokens
            cached += b.cached_draft_tokens
    assert cached > 0  # some rounds did come from branches


# ---- adaptive γ and the comparison bench ------------------------------------------------


def test_grpc_adaptive_gamma_keeps_the_greedy_output_and_its_bounds(int8_client):
    """The int8 drafter's acceptance varies, so γ moves; the output is the target's."""
    from specdec.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=40)
    for prompt in PROMPTS:
        base = int8_client.generate(prompt, params, target_only=True, chat=True)
        auto = int8_client.generate(prompt, params, num_speculative_tokens="auto", chat=True)
        assert auto.token_ids == base.token_ids
        assert auto.gamma_per_round and all(0 <= g <= 8 for g in auto.gamma_per_round)
        assert auto.gamma_per_round[0] == 0  # the first token is the verifier's alone
        assert auto.num_speculative_rounds == sum(g > 0 for g in auto.gamma_per_round)
        assert sum(auto.gamma_per_round) == auto.num_draft_tokens
    with pytest.raises(ValueError, match="auto"):
        int8_client.generate("x", params, num_speculative_tokens="sometimes")


def test_compare_variants_parse_and_refuse():
    from bench.compare import parse_variant

    assert parse_variant("target-only") == {"target_only": True}
    assert parse_variant("gamma=4") == {"target_only": False, "num_speculative_tokens": 4}
    assert parse_variant("g=auto,f=2") == {"target_only": False, "num_speculative_tokens": "auto", "fanout": 2}
    for bad in ("gamma=0", "fanout=2", "gamma=x", "gamma=4,speed=2", "gamma=4,fanout=-1"):
        with pytest.raises(ValueError):
            parse_variant(bad)


def test_bench_compare_runs_every_variant_against_its_target_only(verifier_proc, drafter_proc):
    from bench.compare import format_compare, run_compare
    from bench.serve import WorkloadConfig
    from specdec.sampling import SamplingParams

    base = WorkloadConfig(verifier=verifier_proc.address, drafter=drafter_proc.address, num_prompts=2,
                          max_concurrency=1, params=SamplingParams(temperature=0, max_tokens=12),
                          warmup_requests=0, show_progress=False)
    result = run_compare(base, ["gamma=3", "gamma=3,fanout=2", "gamma=auto"], repeats=2)
    names = [v["variant"] for v in result["variants"]]
    assert names == ["target-only", "gamma=3", "gamma=3,fanout=2", "gamma=auto"]
    assert result["primed"] == {**result["primed"], "requests": 2, "failed": 0}  # each prompt prefilled first
    outputs = {v["variant"]: [r["output_tokens"] for r in v["per_request"]] for v in result["variants"]}
    assert len({tuple(o) for o in outputs.values()}) == 1  # greedy: every variant emits the same lengths
    for v in result["variants"][1:]:
        assert v["completed"] == 2 and v["measured_speedup"] > 0
        # (auto may keep γ at 0 through 12 tokens when speculation does not pay here: no efficiency then)
        assert v["system_efficiency"] > 0 if v["variant"] != "gamma=auto" or v["total_draft_tokens"] else True
    cached = result["variants"][2]
    assert cached["fanout"] == 2 and cached["speculation_cache_hit_rate"] is not None
    assert result["variants"][1]["speculation_cache_hit_rate"] == 0
    for v in result["variants"][1:]:  # both repeats, each against its own target-only
        assert len(v["repeat_speedups"]) == 2 and all(x > 0 for x in v["repeat_speedups"])
        assert min(v["repeat_speedups"]) <= v["measured_speedup"] <= max(v["repeat_speedups"])
    assert "gamma=auto" in format_compare(result) and "2 repeats" in format_compare(result)


def test_drafter_reads_each_steps_tokens_back_once(engines, monkeypatch):
    """Concurrent sessions drafting together: one device-to-host read per forward step for all
    the step's rows (not one per row), and every draft passes through it."""
    import threading

    from drafter_service import engine as drafter_engine
    from specdec.proposals import ProposalFormat
    from specdec.sampling import SamplingParams

    plain, _ = engines
    reads: list[int] = []
    real = drafter_engine._read_tokens
    engine_thread = plain.scheduler._thread  # the cached engine (same module) may run an idle step meanwhile

    def counted(tokens):
        if threading.current_thread() is engine_thread:
            reads.append(len(tokens))
        return real(tokens)

    monkeypatch.setattr(drafter_engine, "_read_tokens", counted)
    before = plain.snapshot_stats()
    sids = [plain.open_session() for _ in range(3)]
    outs = {}
    params = SamplingParams(temperature=0.8, seed=3)
    fmt = ProposalFormat(kind="dense", dtype="float16")

    def run(i: int, sid: str) -> None:
        outs[sid] = plain.draft(sid, 0, [1, 2, 3 + i, 4], 4, params, fmt)

    threads = [threading.Thread(target=run, args=(i, sid)) for i, sid in enumerate(sids)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = plain.snapshot_stats()
    for sid in sids:
        plain.close_session(sid)
    assert sum(reads) == sum(len(o.draft_token_ids) for o in outs.values()) == 12, reads
    assert len(reads) == after["forwards"] - before["forwards"]  # one read per forward step
    assert max(reads) > 1  # the later sessions arrive while the first drafts, and share its steps
