"""A seeded request gets the same output every time, alone or beside other load, under the
default adaptive γ, through the Python client, the CLI and the gateway.

The services are the row-independent pair (the float32 verifier, the int8 drafter that runs
one row at a time), so batch mates cannot move a row's bits; what is tested is that the
client's round structure (its γ schedule, which decides which position-keyed draws are
used) depends on the request's own rounds only, not on timings or load. The prompts are
shorter than an engine step's token budget (256 on a CPU): a longer one is prefilled in chunks
whose boundaries follow the budget its batch mates left, and a different split moves the
logits' last bits (CPU attention over another query tiling), so its tokens are not guaranteed."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys

import openai
import pytest

from client.launcher import start_gateway
from client.speculative import GenerationResult
from specdec.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "Write a short story about a lighthouse keeper."
OTHERS = ["The weather in Paris is", "List the planets of the solar system:", "def fibonacci(n):",
          "A good breakfast includes", "The French Revolution began", "My favourite book is",
          "In machine learning, overfitting"]
MAX_TOKENS = 24
MODES = {
    "rejection": dict(temperature=0.8, top_p=0.9, seed=7),
    "greedy": dict(temperature=0.0, seed=7),
    "typical": dict(temperature=0.8, seed=7, acceptance_method="typical"),
}


def _beside_load(run_mine, run_other) -> tuple:
    """(run_mine(), [run_other(p) for the 7 other prompts]), all 8 started together."""
    with concurrent.futures.ThreadPoolExecutor(len(OTHERS) + 1) as pool:
        others = [pool.submit(run_other, p) for p in OTHERS]
        mine = pool.submit(run_mine)
        return mine.result(timeout=300), [f.result(timeout=300) for f in others]


@pytest.mark.parametrize("mode", list(MODES))
def test_seeded_request_is_identical_alone_and_beside_seven_others(int8_client, mode):
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **MODES[mode])
    other = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=1.0)  # unseeded load

    def mine() -> GenerationResult:
        return int8_client.generate(PROMPT, params, num_speculative_tokens="auto")

    alone = mine()
    assert len(alone.token_ids) == MAX_TOKENS and alone.num_draft_tokens > 0
    under_load, others = _beside_load(mine, lambda p: int8_client.generate(p, other, num_speculative_tokens="auto"))
    assert under_load.token_ids == alone.token_ids
    assert under_load.gamma_per_round == alone.gamma_per_round  # the same rounds, hence the same draws
    # Power: the load was heavy enough to move an unseeded schedule (the verifier's cap, 2
    # sessions on a CPU, switched the other requests' speculation off).
    assert any(0 in r.gamma_per_round[1:] for r in others)
    if mode != "greedy":  # power: the seed is what fixes the output
        changed = int8_client.generate(PROMPT, params.replace(seed=8), num_speculative_tokens="auto").token_ids
        assert changed != alone.token_ids


def test_seeded_cli_generation_reproduces(verifier_proc, int8_drafter_proc):
    """Two `specdec generate` processes at once (each is the other's load)."""
    cmd = [sys.executable, "-m", "cli", "generate", "--drafter", int8_drafter_proc.address, "--verifier",
           verifier_proc.address, "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--temperature", "0.8",
           "--top-p", "0.9", "--seed", "7", "--json"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    done = [proc.communicate(timeout=300) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), [stderr for _, stderr in done]
    first, second = (json.loads(stdout) for stdout, _ in done)
    assert first["token_ids"] == second["token_ids"] and len(first["token_ids"]) > 0
    assert first["text"] == second["text"]


@pytest.fixture(scope="module")
def seeded_gateway(verifier_proc, int8_drafter_proc):
    with start_gateway(verifier_proc.address, int8_drafter_proc.address, ["--log-level", "WARNING"]) as gw:
        yield gw


def test_seeded_gateway_request_is_identical_alone_and_beside_seven_others(seeded_gateway):
    with openai.OpenAI(base_url=f"http://{seeded_gateway.address}/v1", api_key="unused", max_retries=0,
                       timeout=300) as oai:
        model = oai.models.list().data[0].id

        def complete(prompt: str, extra_body: dict | None = None, **kwargs) -> str:
            return oai.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                          extra_body=extra_body or {"ignore_eos": True}, **kwargs).choices[0].text

        for mode in ("rejection", "typical"):  # typical: SamplingParams' fields by name, as extras
            extra = {k: v for k, v in MODES[mode].items() if k not in ("temperature", "seed")}

            def mine(seed: int = 7) -> str:
                return complete(PROMPT, temperature=0.8, seed=seed, **{"top_p": extra.get("top_p", 1.0)},
                                extra_body={"ignore_eos": True, **{k: v for k, v in extra.items() if k != "top_p"}})

            alone = mine()
            assert alone
            under_load, _ = _beside_load(mine, lambda p: complete(p, temperature=1.0))
            assert under_load == alone, mode
            assert mine(seed=8) != alone
        with pytest.raises(openai.BadRequestError, match="acceptance_method"):
            complete(PROMPT, temperature=0.8, extra_body={"acceptance_method": "medusa"})


@pytest.mark.parametrize("gamma", ["auto", 4])
def test_a_seeded_run_is_a_prefix_of_the_same_run_with_more_max_tokens(int8_client, gamma):
    """max_tokens does not change a seeded request's rounds (its last round drafts as it would
    in a longer run, and what is past max_tokens is dropped), so a shorter run is a prefix of
    a longer one, as with one token a step. Several lengths end inside a round."""
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, ignore_eos=True, max_tokens=40)
    longest = int8_client.generate(PROMPT, params, num_speculative_tokens=gamma)
    assert len(longest.token_ids) == 40 and longest.num_draft_tokens > 0
    for n in (5, 12, 13, 27):
        shorter = int8_client.generate(PROMPT, params.replace(max_tokens=n), num_speculative_tokens=gamma)
        assert shorter.token_ids == longest.token_ids[:n], n
        assert longest.text.startswith(shorter.text)
