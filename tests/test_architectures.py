"""Models a user brings beyond the llama family that the fast path serves: tiny random-weight
models of other architectures, saved with the embedded tokenizer and served as `--model DIR`.
Greedy speculative output must equal target-only and a plain transformers forward."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, OPTConfig

from client.launcher import start_services
from client.speculative import SpeculativeClient
from specdec.models import CausalLM, ModelSpec, decoder_blocks, load_tokenizer
from specdec.sampling import SamplingParams

VOCAB = 49152  # the embedded tokenizer's


def _save(config, path, seed: int) -> str:
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    load_tokenizer(ModelSpec()).save_pretrained(path)
    return str(path)


def _hf_greedy(path: str, ids: list[int], n: int) -> list[int]:
    """Greedy continuation by full forwards of plain transformers (no cache to get wrong)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def test_a_sliding_window_model_past_its_window_verifies_speculatively_like_target_only(tmp_path):
    """A Mistral with an 8-token sliding window, 30 prompt tokens and 30 generated: every
    rejected draft crops the verifier's cache back past the window. transformers' sliding
    layers keep only the window and cannot be cropped there (every speculative request
    failed with INTERNAL); the sessions keep full layers and the masks apply the window."""
    config = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           sliding_window=8)
    target, draft = _save(config, tmp_path / "target", 0), _save(config, tmp_path / "draft", 1)
    args = ["--dtype", "float32", "--max-draft-tokens", "8", "--log-level", "WARNING"]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    ids = list(range(1000, 1030))
    with start_services([("verifier", ["--model", target] + args), ("drafter", ["--model", draft] + args)],
                        threads=1) as (verifier, drafter), \
            SpeculativeClient(verifier.address, drafter=drafter.address) as client:
        base = client.generate(ids, params, target_only=True)
        spec = client.generate(ids, params, num_speculative_tokens=4)
    assert spec.token_ids == base.token_ids == _hf_greedy(target, ids, 30)
    assert spec.num_draft_tokens > spec.num_accepted_tokens  # drafts were rejected: the caches were cropped


def test_a_half_precision_verifiers_greedy_output_is_the_same_at_every_gamma(tmp_path):
    """A float16 verifier on a CPU without native float16 GEMMs took --prefill-dtype auto's
    second weight copy (bfloat16 with AVX512-BF16, float32 on AVX2) for rows of >= 3 tokens,
    verify rows of γ >= 2 included, and 1-token rows ran the float16 weights: greedy output at
    γ 3 or 5 differed from target-only and γ 1 (2 of 8 generations of this tiny model on an
    AVX512-BF16 host). The verifier takes no copy."""
    import subprocess
    import sys

    model = tmp_path / "tiny16"
    subprocess.run([sys.executable, "-m", "cli", "random-model", "--preset", "tiny", "--dtype", "float16", "--out",
                    str(model)], check=True, capture_output=True, timeout=300)
    with start_services([("verifier", ["--model", str(model), "--dtype", "float16", "--log-level", "WARNING"]),
                         ("drafter", ["--model", str(model), "--log-level", "WARNING"])], threads=1) as (v, d), \
            SpeculativeClient(v.address, drafter=d.address) as client:
        params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        for prompt in ("def fibonacci(n):\n    if n < 2:", "The capital of France is", "Once upon a time",
                       "1, 2, 3, 4,"):
            base = client.generate(prompt, params, target_only=True)
            for gamma in (1, 3, 5):
                spec = client.generate(prompt, params, num_speculative_tokens=gamma)
                assert spec.token_ids == base.token_ids, (prompt, gamma)
                assert spec.num_draft_tokens > 0
        # bench peer's HF side runs the embedded pair: against these services it compared other
        # models, printing a speedup and "same as HF" counts without a word
        from bench.peer import run_peer

        with pytest.raises(ValueError, match="running the embedded models; the verifier at .* serves .*tiny16"):
            run_peer(dataset="specbench", num_prompts=1, max_tokens=4, gammas=[2], seed=0, chat=False, threads=1,
                     service_threads=1, drafter=d.address, verifier=v.address)


@pytest.mark.parametrize("arch", ["gpt2", "opt"])
def test_quantized_models_of_other_layouts_load_and_run(tmp_path, arch):
    """--quantize int8 (and the drafter's auto int4) quantize the decoder blocks wherever the
    architecture keeps them (GPT-2's transformer.h, OPT's model.decoder.layers): both crashed
    at start looking for llama's model.model.layers."""
    config = (GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512) if arch == "gpt2"
              else OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=512, word_embed_proj_dim=64))
    path = _save(config, tmp_path / arch, 0)
    lm = CausalLM(ModelSpec(model=path, dtype="float32", quantize="int8", prefill_dtype="none"))
    owner, name = decoder_blocks(lm.model)
    assert name == {"gpt2": "h", "opt": "layers"}[arch] and len(getattr(owner, name)) == 2
    if arch == "opt":  # nn.Linear blocks (GPT-2's are Conv1D, which dynamic int8 leaves alone)
        assert any("quantized" in type(m).__module__ for m in getattr(owner, name).modules())
    # The name it serves under says what runs: "+int8" only where something was quantized.
    assert lm.spec.display_name.endswith({"gpt2": "[float32]", "opt": "[float32+int8]"}[arch])
    logits = lm.forward([1000, 1001, 1002], lm.new_cache(), logits_to_keep=1)
    assert logits.shape == (1, VOCAB) and bool(torch.isfinite(logits).all())
    if arch == "gpt2":  # int4 packs no Conv1D either: it ran unquantized yet served as "[bfloat16+int4]"
        int4 = CausalLM(ModelSpec(model=path, quantize="int4", prefill_dtype="none"))
        assert int4.spec.quantize is None and int4.spec.display_name.endswith("[bfloat16]")
        # and int8 asked beside float16 ran float32 weights under the name "[float16]"
        half = CausalLM(ModelSpec(model=path, dtype="float16", quantize="int8", prefill_dtype="none"))
        assert half.spec.display_name.endswith("[float16]")
        assert {p.dtype for p in half.model.parameters()} == {torch.float16}


