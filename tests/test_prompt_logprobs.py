"""vLLM's prompt_logprobs and the completions API's echo: the verifier scores the prompt tokens
it appends under the raw model distribution, across the chunks of a chunked prefill, and the
gateway answers them as vLLM's server does (lm-eval-harness scores a text with `echo=True,
logprobs=1, max_tokens=0`). A tiny random Llama, real verifier, drafter and gateway processes,
the official `openai` package; the reference is a full transformers forward of the prompt."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest
import torch

from client.launcher import start_service, start_services
from client.speculative import SpeculativeClient
from specdec.sampling import SamplingParams
from tests.conftest import SERVICE_THREADS

CHUNK = 18  # the verifier's --max-num-batched-tokens (its minimum): a 40-token prompt takes three steps
PROMPT = ("Speculative decoding drafts several tokens with a small model and verifies them in one "
          "forward of the large one, which keeps the output distribution exactly the target's, "
          "and a verifier prefills a long prompt one bounded chunk per step")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("plp-model")
    subprocess.run([sys.executable, "-m", "cli", "random-model", "--preset", "tiny", "--dtype", "float32",
                    "--out", str(out)], check=True, capture_output=True, timeout=300)
    return out


@pytest.fixture(scope="module")
def services(model_dir):
    with start_services([("verifier", ["--model", str(model_dir), "--max-num-batched-tokens", str(CHUNK),
                                       "--log-level", "WARNING"]),
                         ("drafter", ["--model", str(model_dir), "--log-level", "WARNING"])],
                        threads=SERVICE_THREADS) as (v, d):
        yield v.address, d.address


@pytest.fixture(scope="module")
def client(services):
    verifier, drafter = services
    c = SpeculativeClient(verifier=verifier, drafter=drafter, num_speculative_tokens=3)
    yield c
    c.close()


@pytest.fixture(scope="module")
def reference(model_dir, client):
    """log_softmax of a full transformers forward over the prompt's ids: [L, V]."""
    from transformers import AutoModelForCausalLM

    ids = client.encode_prompt(PROMPT)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return ids, torch.log_softmax(logits.float(), dim=-1)


@pytest.fixture(scope="module")
def oai(services):
    verifier, drafter = services
    with start_service("gateway", ["--verifier", verifier, "--drafter", drafter, "--log-level", "WARNING"]) as gw:
        with openai.OpenAI(base_url=f"http://{gw.address}/v1", api_key="none", max_retries=0, timeout=120) as c:
            yield c


def test_prompt_logprobs_are_the_models_own_across_a_chunked_prefill(client, reference):
    ids, logp = reference
    assert len(ids) > 2 * CHUNK  # three prefill steps: the chunk boundaries are crossed twice
    top_n = 3
    result = client.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=top_n))
    scored = result.prompt_logprobs
    assert result.prompt_token_ids == ids and len(scored) == len(ids) and scored[0] is None
    for i, entry in enumerate(scored[1:], start=1):
        expected = logp[i - 1]  # position i - 1 predicts token i
        assert entry["token_id"] == ids[i]
        assert entry["logprob"] == pytest.approx(expected[ids[i]].item(), abs=1e-4)
        assert entry["rank"] == int((expected > expected[ids[i]]).sum()) + 1
        top = torch.topk(expected, top_n)
        assert list(entry["top_logprobs"]) == top.indices.tolist()
        assert list(entry["top_logprobs"].values()) == pytest.approx(top.values.tolist(), abs=1e-4)
    # Scoring the prompt leaves the verification alone: the same greedy tokens as without it,
    # speculative (γ 3) and target-only.
    plain = client.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))
    alone = client.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), target_only=True)
    assert result.token_ids == plain.token_ids == alone.token_ids
    assert result.num_draft_tokens > 0 and plain.prompt_logprobs is None


def test_prompt_logprobs_on_the_fast_path_come_from_its_pieces(model_dir, client, reference):
    """A verifier on the fast path (`--fast-path on`, the CUDA default, run eagerly here) scores
    the whole prompt in one step as pieces of 32 tokens (static_forward.py), every position kept:
    the same logprobs as the full transformers forward, and the same greedy tokens as the eager
    verifier's."""
    ids, logp = reference
    assert 32 < len(ids) <= 80  # two pieces, one step
    want = client.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), target_only=True).token_ids
    with start_service("verifier", ["--model", str(model_dir), "--fast-path", "on", "--max-num-batched-tokens", "80",
                                    "--log-level", "WARNING"], threads=SERVICE_THREADS) as v, \
            SpeculativeClient(verifier=v.address) as fast:
        result = fast.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=2), target_only=True)
    assert result.token_ids == want and len(result.prompt_logprobs) == len(ids)
    for i, entry in enumerate(result.prompt_logprobs[1:], start=1):
        assert entry["token_id"] == ids[i]
        assert entry["logprob"] == pytest.approx(logp[i - 1][ids[i]].item(), abs=1e-4)
        assert list(entry["top_logprobs"]) == torch.topk(logp[i - 1], 2).indices.tolist()


