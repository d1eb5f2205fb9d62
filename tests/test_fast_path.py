"""The fast path (static_forward.py) on the CPU: the same bucketed static step that CUDA
replays as graphs, run eagerly against the eager paths on the real embedded model; the
slot pool's reuse; `bench engine`; services started with --fast-path on."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest
import torch

from client.launcher import start_service
from specdec.models import CausalLM, ModelSpec
from specdec.sampling import SamplingParams
from specdec.serving import EngineConfig
from specdec.slot_forward import Row
from specdec.static_forward import StaticForward
from tests.conftest import wait_for
from verifier_service.engine import VerifierEngine

PROMPTS = ["The capital of France is a city famous for", "def add(a, b):", "Once upon a time, in a land far away,"]


def _ids(lm, text: str) -> list[int]:
    return lm.tokenizer(text, add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def fast_lm():
    lm = CausalLM(ModelSpec(dtype="float32", fast_path="on", max_model_len=256))
    lm.configure_pool(4)
    return lm


def _hf_greedy(lm, ids: list[int], n: int) -> list[int]:
    """transformers' own forward with a DynamicCache: the eager reference."""
    from transformers import DynamicCache

    cache, out, nxt = DynamicCache(config=lm.config), [], ids
    with torch.inference_mode():
        for _ in range(n):
            logits = lm.model(torch.tensor([nxt]), past_key_values=cache, use_cache=True).logits[0, -1]
            nxt = [int(logits.argmax())]
            out.append(nxt[0])
    return out


def test_static_step_matches_the_slot_forward_on_a_ragged_padded_batch(target_lm):
    """Three rows of widths 5, 1 and 2 at different lengths (bucket B=4, T=5: a padded row
    and padded tokens): logits equal the eager slot forward's, and neither the padding nor
    the step writes outside the rows' own slots."""
    fwd = target_lm.slots
    fast = StaticForward(fwd, fwd.new_pool(5))
    seqs = [_ids(target_lm, p) for p in PROMPTS]
    widths = [5, 1, 2]
    pooled = [fast.pool.acquire() for _ in seqs]
    plain = [fwd.new_slot() for _ in seqs]
    bystander = fast.pool.acquire()
    fast.forward([Row(bystander, seqs[2], 1)])
    for s, p, w in zip(seqs, pooled, widths):
        fast.forward([Row(p, s[:-w], 1)])
    for s, p, w in zip(seqs, plain, widths):
        fwd.forward([Row(p, s[:-w], 1)])
    before = fast.pool.data[bystander.index].clone()
    got = fast.forward([Row(p, s[-w:], w) for s, p, w in zip(seqs, pooled, widths)])
    want = torch.split(fwd.forward([Row(p, s[-w:], w) for s, p, w in zip(seqs, plain, widths)]), widths)
    assert fast.shape_count() >= 1 and (4, 5, 64) in fast._buckets  # the padded bucket really ran
    for g, w_ in zip(got, want):
        assert g.shape == w_.shape
        assert torch.allclose(g, w_, atol=1e-4), float((g - w_).abs().max())
        assert torch.equal(g.argmax(-1), w_.argmax(-1))
    assert torch.equal(fast.pool.data[bystander.index], before)
    for s, p in zip(seqs, pooled):
        assert p.length == len(s)
        # the KV the static step wrote equals what the eager path wrote for the same positions
    for p, q in zip(pooled, plain):
        assert torch.allclose(p.data[:, :, :, : p.length], q.data[:, :, :, : q.length], atol=1e-4)


