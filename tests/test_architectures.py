"""Models a user brings beyond the llama family that the fast path serves: tiny random-weight
models of other architectures, saved with the embedded tokenizer and served as `--model DIR`.
Greedy speculative output must equal target-only and a plain transformers forward."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, MistralConfig, OPTConfig

from client.launcher import start_service
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
    with start_service("verifier", ["--model", target] + args, threads=1) as verifier, \
            start_service("drafter", ["--model", draft] + args, threads=1) as drafter, \
            SpeculativeClient(verifier.address, drafter=drafter.address) as client:
        base = client.generate(ids, params, target_only=True)
        spec = client.generate(ids, params, num_speculative_tokens=4)
    assert spec.token_ids == base.token_ids == _hf_greedy(target, ids, 30)
    assert spec.num_draft_tokens > spec.num_accepted_tokens  # drafts were rejected: the caches were cropped


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
    logits = lm.forward([1000, 1001, 1002], lm.new_cache(), logits_to_keep=1)
    assert logits.shape == (1, VOCAB) and bool(torch.isfinite(logits).all())
