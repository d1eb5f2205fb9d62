"""`specdec random-model --pair` (bench/synthetic.py): a random target and a drafter made of
its first layers, whose greedy agreement is set by the divergence of the target's later
layers, in-process on the tiny preset, through the command line, and through the services."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from bench import synthetic
from bench.engine import build_model
from client.launcher import start_services
from specdec.sampling import SamplingParams

VOCAB = 49152  # the embedded tokenizer's
PROMPTS = ["The capital of France is a city famous for", "def add(a, b):", "Once upon a time, in a land far away,",
           "The quick brown fox jumps over", "In 1905, Einstein published"]


@pytest.fixture(scope="module")
def tiny_meter() -> synthetic.AgreementMeter:
    """The tiny preset (2 layers) re-initialized as a pair's target, measured against its first layer."""
    model = build_model("tiny", torch.float32, torch.device("cpu"), max_len=512, seed=0, vocab_size=VOCAB)
    synthetic._initialize(model, seed=0)
    return synthetic.AgreementMeter(model, drafter_layers=1, seed=0)


def test_at_divergence_zero_the_saved_target_has_the_saved_drafters_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    info = synthetic.save_pair("tiny", str(tmp_path), divergence=0.0, seed=3)
    assert info.greedy_agreement == 1.0
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "target", dtype=torch.float32)
    drafter = AutoModelForCausalLM.from_pretrained(tmp_path / "drafter", dtype=torch.float32)
    assert (target.config.num_hidden_layers, drafter.config.num_hidden_layers) == (2, 1)
    ids = torch.randint(VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))  # [B, T]
    with torch.inference_mode():
        want, got = drafter(ids).logits, target(ids).logits  # [B, T, V]
    assert torch.equal(got, want)
    assert want.argmax(-1).unique().numel() > 64  # non-trivial greedy outputs, not one token everywhere


def test_greedy_agreement_falls_as_the_divergence_grows(tiny_meter):
    agreements = [tiny_meter(d) for d in (0.0, 0.05, 0.2, 0.5, 2.0)]
    assert agreements[0] == 1.0
    assert all(a > b for a, b in zip(agreements, agreements[1:])), agreements
    assert agreements[-1] < 0.05, agreements


def test_acceptance_calibrates_the_divergence_to_the_asked_agreement(tiny_meter):
    for asked in (0.3, 0.9):
        divergence, agreement = synthetic.calibrate(tiny_meter, asked)
        assert abs(agreement - asked) < 0.02, (asked, divergence, agreement)
        assert tiny_meter(divergence) == agreement  # the reported agreement is the divergence's


def test_the_default_drafter_of_target_1_5b_reads_about_a_fifth_of_its_bytes():
    model = build_model("target-1.5b", torch.bfloat16, torch.device("meta"), max_len=512, vocab_size=VOCAB)
    assert synthetic.default_drafter_layers(model) == 2
    ratio = synthetic.weight_bytes_per_step(model, 2) / synthetic.weight_bytes_per_step(model, 16)
    assert 0.18 < ratio < 0.23


def test_random_model_pair_writes_target_drafter_and_pair_json(tmp_path):
    out = subprocess.run([sys.executable, "-m", "cli", "random-model", "--preset", "tiny", "--out", str(tmp_path),
                          "--pair", "--divergence", "0.3", "--dtype", "float32"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    pair = json.loads((tmp_path / "pair.json").read_text())
    assert pair["divergence"] == 0.3 and pair["drafter_layers"] == 1 and pair["target_layers"] == 2
    assert 0.2 < pair["greedy_agreement"] < 0.7
    assert pair["drafter_bytes_per_step"] < pair["target_bytes_per_step"]
    assert f"greedy agreement {pair['greedy_agreement']:.3f}" in out.stdout
    for role in ("target", "drafter"):
        assert (tmp_path / role / "model.safetensors").is_file() and (tmp_path / role / "tokenizer.json").is_file()


@pytest.mark.slow
def test_the_pairs_greedy_acceptance_rises_monotonically_with_its_knob_through_the_services(tmp_path):
    """Pairs calibrated to greedy agreement 0.2, 0.5 and 0.9 (tiny shapes, CPU), each target
    in a verifier service: the accepted share of γ = 4 drafts rises with the knob, near the
    independent-positions figures (α + α² + α³ + α⁴) / 4 = 0.06, 0.23, 0.77 (measured: 0.055,
    0.235, 0.766 over 5 prompts x 64 tokens). The drafter does
    not depend on the divergence (the seed's first layer), so one drafter service serves all three."""
    from client.speculative import SpeculativeClient

    gamma, levels = 4, (0.2, 0.5, 0.9)
    infos = [synthetic.save_pair("tiny", str(tmp_path / str(a)), acceptance=a) for a in levels]
    common = ["--dtype", "float32", "--max-draft-tokens", "8", "--log-level", "WARNING"]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    rates = []
    with start_services([("drafter", ["--model", str(tmp_path / "0.2" / "drafter"), *common, "--quantize", "none",
                                      "--prefill-dtype", "none"])]
                        + [("verifier", ["--model", str(tmp_path / str(a) / "target"), *common]) for a in levels],
                        threads=1) as (drafter, *verifiers):
        for verifier in verifiers:
            with SpeculativeClient(verifier.address, drafter=drafter.address) as client:
                results = [client.generate(p, params, num_speculative_tokens=gamma) for p in PROMPTS]
            rates.append(sum(r.num_accepted_tokens for r in results) / sum(r.num_draft_tokens for r in results))
    expected = [info.acceptance_rate_at_gamma[str(gamma)] for info in infos]
    assert all(hi - lo > 0.1 for lo, hi in zip(rates, rates[1:])), (rates, expected)
    assert rates[0] < 0.2 and rates[-1] > 0.65, (rates, expected)