def _padded_pair(tmp_path, pad: int = 64) -> tuple[str, str, str]:
    """A drafter with the tokenizer's 49,152 LM-head rows and targets of the same weights whose
    head (and embedding) is padded to 49,152 + pad rows, as Qwen2.5 pads 151,936 to 152,064 from
    7B on. The padding rows copy the rows of the tokens likeliest on average, exactly (ties go to
    the lower id: greedy never picks one) and scaled by 1.15 (sampling picks one every ~20
    tokens). Returns (drafter, target, hot target)."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # random logits are nearly flat (std ~0.16): peak them, top token ~0.5-0.8
        model.lm_head.weight *= 50
        contexts = torch.randint(0, VOCAB, (16, 24), generator=torch.Generator().manual_seed(1))
        sources = torch.softmax(model(contexts).logits.float(), -1).reshape(-1, VOCAB).mean(0).topk(pad).indices
    paths = [str(tmp_path / name) for name in ("drafter", "target", "hot")]
    model.save_pretrained(paths[0])
    model.resize_token_embeddings(VOCAB + pad, mean_resizing=False)
    for path, scale in zip(paths[1:], (1.0, 1.15)):
        with torch.no_grad():
            model.lm_head.weight[VOCAB:] = model.lm_head.weight[sources] * scale
            model.model.embed_tokens.weight[VOCAB:] = model.model.embed_tokens.weight[sources]
        model.save_pretrained(path)
    for path in paths:
        load_tokenizer(ModelSpec()).save_pretrained(path)
    return paths[0], paths[1], paths[2]


def test_a_drafter_with_a_smaller_lm_head_of_the_same_tokenizer_speculates_exactly(tmp_path):
    """Padded heads of one tokenizer (the Qwen2.5 0.5B drafter for 7B: 151,936 against 152,064
    rows) were refused. The pair now speculates: greedy equals target-only, sampled dense
    proposals are padded with zeros by the verifier, and once the target emits a padding id
    (which the drafter has no row for) the generation goes on target-only."""
    drafter, target, hot = _padded_pair(tmp_path)
    args = ["--dtype", "float32", "--max-draft-tokens", "8", "--log-level", "WARNING"]
    ids = list(range(1000, 1010))
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    with start_services([("drafter", ["--model", drafter] + args), ("verifier", ["--model", target] + args),
                         ("verifier", ["--model", hot] + args)], threads=1) as (drafter_svc, verifier, hot_verifier):
        with SpeculativeClient(verifier.address, drafter=drafter_svc.address) as client:
            assert client.verifier_info.vocab_size == VOCAB + 64 and client.drafter_info.vocab_size == VOCAB
            base = client.generate(ids, greedy, target_only=True)
            spec = client.generate(ids, greedy, num_speculative_tokens=4)
            # a prompt with a padding id (or a stop id past the drafter) runs target-only from the start
            padded_prompt = client.generate(ids + [VOCAB + 1], greedy, num_speculative_tokens=4)
        with SpeculativeClient(hot_verifier.address, drafter=drafter_svc.address) as client:
            runs = [client.generate(ids, SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=seed),
                                    num_speculative_tokens=4) for seed in range(8)]
    assert spec.token_ids == base.token_ids and spec.num_accepted_tokens > 0
    assert padded_prompt.target_only and padded_prompt.num_draft_tokens == 0
    hit = [r for r in runs if any(t >= VOCAB for t in r.token_ids) and r.num_speculative_rounds]
    assert hit, "no sampled run emitted a padding id after speculating: the case is not exercised"
    for r in hit:
        # a round's tokens arrive together: the round of each token, from their arrival times
        round_of = list(itertools.accumulate(int(a != b) for a, b in zip([None] + r.token_times_s, r.token_times_s)))
        first = round_of[next(i for i, t in enumerate(r.token_ids) if t >= VOCAB)]
        assert len(r.gamma_per_round) == round_of[-1] and any(r.gamma_per_round[:first])
        assert r.gamma_per_round[first:] == [0] * (len(r.gamma_per_round) - first)  # no drafts after it


def test_a_model_config_without_eos_stops_at_its_tokenizers_eos(tmp_path):
    """A config without `eos_token_id` (converted and hand-made models often lack one) beside
    a tokenizer that has an EOS: vLLM stops at the tokenizer's EOS; the services served no EOS
    at all and such a model ran to max_tokens through every EOS it sampled."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    path = _save(config, tmp_path / "no-eos", 0)
    eos = load_tokenizer(ModelSpec()).eos_token_id
    assert eos is not None
    args = ["--model", path, "--dtype", "float32", "--log-level", "WARNING"]
    with start_services([("verifier", args), ("drafter", args + ["--backend", "ngram"])], threads=1) as (
            verifier, drafter), SpeculativeClient(verifier.address, drafter=drafter.address) as client:
        assert client.verifier_info.eos_token_ids == (eos,) and client.drafter_info.eos_token_ids == (eos,)
        # The EOS made the greedy choice at every position: the generation ends at the first one.
        forced = SamplingParams(temperature=0.0, max_tokens=8, logit_bias={eos: 100.0})
        out = client.generate(list(range(1000, 1010)), forced)
    assert out.token_ids == [eos] and out.finish_reason == "stop"