def test_static_step_at_the_edges_of_its_buckets(target_lm):
    """A 13-token row in 16-position slots (its width bucket, 17, passes the slot's end: the
    padding must stay in bounds) and three rows with a largest batch bucket of 2 (two
    chunks): logits equal the eager slot forward's."""
    from specdec.slot_forward import SlotForward

    fwd = SlotForward(target_lm.model, max_len=16)
    fast = StaticForward(fwd, fwd.new_pool(3), max_batch=2)
    seqs = [(_ids(target_lm, p) * 3)[:13] for p in PROMPTS]
    pooled = [fast.pool.acquire() for _ in seqs]
    got = fast.forward([Row(p, s, len(s)) for p, s in zip(pooled, seqs)])
    assert set(fast._buckets) == {(2, 17, 16), (1, 17, 16)}
    for s, g in zip(seqs, got):
        want = fwd.forward([Row(fwd.new_slot(), s, len(s))])
        assert torch.allclose(g, want, atol=1e-4)


def test_prompt_chunks_run_as_pieces_of_static_steps(target_lm):
    """Rows wider than the widest step row (prompt chunks) run on the static path as pieces
    of PIECE_WIDTH tokens, in steps of their own, never eagerly: a 70-token row keeping every
    position (prompt_logprobs) before a 3-token row, and a 100-token row whose pieces spill
    into a second step (largest batch bucket 4). Logits and the K/V written equal the eager
    slot forward's, rows come back in their order, and a decode step after them agrees too."""
    fwd = target_lm.slots
    fast = StaticForward(fwd, fwd.new_pool(3), max_batch=4, max_width=5)
    text = " ".join(PROMPTS) * 6
    seqs = [_ids(target_lm, text)[:70], _ids(target_lm, PROMPTS[1]), _ids(target_lm, text)[5:105]]
    pre = [0, 4, 0]  # tokens cached before the step (the short row's session is mid-generation)
    keeps = [70, 2, 1]
    pooled, plain = [fast.pool.acquire() for _ in seqs], [fwd.new_slot() for _ in seqs]
    for s_, n, p, q in zip(seqs, pre, pooled, plain):
        if n:
            fast.forward([Row(p, s_[:n], 1)])
            fwd.forward([Row(q, s_[:n], 1)])

    def no_eager(rows):
        raise AssertionError(f"{len(rows)} rows went eagerly")

    before = set(fast._buckets)
    got = fast.forward([Row(p, s_[n:], k) for s_, n, k, p in zip(seqs, pre, keeps, pooled)], eager=no_eager)
    want = torch.split(fwd.forward([Row(q, s_[n:], k) for s_, n, k, q in zip(seqs, pre, keeps, plain)]), keeps)
    # pieces 32+32+6 and 32+32+32+4 in steps of 4 and 3 rows at T = 32; the short row alone
    assert len(seqs[1]) - pre[1] <= 5
    assert {(B, T) for B, T, _ in set(fast._buckets) - before} == {(1, len(seqs[1]) - pre[1]), (4, 32)}
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert torch.allclose(g, w, atol=1e-4), float((g - w).abs().max())
    for s_, p, q in zip(seqs, pooled, plain):
        assert p.length == q.length == len(s_)
        assert torch.allclose(p.data[:, :, :, : p.length], q.data[:, :, :, : q.length], atol=1e-4)
    nxt = [[int(g[-1].argmax())] for g in got]
    got = fast.forward([Row(p, t, 1) for p, t in zip(pooled, nxt)], eager=no_eager)
    want = fwd.forward([Row(q, t, 1) for q, t in zip(plain, nxt)])
    assert torch.allclose(torch.cat(got), want, atol=1e-4)


def test_a_pool_model_with_a_prefill_copy_keeps_its_wide_rows_eager(target_lm):
    """`pieces=False` (CausalLM's choice when a second weight copy prefills): rows wider than
    max_width go to the eager callable, the others stay static."""
    fwd = target_lm.slots
    fast = StaticForward(fwd, fwd.new_pool(2), max_width=5, pieces=False)
    went: list[int] = []

    def eager(rows):
        went.extend(len(r.token_ids) for r in rows)
        return list(torch.split(fwd.forward(rows), [r.keep for r in rows]))

    ids = _ids(target_lm, PROMPTS[2])
    a, b = fast.pool.acquire(), fast.pool.acquire()
    fast.forward([Row(a, ids[:3], 1), Row(b, ids, 1)], eager=eager)
    assert went == [len(ids)] and {T for _, T, _ in fast._buckets} == {3}


