"""Weight-only int4 drafter (`--quantize int4`, the drafter's default on CPUs with native
bfloat16): the packing's arithmetic, batch invariance, agreement with the target on the
embedded model, and a real int4 drafter service whose greedy output is the target's."""

from __future__ import annotations

import pytest
import torch

from client.launcher import start_service
from specdec.models import CausalLM, ModelSpec
from specdec.quantized import GROUP_SIZE, Int4WeightLinear, Int8WeightLinear, int4_available, quantize_groups
from tests.conftest import SERVICE_THREADS

pytestmark = pytest.mark.skipif(not int4_available(), reason="this torch build has no CPU int4 kernel")


def _linear(out_f: int, in_f: int, seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(in_f, out_f, bias=False)
    torch.nn.init.normal_(lin.weight, std=0.05)
    return lin


def test_int4_groups_bound_the_error_and_keep_each_groups_ends():
    w = _linear(64, 4 * GROUP_SIZE, seed=0).weight.detach()
    q, scale, zero = quantize_groups(w)
    assert q.dtype == torch.int32 and int(q.min()) >= 0 and int(q.max()) <= 15
    deq = ((q.view(64, 4, GROUP_SIZE) - 8) * scale[..., None] + zero[..., None])  # [N, K/g, g]
    err = (deq - w.view(64, 4, GROUP_SIZE)).abs()
    assert bool((err <= scale[..., None] / 2 + 1e-6).all())  # round to nearest: half a step at most
    groups = w.view(64, 4, GROUP_SIZE)
    torch.testing.assert_close(deq.amin(-1), groups.amin(-1), atol=1e-6, rtol=0)
    torch.testing.assert_close(deq.amax(-1), groups.amax(-1), atol=1e-5, rtol=0)


def test_int4_linear_computes_x_times_the_dequantized_weight():
    lin = _linear(96, 2 * GROUP_SIZE * 3, seed=1)
    packed = Int4WeightLinear(lin)
    q, scale, zero = quantize_groups(lin.weight.detach())
    n, k = lin.weight.shape
    # the kernel dequantizes with bfloat16 scales and zeros
    s16, z16 = scale.bfloat16().float(), zero.bfloat16().float()
    deq = ((q.view(n, k // GROUP_SIZE, GROUP_SIZE) - 8) * s16[..., None] + z16[..., None]).view(n, k)
    x = torch.randn(5, k).bfloat16()
    ref = x.float() @ deq.T  # [5, N]
    out = packed(x)
    assert out.shape == (5, n) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.02, rtol=0.02)
    # and it is close to the unquantized linear (the quantization error only)
    assert float((out.float() - lin(x.float())).abs().max()) < 0.1 * float(lin(x.float()).abs().max())


def test_int8_head_computes_x_times_the_dequantized_weight():
    lin = _linear(256, 96, seed=4)
    head = Int8WeightLinear(lin)
    assert head.qweight.dtype == torch.int8 and int(head.qweight.abs().max()) == 127  # each row's max maps to 127
    deq = head.qweight.float() * head.scales.float()[:, None]  # [N, K]
    x = torch.randn(3, 96).bfloat16()
    out = head(x)
    assert out.shape == (3, 256) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), x.float() @ deq.T, atol=0.02, rtol=0.02)
    assert float((out.float() - lin(x.float())).abs().max()) < 0.05 * float(lin(x.float()).abs().max())


@pytest.mark.parametrize("kind", [Int4WeightLinear, Int8WeightLinear])
def test_int4_and_int8_rows_do_not_depend_on_their_batch_mates(kind):
    packed = kind(_linear(128, 4 * GROUP_SIZE, seed=2))
    torch.manual_seed(3)
    row = torch.randn(1, 4 * GROUP_SIZE).bfloat16()
    alone = packed(row)[0]
    for m in (2, 4, 9, 33):
        batch = torch.cat([row, torch.randn(m - 1, 4 * GROUP_SIZE).bfloat16()])
        assert torch.equal(packed(batch)[0], alone), f"row 0 changed in a batch of {m}"


def test_int4_refuses_cuda_and_computes_in_bfloat16():
    with pytest.raises(ValueError, match="CPU option"):
        ModelSpec(quantize="int4", device="cuda")
    assert ModelSpec(quantize="int4", dtype="float16").dtype == "bfloat16"
    assert ModelSpec(quantize="none").quantize is None
    assert ModelSpec(quantize="auto", device="cuda").quantize is None
    assert ModelSpec(quantize="auto", fast_path="on").quantize is None  # the static forward is unquantized


@pytest.fixture(scope="module")
def int4_lm():
    return CausalLM(ModelSpec(quantize="int4", prefill_dtype="auto"))  # as the service, whose default is auto


def test_int4_drafter_mostly_agrees_with_the_target(int4_lm, target_lm):
    """Greedy agreement of the int4 drafter (prompts through its bfloat16 prefill copy, then
    one token at a time through the int4 weights, as in the service) with the float32 target
    along the target's own greedy continuations; float16 measured ~1.00 and int4 ~0.98 on the
    embedded model, a broken packing would fall to ~0."""
    assert int4_lm.prefill_slots is not None and int4_lm.spec.display_name.endswith("[bfloat16+int4]")
    # int8 LM head; the tied input embedding keeps its bfloat16 weights
    assert isinstance(int4_lm.model.lm_head, Int8WeightLinear) and int4_lm.vocab_size == 49152
    assert int4_lm.model.model.embed_tokens.weight.dtype == torch.bfloat16
    agree = total = 0
    for prompt in ("The capital of France is", "Here is a recipe for pancakes:", "def fibonacci(n):"):
        ids = target_lm.tokenizer(prompt)["input_ids"]
        cache = target_lm.new_cache()
        logits = target_lm.forward(ids, cache, 1)
        seq = list(ids)
        for _ in range(24):
            seq.append(int(logits[-1].argmax()))
            logits = target_lm.forward([seq[-1]], cache, 1)
        dcache = int4_lm.new_cache()
        dlogits = int4_lm.forward(ids, dcache, 1)
        for tok in seq[len(ids):]:
            agree += int(int(dlogits[-1].argmax()) == tok)
            total += 1
            dlogits = int4_lm.forward([tok], dcache, 1)
    assert agree / total >= 0.85, f"int4 drafter agreed on {agree}/{total} tokens"


def test_int4_drafter_service_greedy_output_is_the_targets(verifier_proc):
    from client.speculative import SpeculativeClient
    from specdec.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with start_service("drafter", ["--quantize", "int4", "--max-draft-tokens", "8", "--log-level", "WARNING"],
                       threads=SERVICE_THREADS) as drafter, \
         SpeculativeClient(verifier_proc.address, drafter=drafter.address) as client:
        for prompt in ("Name three rivers in Africa.", "Write one sentence about trains."):
            base = client.generate(prompt, params, chat=True, target_only=True)
            spec = client.generate(prompt, params, chat=True, num_speculative_tokens=6)
            assert spec.token_ids == base.token_ids
            assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens / spec.num_draft_tokens > 0.5


def test_a_verifier_refuses_dynamic_int8_before_loading_its_weights():
    """Dynamic int8 quantizes a forward row's activations with one scale: a verifier's logits for
    a position would depend on the tokens verified beside it (a hunt found greedy output
    changing with γ). The engine refuses it before loading anything; the CLI says so in one line."""
    import subprocess
    import sys

    from verifier_service.engine import VerifierEngine

    with pytest.raises(ValueError, match="--quantize int8 is a drafter's option"):
        VerifierEngine(ModelSpec(model="/nonexistent", dtype="float32", quantize="int8"))
    out = subprocess.run([sys.executable, "-m", "cli", "verifier", "--quantize", "int8", "--port", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "--quantize int4 (weight-only) or none" in out.stderr