def test_a_one_token_prompt_has_nothing_to_score(client):
    ids = client.encode_prompt(PROMPT)[:1]
    result = client.generate(ids, SamplingParams(temperature=0.8, seed=3, max_tokens=4, prompt_logprobs=0))
    assert result.prompt_logprobs == [None]


def test_echo_with_max_tokens_0_answers_the_prompt_and_its_logprobs(oai, reference):
    """lm-eval-harness's loglikelihood request."""
    ids, logp = reference
    response = oai.completions.create(model="", prompt=PROMPT, echo=True, logprobs=1, max_tokens=0, temperature=0)
    choice = response.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(ids) and response.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert "".join(lp.tokens) == PROMPT and lp.text_offset[0] == 0


def test_echo_puts_the_prompt_before_the_completion_streamed_or_not(oai):
    args = dict(model="", prompt=PROMPT, logprobs=2, max_tokens=6, temperature=0)
    plain = oai.completions.create(**args).choices[0]
    echoed = oai.completions.create(echo=True, **args).choices[0]
    assert echoed.text == PROMPT + plain.text
    assert echoed.logprobs.tokens[-len(plain.logprobs.tokens):] == plain.logprobs.tokens
    assert echoed.logprobs.token_logprobs[-6:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    text, tokens, offsets = "", [], []
    for event in oai.completions.create(echo=True, stream=True, **args):
        for c in event.choices:
            text += c.text
            if c.logprobs:
                tokens += c.logprobs.tokens
                offsets += c.logprobs.text_offset
    assert text == echoed.text and tokens == echoed.logprobs.tokens and offsets == echoed.logprobs.text_offset


def test_prompt_logprobs_field_has_vllms_shape(oai, reference):
    ids, logp = reference
    body = oai.completions.create(model="", prompt=PROMPT, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2}).model_dump()
    scored = body["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    for i, entry in enumerate(scored[1:], start=1):
        own = entry[str(ids[i])]  # the prompt token itself is always there, with its rank
        assert own["logprob"] == pytest.approx(logp[i - 1, ids[i]].item(), abs=1e-4)
        assert own["rank"] == int((logp[i - 1] > logp[i - 1, ids[i]]).sum()) + 1
        best = int(logp[i - 1].argmax())
        assert entry[str(best)]["rank"] == 1 and isinstance(entry[str(best)]["decoded_token"], str)
        assert len(entry) in (2, 3)  # the top 2, and the prompt token unless it is among them
    chat = oai.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi there"}], max_tokens=2,
                                       temperature=0, extra_body={"prompt_logprobs": 0}).model_dump()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # 0: the prompt token's own alone


def test_echo_scores_a_prompt_that_fills_the_context(oai):
    """lm-eval's rolling loglikelihood sends full windows of exactly the context: vLLM scores
    them (prompt + max_tokens 0 fits); one token more is context_length_exceeded."""
    context = oai.models.list().data[0].model_extra["max_model_len"]
    window = [(7 * i) % 1000 + 100 for i in range(context)]
    choice = oai.completions.create(model="", prompt=window, echo=True, logprobs=0, max_tokens=0).choices[0]
    assert len(choice.logprobs.token_logprobs) == context and choice.logprobs.token_logprobs[0] is None
    assert all(lp is not None for lp in choice.logprobs.token_logprobs[1:])
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model="", prompt=window + [100], echo=True, logprobs=0, max_tokens=0)
    assert err.value.body["code"] == "context_length_exceeded"


@pytest.mark.parametrize("fields,param", [({"max_tokens": 0}, "max_tokens"),
                                          ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
                                          ({"extra_body": {"prompt_logprobs": -1}}, "prompt_logprobs"),
                                          # vLLM's rule: not in a stream (an echoed prompt's logprobs are)
                                          ({"stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs")])
def test_max_tokens_0_without_echo_and_prompt_logprobs_out_of_range_are_400(oai, fields, param):
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model="", prompt=PROMPT, **fields)
    assert err.value.body["param"] == param