def test_fast_path_greedy_tokens_equal_the_eager_transformers_path(fast_lm):
    """Two sessions decoded together through CausalLM.forward_rows (the engines' call) give
    token for token what transformers' own forward gives each prompt alone."""
    seqs = [_ids(fast_lm, p) for p in PROMPTS[:2]]
    slots = [fast_lm.new_cache() for _ in seqs]
    assert all(s.index is not None for s in slots)  # pool slots: the static path serves them
    logits = fast_lm.forward_rows([Row(s, ids, 1) for s, ids in zip(slots, seqs)])  # prefill: the eager rows
    tokens = [[int(lg[-1].argmax())] for lg in logits]
    for _ in range(23):
        logits = fast_lm.forward_rows([Row(s, [t[-1]], 1) for s, t in zip(slots, tokens)])
        for t, lg in zip(tokens, logits):
            t.append(int(lg[-1].argmax()))
    assert fast_lm.static.shape_count() >= 1
    for ids, got in zip(seqs, tokens):
        assert got == _hf_greedy(fast_lm, ids, 24)


def test_a_freed_slot_serves_a_new_session_as_it_would_alone(target_lm):
    """A one-slot pool: session A fills the slot past where B will reach, ends; B gets the
    same slot (index and storage) and decodes exactly its solo greedy tokens."""
    fwd = target_lm.slots
    fast = StaticForward(fwd, fwd.new_pool(1))
    a = fast.pool.acquire()
    index = a.index
    long_prompt = _ids(target_lm, PROMPTS[2]) * 3
    fast.forward([Row(a, long_prompt, 1)])
    for _ in range(6):
        fast.forward([Row(a, [42], 1)])
    with pytest.raises(Exception, match="KV slots of the pool are held"):
        fast.pool.acquire()
    del a
    gc.collect()
    assert fast.pool.free_slots == 1
    b = fast.pool.acquire()
    assert b.index == index and b.length == 0
    ids = _ids(target_lm, PROMPTS[1])
    tokens = [int(fast.forward([Row(b, ids, 1)])[0][-1].argmax())]
    for _ in range(11):
        tokens.append(int(fast.forward([Row(b, [tokens[-1]], 1)])[0][-1].argmax()))
    assert tokens == _hf_greedy(target_lm, ids, 12)


def test_engine_sessions_return_their_pool_slots(fast_lm):
    """Sessions opened and closed (or left to expire) through a verifier engine: the pool
    never runs dry and every slot comes back."""
    engine = VerifierEngine(fast_lm.spec, EngineConfig(max_sessions=2, speculation_slots=0), lm=fast_lm)
    try:
        free = fast_lm.pool.free_slots
        ids = _ids(fast_lm, PROMPTS[0])
        for _ in range(5):  # more sessions than the pool has slots
            sid = engine.open_session()
            out = engine.verify(sid, 0, ids, [], None, SamplingParams(temperature=0, max_tokens=4))
            assert out.kv_length == len(ids)
            engine.close_session(sid)
        # The engine thread lets go of the last batch just after answering it.
        wait_for(lambda: gc.collect() is not None and fast_lm.pool.free_slots == free, 10, "every slot back")
    finally:
        engine.shutdown()


def test_bench_engine_prints_eager_and_fast_rows():
    out = subprocess.run(
        [sys.executable, "-m", "cli", "bench", "engine", "--preset", "tiny", "--device", "cpu",
         "--batch-sizes", "1,3", "--context", "40", "--width", "3", "--steps", "2", "--warmup", "0"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("tiny ")]
    assert [(r[1], r[2]) for r in rows] == [("1", "3"), ("3", "3")]
    for r in rows:
        assert float(r[3]) > 0 and float(r[4]) > 0 and float(r[5]) > 0
        assert float(r[11]) == 1.0  # greedy agreement with eager transformers (float32)
    assert "not the GPU's" in out.stdout  # no CUDA here: says its figures are eager CPU ones


def test_services_with_the_fast_path_match_target_only(verifier_proc):
    """Drafter and verifier started with --fast-path on (the CUDA default) emit the greedy
    target-only tokens of the default (eager) verifier."""
    from client.speculative import SpeculativeClient

    args = ["--fast-path", "on", "--max-draft-tokens", "8", "--max-sessions", "8", "--log-level", "WARNING"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with start_service("verifier", args, threads=1) as verifier, start_service("drafter", args, threads=1) as drafter, \
            SpeculativeClient(verifier_proc.address) as ref, \
            SpeculativeClient(verifier.address, drafter=drafter.address, fanout=2) as fast:
        # the last: a 300-token prompt, prefilled in chunks (256 tokens a step on a CPU) of static pieces
        for prompt in [*PROMPTS, " ".join(PROMPTS * 12)]:
            want = ref.generate(prompt, params, target_only=True).token_ids
            got = fast.generate(prompt, params, num_speculative_tokens=4)
            assert got.token_ids == want
            assert got.num_accepted_tokens > 0


def test_random_model_directories_load_as_service_models(tmp_path, target_lm):
    """`specdec random-model`: a tiny random Llama with the embedded tokenizer loads through
    --model DIR; the same seed writes the same weights (a copy drafter accepts everything)."""
    from safetensors.torch import load_file

    for name in ("a", "b"):
        out = subprocess.run([sys.executable, "-m", "cli", "random-model", "--preset", "tiny", "--out",
                              str(tmp_path / name), "--dtype", "float32"], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
    a, b = (load_file(tmp_path / n / "model.safetensors") for n in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # a folder that holds a model is not overwritten unasked (it replaced a hunt's own Qwen2 model)
    again = [sys.executable, "-m", "cli", "random-model", "--preset", "tiny", "--out", str(tmp_path / "a"),
             "--dtype", "float32", "--seed", "1"]
    out = subprocess.run(again, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "already holds a model; pass --overwrite" in out.stderr, out.stderr
    kept = load_file(tmp_path / "a" / "model.safetensors")
    assert all(torch.equal(kept[k], a[k]) for k in a)
    assert subprocess.run([*again, "--overwrite"], capture_output=True, timeout=300).returncode == 0
    lm = CausalLM(ModelSpec(model=str(tmp_path / "a"), dtype="float32", fast_path="on"))
    assert lm.vocab_size == target_lm.vocab_size
    assert lm.tokenizer_fingerprint == target_lm.tokenizer_fingerprint  # the client's pairing check holds
    assert lm.fast_path and lm.slots is not None


def test_the_kv_budget_sizes_the_pool_and_caps_sessions():
    """--kv-budget-mb bounds the pool allocated at start (one slot of 64 positions: ~2.8 MiB),
    the session cap follows the pool, and sessions beyond it evict idle ones instead of
    failing for want of a slot."""
    lm = CausalLM(ModelSpec(dtype="float32", fast_path="on", max_model_len=64))
    slot_mib = lm.slots.new_slot_bytes() / 2**20
    # evict_after_idle_s 0: the sessions opened one after another here are all idle for less than the default 2 s
    engine = VerifierEngine(lm.spec, EngineConfig(kv_budget_mb=6.5 * slot_mib, speculation_slots=0,
                                                  evict_after_idle_s=0.0), lm=lm)
    try:
        assert lm.pool.num_slots == 5  # 6.5 slots of budget: 5 + scratch
        assert engine.sessions.max_sessions == 4  # one slot kept for admission before eviction
        ids = _ids(lm, PROMPTS[0])
        for _ in range(7):
            sid = engine.open_session()
            engine.verify(sid, 0, ids, [], None, SamplingParams(temperature=0, max_tokens=4))
        assert engine.sessions.evictions == 3 and len(engine.sessions) == 4
    finally:
        engine.shutdown()
