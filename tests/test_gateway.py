"""The OpenAI-compatible gateway as a real process in front of real drafter / verifier
processes, driven by the official `openai` package (and raw HTTP where the SDK cannot
send what is tested: malformed JSON, a missing key)."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import importlib.metadata
import json
import statistics
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.serve import server_stats
from cli import main
from client.launcher import start_gateway, start_service
from client.output import OutputProcessor
from client.speculative import GenerationResult, StreamChunk
from gateway.protocol import ResponseBuilder
from specdec.sampling import SamplingParams
from tests.conftest import wait_for

API_KEY = "test-gateway-key"
PROMPT = "Why is the sky blue? Answer in one sentence."
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def gateway(verifier_proc, drafter_proc):
    # The key comes from the environment, as in a container.
    with start_gateway(verifier_proc.address, drafter_proc.address, ["--log-level", "WARNING"],
                       env={"SPECDEC_GATEWAY_API_KEY": API_KEY}) as gw:
        yield gw
    assert not any("Traceback" in line for line in gw.output), gw.output[-30:]


@pytest.fixture(scope="module")
def base_url(gateway) -> str:
    return f"http://{gateway.address}"


@pytest.fixture(scope="module")
def oai(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(oai) -> str:
    return oai.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer():
    from specdec.models import ModelSpec, load_tokenizer

    return load_tokenizer(ModelSpec(model="embedded"))


@pytest.fixture(scope="module")
def cli_generation(verifier_proc, drafter_proc) -> dict:
    """`specdec generate --chat --json`, greedy, the parameters the chat tests use."""
    out = subprocess.run(
        [sys.executable, "-m", "cli", "generate", "--drafter", drafter_proc.address, "--verifier",
         verifier_proc.address, "--prompt", PROMPT, "--chat", "--max-tokens", str(MAX_TOKENS), "--temperature", "0",
         "--json"], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def chat_reply(oai, model):
    return oai.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                       max_tokens=MAX_TOKENS, temperature=0)


def _chat_stream(oai, model, **kwargs) -> list:
    return list(oai.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True, **kwargs))


def _live_sessions(*services) -> list[int]:
    return [server_stats(s.address, s.role)["live_sessions"] for s in services]


# ---- output ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_greedy_chat_completion_equals_specdec_generate_chat(chat_reply, cli_generation):
    choice = chat_reply.choices[0]
    assert chat_reply.object == "chat.completion" and chat_reply.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant"
    assert choice.message.content == cli_generation["text"] != ""
    assert choice.finish_reason == cli_generation["finish_reason"]


@pytest.mark.slow
def test_usage_counts_match_the_token_ids(chat_reply, cli_generation, tokenizer):
    templated = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                              tokenize=True)
    templated = templated["input_ids"] if hasattr(templated, "keys") else templated
    usage = chat_reply.usage
    assert usage.prompt_tokens == len(templated) == len(cli_generation["prompt_token_ids"])
    assert usage.completion_tokens == len(cli_generation["token_ids"])
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # The speculative counters ride in an extra field.
    spec = chat_reply.model_extra["speculative"]
    assert 0 < spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    assert spec["acceptance_rate"] == pytest.approx(spec["num_accepted_tokens"] / spec["num_draft_tokens"])


@pytest.mark.slow
def test_streamed_chat_chunks_concatenate_to_the_non_streamed_text(oai, model, chat_reply):
    chunks = _chat_stream(oai, model, stream_options={"include_usage": True})
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].object == "chat.completion.chunk"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat_reply.choices[0].message.content
    finished = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finished == [chat_reply.choices[0].finish_reason]
    # include_usage: one last chunk with no choices and the usage of the whole completion.
    assert chunks[-1].choices == [] and chunks[-1].usage == chat_reply.usage
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.slow
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(oai, model, chat_reply):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries
    its choice's usage up to it, ending at the whole completion's."""
    chunks = _chat_stream(oai, model, stream_options={"include_usage": True, "continuous_usage_stats": True})
    prompt, final = chat_reply.usage.prompt_tokens, chat_reply.usage.completion_tokens
    assert all(c.usage is not None and c.usage.prompt_tokens == prompt for c in chunks)
    assert all(c.usage.total_tokens == prompt + c.usage.completion_tokens for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == final > counts[1] > 0
    assert chunks[-1].choices == [] and chunks[-1].usage == chat_reply.usage


@pytest.mark.slow
def test_streamed_completion_chunks_concatenate_to_the_non_streamed_text(oai, model):
    kwargs = dict(model=model, prompt="The three primary colors are", max_tokens=MAX_TOKENS, temperature=0)
    whole = oai.completions.create(**kwargs)
    chunks = list(oai.completions.create(stream=True, **kwargs))
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text != ""
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


@pytest.mark.slow
def test_seed_reproduces_a_sampled_completion(oai, model):
    def sample(seed: int) -> str:
        return oai.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=1.0,
                                      seed=seed).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert len({first, sample(1), sample(2)}) > 1  # and the seed is what fixes it


@pytest.mark.slow
def test_a_batch_of_prompts_sampled_n_times_equals_one_request_per_choice(oai, model):
    """Choice i is prompt i // n's (vLLM's numbering); a seeded choice j draws with seed + j, so
    each choice equals the single request with that seed, and the choices of a prompt differ."""
    prompts = ["Once upon a time", "The ocean is", "def main():"]
    common = {"model": model, "max_tokens": 8, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    reply = oai.completions.create(prompt=prompts, n=2, seed=40, **common)
    assert [c.index for c in reply.choices] == list(range(6))
    alone = [oai.completions.create(prompt=p, seed=40 + j, **common) for p in prompts for j in range(2)]
    assert [c.text for c in reply.choices] == [a.choices[0].text for a in alone]
    assert reply.choices[0].text != reply.choices[1].text
    assert reply.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone[::2])  # each prompt once
    assert reply.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone) == 48

    streamed = oai.completions.create(prompt=prompts, n=2, seed=40, stream=True,
                                      stream_options={"include_usage": True}, **common)
    texts, finished, usage_chunks = collections.defaultdict(str), {}, []
    for chunk in streamed:
        if not chunk.choices:
            usage_chunks.append(chunk.usage)
            continue
        (choice,) = chunk.choices
        assert choice.index not in finished  # nothing after a choice's finish chunk
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finished[choice.index] = choice.finish_reason
    assert [texts[i] for i in range(6)] == [c.text for c in reply.choices] and len(finished) == 6
    assert len(usage_chunks) == 1 and usage_chunks[0].completion_tokens == 48  # once, after every choice
    as_ids = oai.completions.create(prompt=[[1, 504, 2988], [42, 7]], temperature=0, max_tokens=4, model=model)
    assert [c.text for c in as_ids.choices] == [oai.completions.create(prompt=p, temperature=0, max_tokens=4,
                                                                       model=model).choices[0].text
                                                for p in ([1, 504, 2988], [42, 7])]


@pytest.mark.slow
def test_chat_n_streams_a_role_chunk_and_the_text_of_each_choice(oai, model):
    messages = [{"role": "user", "content": PROMPT}]
    reply = oai.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0, n=3)
    assert len({c.message.content for c in reply.choices}) == 1  # greedy: every choice the same
    roles, texts = collections.Counter(), collections.defaultdict(str)
    for chunk in oai.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0, n=3,
                                             stream=True):
        for choice in chunk.choices:
            roles[choice.index] += choice.delta.role == "assistant"
            texts[choice.index] += choice.delta.content or ""
    assert roles == {0: 1, 1: 1, 2: 1} and all(t == reply.choices[0].message.content for t in texts.values())


@pytest.mark.slow
def test_logprobs_are_returned_per_token_in_the_chat_shape(oai, model):
    reply = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=6,
                                        temperature=0, logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0.0
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs))  # greedy: the argmax


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 2])
def test_completion_logprobs_have_the_sampled_token_first_in_each_top_dict(oai, model, k):
    """vLLM's completions shape: logprobs=k gives each token's top-k, led by the sampled token
    (so logprobs=0 still names it); the text offsets walk the tokens' texts."""
    reply = oai.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=k)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == reply.usage.completion_tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert next(iter(top.items())) == (token, pytest.approx(logprob)) and logprob <= 0.0
        assert len(top) <= k + 1 and (k == 0 or logprob == pytest.approx(max(top.values())))  # greedy: argmax


def test_stop_reason_names_the_stop_and_include_stop_str_in_output_keeps_it(oai, model, chat_reply,
                                                                           cli_generation):
    """vLLM's stop_reason: the stop string or stop token id that ended a choice (None for EOS
    and length), in the response and in the stream's last chunk; include_stop_str_in_output
    keeps the stop string at the end of the text."""
    def chat(**kwargs):
        return oai.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=MAX_TOKENS, temperature=0, **kwargs)

    free = chat_reply.choices[0].message.content
    assert getattr(chat_reply.choices[0], "stop_reason", "absent") is None
    stop = free.split()[3]  # a word the greedy reply reaches after a few tokens
    head = free[:free.index(stop)]
    cut, kept = chat(stop=[stop]), chat(stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert cut.choices[0].message.content == head and kept.choices[0].message.content == head + stop
    assert cut.choices[0].stop_reason == kept.choices[0].stop_reason == stop
    assert cut.choices[0].finish_reason == "stop"
    streamed = list(chat(stop=[stop], stream=True, extra_body={"include_stop_str_in_output": True}))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == head + stop
    assert streamed[-1].choices[0].stop_reason == stop
    # A stop token id: the reply's third token (the CLI's greedy ids for the same request).
    token = cli_generation["token_ids"][2]
    by_id = chat(extra_body={"stop_token_ids": [token]})
    assert by_id.choices[0].stop_reason == token and by_id.choices[0].finish_reason == "stop"
    assert by_id.usage.completion_tokens == cli_generation["token_ids"].index(token) + 1


def test_a_stream_open_at_shutdown_ends_with_an_error_event_before_the_grace_runs_out(verifier_proc, drafter_proc):
    """SIGTERM with a long stream open and --grace-s 2: the stream gets an error event (503,
    `shutting_down`) and `data: [DONE]` before the grace ends, instead of a body cut mid-chunk
    (and a CancelledError traceback in the log); the gateway exits and the generation's
    sessions close."""
    before = _live_sessions(verifier_proc, drafter_proc)  # other tests' clients share these services
    with start_gateway(verifier_proc.address, drafter_proc.address, ["--grace-s", "2", "--log-level", "INFO"]) as gw:
        model = httpx.get(f"http://{gw.address}/v1/models", timeout=30).json()["data"][0]["id"]
        body = {"model": model, "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "temperature": 0,
                "stream": True}
        # A request without a stream, running at the shutdown too: it got a plain-text 500 when
        # the server cancelled it at the grace's end.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            whole = pool.submit(httpx.post, f"http://{gw.address}/v1/completions", json={**body, "stream": False},
                                timeout=60)
            events = _stream_until_shutdown(gw, body)
            reply = whole.result()
        ended = time.monotonic() - events.pop()
        assert gw.proc.wait(timeout=30) in (0, -15)  # uvicorn re-raises the signal once it has shut down
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "shutting_down", reply.text
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == "shutting_down" and "shutting down" in error["message"], error
    assert 1.0 < ended < 2.0, ended  # at the grace less its margin, not at once and not past it
    assert not any("Traceback" in line for line in gw.output), gw.output[-30:]
    wait_for(lambda: _live_sessions(verifier_proc, drafter_proc) == before, 10, "the stream's sessions to close")


def _stream_until_shutdown(gw, body: dict) -> list:
    """The stream's events, SIGTERM sent after the third; the last item is when it was sent."""
    events, start = [], None
    with httpx.stream("POST", f"http://{gw.address}/v1/completions", json=body, timeout=60) as streamed:
        for line in streamed.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 3:
                    start = time.monotonic()
                    gw.proc.terminate()
    return [*events, start]


def _strict_json(text: str):
    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_logprobs_of_tokens_a_filter_removed_are_json_numbers_not_infinity(base_url, model, endpoint):
    """top_k 1 leaves one token a position, so the other top-3 tokens have probability 0
    under the processed distribution: -9999.0 as vLLM writes it, in strict JSON (a
    ValueError and a 500 before, -Infinity in streams), streamed and not."""
    body = {"model": model, "max_tokens": 3, "temperature": 1.0, "top_k": 1, "seed": 3, "ignore_eos": True}
    if endpoint == "chat":
        body.update(messages=[{"role": "user", "content": PROMPT}], logprobs=True, top_logprobs=3)
    else:
        body.update(prompt=PROMPT, logprobs=3)
    url = f"{base_url}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}"
    auth = {"Authorization": f"Bearer {API_KEY}"}
    reply = httpx.post(url, json=body, headers=auth, timeout=120)
    assert reply.status_code == 200, reply.text
    lp = _strict_json(reply.text)["choices"][0]["logprobs"]
    tops = ([[t["logprob"] for t in e["top_logprobs"]] for e in lp["content"]] if endpoint == "chat"
            else [list(top.values()) for top in lp["top_logprobs"]])
    assert len(tops) == 3 and all(len(top) >= 3 and top[0] == 0.0 and -9999.0 in top for top in tops), tops
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=auth, timeout=120) as streamed:
        events = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "Infinity" not in "".join(events)
    assert all(_strict_json(event) for event in events[:-1])


@pytest.mark.slow
def test_health_answers_head_and_version_names_the_package(base_url):
    with httpx.Client(base_url=base_url) as http:
        assert http.head("/health").status_code == 200
        version = http.get("/version")
    assert version.status_code == 200 and version.json()["version"] == importlib.metadata.version("specdec")


@pytest.mark.slow
def test_continue_final_message_continues_the_assistants_text(oai, model, tokenizer):
    """vLLM's assistant prefill: the prompt ends inside the last assistant message (no end of
    turn after it) and the reply is its continuation, as a completion of those ids would be."""
    prefix = "The sky looks blue because"
    messages = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": prefix}]
    reply = oai.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True,
                                        tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)
    assert tokenizer.decode(ids).endswith(prefix)  # the turn is left open
    assert reply.usage.prompt_tokens == len(ids)
    same = oai.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content == same.choices[0].text != ""
    closed = oai.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    assert closed.usage.prompt_tokens > len(ids)  # the default closes the turn and opens a new one


# ---- errors ----------------------------------------------------------------------------------


_UNPARSABLE = {"bytes that are not UTF-8": b'{"prompt": "\xff\xfe", "max_tokens": 2}',
               "JSON nested past Python's recursion limit": b"[" * 100_000 + b"]" * 100_000,
               "an integer of 5,000 digits": b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}"}


def _bad(oai, model, base_url, case: str) -> httpx.Response | openai.APIStatusError:
    messages = [{"role": "user", "content": "hi"}]
    if case == "malformed JSON":
        return httpx.post(f"{base_url}/v1/chat/completions", content=b'{"model": "x", "messages": [',
                          headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    if case in _UNPARSABLE:  # FastAPI's own parse errors: a 400 without the code before
        return httpx.post(f"{base_url}/v1/completions", content=_UNPARSABLE[case],
                          headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    if case == "a body past --max-request-bytes":
        body = json.dumps({"model": model, "prompt": "x" * (33 << 20), "max_tokens": 2}).encode()
        headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
        declared = httpx.post(f"{base_url}/v1/completions", content=body, headers=headers)
        assert declared.status_code == 413, declared.text  # refused on its Content-Length
        # Chunked: no length declared, counted as it arrives.
        return httpx.post(f"{base_url}/v1/completions", headers=headers,
                          content=(body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20)))
    if case == "prompt token id past the vocabulary":
        with pytest.raises(openai.APIStatusError) as info:
            oai.completions.create(model=model, prompt=[1, 10**7], max_tokens=2)
        return info.value
    if case == "a prompt of more characters than the context can hold":  # refused before tokenizing it
        with pytest.raises(openai.APIStatusError) as info:
            oai.completions.create(model=model, prompt="x" * 2_000_000, max_tokens=2)
        assert "characters" in info.value.message
        return info.value
    if case == "a body that is a JSON array":
        reply = httpx.post(f"{base_url}/v1/completions", content=b'[1, 2]',
                           headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
        assert "must be a JSON object" in reply.json()["error"]["message"], reply.text
        return reply
    if case in ("response_format on completions", "a prompt batch past 64 choices"):  # a 200 of free text before
        kwargs = ({"prompt": "hi", "extra_body": {"response_format": {"type": "json_object"}}} if "response_format" in case
                  else {"prompt": ["hi"] * 65, "n": 1})  # counted before tokenizing; the batch is the field, not n
        with pytest.raises(openai.APIStatusError) as info:
            oai.completions.create(model=model, max_tokens=2, **kwargs)
        return info.value
    if case == "missing key":
        return httpx.post(f"{base_url}/v1/chat/completions", json={"model": model, "messages": messages})
    if case in ("a lone surrogate in the prompt", "a lone surrogate in a message"):  # valid JSON, not valid text
        path, body = (("/v1/completions", '{"prompt": "hi \\ud800 there", "max_tokens": 2}') if "prompt" in case
                      else ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi \\ud800"}]}'))
        reply = httpx.post(f"{base_url}{path}", content=body.encode(),
                           headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
        assert "not valid Unicode" in reply.json()["error"]["message"], reply.text  # not the tokenizer's TypeError
        return reply
    client = oai if case != "wrong key" else openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0)
    kwargs = {"unknown model": {"model": "no-such-model"}, "n=0": {"n": 0}, "n past 64 choices": {"n": 65},
              "temperature=-1": {"temperature": -1},
              "temperature past a 32-bit float": {"temperature": 1e308},
              "stop_token_ids past the vocabulary": {"extra_body": {"stop_token_ids": [10**8]}},
              "max_tokens past the context": {"max_tokens": 4096}, "wrong key": {},
              # vLLM's chat-template extras: add_generation_prompt defaults to true
              "continue_final_message with a generation prompt": {"extra_body": {"continue_final_message": True}},
              "continue_final_message after a user message": {
                  "extra_body": {"continue_final_message": True, "add_generation_prompt": False}},
              "chat_template_kwargs naming a call argument": {"extra_body": {"chat_template_kwargs": {"tokenize": False}}},
              # defined by vLLM and not done here: refused, since output that only looks constrained is worse
              "guided_json": {"extra_body": {"guided_json": {"type": "object"}}},
              "an empty guided_json schema": {"extra_body": {"guided_json": {}}},  # vLLM's "any JSON value"
              "return_tokens_as_token_ids": {"logprobs": True, "extra_body": {"return_tokens_as_token_ids": True}},
              "return_token_ids": {"extra_body": {"return_token_ids": True}},  # ignored before: no ids came back
              "best_of on chat": {"extra_body": {"best_of": 3}},  # ignored before, refused on completions
              "best_of below n": {"n": 2, "extra_body": {"best_of": 1}},  # vLLM's 400; accepted before
              "use_beam_search": {"extra_body": {"use_beam_search": True}},
              "top_k=-5": {"extra_body": {"top_k": -5}},
              # past the wire's int32 / 0 as its float32: refused by name (a bare 'Value out of range'
              # before, after the verifier session had opened, which then stayed open)
              "top_k past an int32": {"extra_body": {"top_k": 2**31}},
              "top_p of 0 as a 32-bit float": {"top_p": 1e-50},
              "repetition_penalty of 0 as a 32-bit float": {"extra_body": {"repetition_penalty": 1e-50}},
              "logit_bias keyed by a word": {"logit_bias": {"hello": 5}},
              "logit_bias past the vocabulary": {"logit_bias": {str(10**7): 5}},
              "logit_bias keyed by 5,000 digits": {"logit_bias": {"9" * 5000: 5}},  # came back whole in the error
              "allowed_token_ids past the vocabulary": {"extra_body": {"allowed_token_ids": [5, 10**7]}},
              # refused by the services (min_tokens would mask every allowed token): their field is the param
              "allowed_token_ids all masked by min_tokens": {"max_tokens": 4, "extra_body": {
                  "allowed_token_ids": [5], "stop_token_ids": [5], "min_tokens": 3}},
              }[case]
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(**{"model": model, "messages": messages, "max_tokens": 2, **kwargs})
    return info.value


@pytest.mark.slow
@pytest.mark.parametrize("case,status,param,code", [
    ("unknown model", 404, "model", "model_not_found"),
    ("n=0", 400, "n", None),
    ("n past 64 choices", 400, "n", None),
    ("temperature=-1", 400, "temperature", None),
    ("temperature past a 32-bit float", 400, "temperature", None),
    ("stop_token_ids past the vocabulary", 400, "stop_token_ids", None),
    ("max_tokens past the context", 400, "max_tokens", "context_length_exceeded"),
    ("malformed JSON", 400, None, "invalid_json"),
    ("bytes that are not UTF-8", 400, None, "invalid_json"),
    ("JSON nested past Python's recursion limit", 400, None, "invalid_json"),
    ("an integer of 5,000 digits", 400, None, "invalid_json"),
    ("a body past --max-request-bytes", 413, None, "request_too_large"),
    ("wrong key", 401, None, "invalid_api_key"),
    ("missing key", 401, None, "invalid_api_key"),
    ("prompt token id past the vocabulary", 400, "prompt", None),
    ("a prompt of more characters than the context can hold", 400, "prompt", "context_length_exceeded"),
    ("continue_final_message with a generation prompt", 400, "continue_final_message", None),
    ("continue_final_message after a user message", 400, "continue_final_message", None),
    ("chat_template_kwargs naming a call argument", 400, "chat_template_kwargs", None),
    ("guided_json", 400, "guided_json", None),
    ("an empty guided_json schema", 400, "guided_json", None),
    ("return_tokens_as_token_ids", 400, "return_tokens_as_token_ids", None),
    ("return_token_ids", 400, "return_token_ids", None),
    ("best_of on chat", 400, "best_of", None),
    ("best_of below n", 400, "best_of", None),
    ("response_format on completions", 400, "response_format", None),
    ("a prompt batch past 64 choices", 400, "prompt", None),
    ("a body that is a JSON array", 400, None, "invalid_json"),
    ("use_beam_search", 400, "use_beam_search", None),
    ("top_k=-5", 400, "top_k", None),
    ("top_k past an int32", 400, "top_k", None),
    ("top_p of 0 as a 32-bit float", 400, "top_p", None),
    ("repetition_penalty of 0 as a 32-bit float", 400, "repetition_penalty", None),
    ("logit_bias keyed by a word", 400, "logit_bias", None),
    ("logit_bias past the vocabulary", 400, "logit_bias", None),
    ("logit_bias keyed by 5,000 digits", 400, "logit_bias", None),
    ("allowed_token_ids past the vocabulary", 400, "allowed_token_ids", None),
    ("allowed_token_ids all masked by min_tokens", 400, "allowed_token_ids", None),
    ("a lone surrogate in the prompt", 400, "prompt", None),
    ("a lone surrogate in a message", 400, "messages", None),
])
def test_bad_request_gets_its_status_and_openai_error_body_and_the_gateway_keeps_serving(
        oai, model, base_url, case, status, param, code):
    reply = _bad(oai, model, base_url, case)
    assert reply.status_code == status
    error = reply.response.json() if isinstance(reply, openai.APIStatusError) else reply.json()
    assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}
    assert (error["error"]["param"], error["error"]["code"]) == (param, code)
    assert 0 < len(error["error"]["message"]) < 1000  # a caller's value is shown cut, never whole
    after = oai.completions.create(model=model, prompt="Hello", max_tokens=2, temperature=0)
    assert after.choices[0].finish_reason == "length" and after.usage.completion_tokens == 2


@pytest.mark.slow
def test_logit_bias_and_allowed_token_ids_constrain_the_reply(oai, model, tokenizer):
    """OpenAI's logit_bias (clamped to ±100, as vLLM) and vLLM's allowed_token_ids reach both
    services: a banned token never appears, and an allowed set bounds every token."""
    prompt = "The capital of France is"
    plain = oai.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0,
                                   extra_body={"ignore_eos": True})
    first = tokenizer(plain.choices[0].text, add_special_tokens=False).input_ids[0]
    banned = oai.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0,
                                    logit_bias={str(first): -1000}, extra_body={"ignore_eos": True})
    assert banned.choices[0].text != plain.choices[0].text
    assert first not in tokenizer(banned.choices[0].text, add_special_tokens=False).input_ids
    # Words of one token each: the reply's words are then exactly the tokens it sampled.
    words = [w for w in ("Paris", "London", "Rome", "the", "a", "city", "and")
             if len(tokenizer(" " + w, add_special_tokens=False).input_ids) == 1]
    allowed = [tokenizer(" " + w, add_special_tokens=False).input_ids[0] for w in words]
    out = oai.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=1.0, seed=1,
                                 extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    assert len(words) >= 4 and out.usage.completion_tokens == 8
    assert set(out.choices[0].text.split()) <= set(words), out.choices[0].text


@pytest.mark.slow
def test_fields_that_change_nothing_are_accepted(oai, model):
    """OpenAI's `user`, options at their defaults, and a field no API defines (ignored and
    logged, as vLLM does) do not fail a request."""
    out = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                      temperature=0, user="u-1", extra_body={
                                          "skip_special_tokens": True, "include_stop_str_in_output": False,
                                          "guided_json": None, "modalities": ["text"], "foo_bar": 1})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 2


@pytest.mark.slow
def test_unreachable_upstream_is_503_on_health_and_api():
    # A request waits up to --recovery-timeout-s for the upstream connection before its 503
    # (tests/test_gateway_startup.py); httpx gives up after 5 s.
    with start_service("gateway", ["--verifier", "127.0.0.1:1", "--recovery-timeout-s", "1",
                                   "--log-level", "ERROR"]) as gw:
        url = f"http://{gw.address}"
        assert httpx.get(f"{url}/health").status_code == 503
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert reply.status_code == 503
        assert reply.json()["error"]["code"] == "upstream_unavailable"
        assert httpx.get(f"{url}/health").status_code == 503  # still serving


def test_health_counts_no_verifier_left_out_of_its_pool(verifier_proc):
    """A pool member that came back serving another model is left out (checked again every 30 s): it answers
    GetModelInfo, but no generation goes to it, so /health must not call the gateway up on it
    (it answered 200 "ok" while every request got 503)."""
    from gateway.upstream import Upstream, UpstreamConfig
    from tests.conftest import free_port

    async def run() -> None:
        up = Upstream(UpstreamConfig(verifier=f"{verifier_proc.address},127.0.0.1:{free_port()}"))
        await up.connect_forever()
        try:
            ok, detail = await up.health()
            assert ok and detail["status"] == "ok" and detail["verifiers"][verifier_proc.address] == "up"
            live = next(s for s in up.client.verifiers.servers if s.address == verifier_proc.address)
            up.client.verifiers.disable(live, "serves another model")
            ok, detail = await up.health()
            assert not ok and detail["status"] == "unavailable"
            assert detail["verifiers"][verifier_proc.address] == "left out"
        finally:
            await asyncio.to_thread(up.client.close)

    asyncio.run(run())


@pytest.mark.slow
def test_a_taken_port_and_unusable_tls_files_are_one_line_errors(tmp_path):
    def gateway(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cli", "gateway", "--verifier", "127.0.0.1:1", *args],
                              capture_output=True, text=True, timeout=60)

    with start_service("gateway", ["--verifier", "127.0.0.1:1", "--log-level", "ERROR"]) as gw:
        taken = gateway("--port", gw.address.rsplit(":", 1)[1])
    assert taken.returncode == 1 and "could not listen on 127.0.0.1:" in taken.stderr, taken.stderr[-2000:]
    (tmp_path / "bad.pem").write_text("not a certificate")
    for cert in (tmp_path / "missing.pem", tmp_path / "bad.pem"):
        bad = gateway("--port", "0", "--ssl-certfile", str(cert), "--ssl-keyfile", str(cert))
        assert bad.returncode == 2 and f"--ssl-certfile '{cert}'" in bad.stderr, bad.stderr[-2000:]  # a usage error
    for run in (taken, bad):
        assert "Traceback" not in run.stderr


# ---- operations ------------------------------------------------------------------------------


@pytest.mark.slow
def test_client_disconnect_mid_stream_closes_its_upstream_sessions(oai, model, verifier_proc, drafter_proc):
    baseline = _live_sessions(verifier_proc, drafter_proc)
    # Long enough to run for a minute if nothing stopped it.
    stream = oai.completions.create(model=model, prompt="Count from one to one thousand:", max_tokens=1000,
                                    temperature=0, stream=True, extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].text)
        if received == 2:
            break
    assert _live_sessions(verifier_proc, drafter_proc) == [n + 1 for n in baseline]
    stream.close()
    t0 = time.monotonic()
    wait_for(lambda: _live_sessions(verifier_proc, drafter_proc) == baseline, 15.0, "sessions closed")
    assert time.monotonic() - t0 < 15.0


@pytest.mark.slow
def test_streams_that_end_leave_no_session_and_an_abandoned_request_logs_no_error(oai, model, gateway, base_url,
                                                                                  verifier_proc, drafter_proc):
    """Streamed requests read to their end: the gateway ends each generation at its last chunk,
    which must not cut the close of its sessions short (it left 1 in 4 open until the TTL).
    A non-streamed request whose client gives up is cancelled without an ERROR in the log."""
    baseline = _live_sessions(verifier_proc, drafter_proc)
    for i in range(12):
        text = "".join(c.choices[0].text for c in oai.completions.create(
            model=model, prompt=CONCURRENT_PROMPTS[i], max_tokens=4, temperature=0, stream=True) if c.choices)
        assert text
    wait_for(lambda: _live_sessions(verifier_proc, drafter_proc) == baseline, 10.0, "sessions closed")
    with pytest.raises(httpx.TimeoutException):
        r = httpx.post(f"{base_url}/v1/completions", timeout=0.5, headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"model": model, "prompt": "Count from one to one thousand:", "max_tokens": 500,
                             "temperature": 0, "ignore_eos": True})
        pytest.fail(f"answered within 0.5 s: {r.status_code} {r.text[:300]}")
    wait_for(lambda: _live_sessions(verifier_proc, drafter_proc) == baseline, 15.0, "sessions closed")
    assert not [line for line in gateway.output if "never retrieved" in line or "Traceback" in line]


@pytest.fixture(scope="module")
def target_only_gateway(verifier_proc):
    with start_gateway(verifier_proc.address, None, ["--log-level", "WARNING"]) as gw:
        yield f"http://{gw.address}"


CONCURRENT_PROMPTS = [f"{animal} are" for animal in ("Apples", "Bears", "Cats", "Dogs", "Eagles", "Frogs", "Goats",
                                                      "Horses", "Ibises", "Jaguars", "Koalas", "Lions", "Mice",
                                                      "Newts", "Owls", "Pigs")]


async def _complete(client: openai.AsyncOpenAI, prompt: str, stream: bool) -> tuple[str, float]:
    """(text, seconds) of one greedy completion."""
    t0 = time.perf_counter()
    kwargs = dict(model=(await client.models.list()).data[0].id, prompt=prompt, max_tokens=8, temperature=0,
                  extra_body={"ignore_eos": True})
    if not stream:
        return (await client.completions.create(**kwargs)).choices[0].text, time.perf_counter() - t0
    text = ""
    async for chunk in await client.completions.create(stream=True, **kwargs):
        text += chunk.choices[0].text if chunk.choices else ""
    return text, time.perf_counter() - t0


async def _concurrently(base_url: str, api_key: str, solo_first: bool, verifier_address: str) -> dict:
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=300) as c:
        solo = [await _complete(c, p, stream=False) for p in CONCURRENT_PROMPTS] if solo_first else []
        before = server_stats(verifier_address, "verifier")
        t0 = time.perf_counter()
        together = await asyncio.gather(*(_complete(c, p, stream=True) for p in CONCURRENT_PROMPTS))
        wall = time.perf_counter() - t0
        after = server_stats(verifier_address, "verifier")
    return {"solo": solo, "together": together, "wall": wall,
            "mean_batch": (after["batched_rows"] - before["batched_rows"]) / (after["batches"] - before["batches"])}


@pytest.fixture(scope="module")
def solo_outputs(target_only_gateway, verifier_proc) -> dict:
    """16 greedy requests one at a time, then the same 16 as concurrent streams, target-only."""
    return asyncio.run(_concurrently(target_only_gateway, "unused", True, verifier_proc.address))


@pytest.mark.slow
def test_sixteen_concurrent_streams_each_equal_their_solo_output_in_well_under_16x_one(solo_outputs):
    """Target-only decoding is where a front end that serialized requests would show (16x one
    request) against one that runs them at once (the verifier batches them: ~3x on this CPU).
    Speculative requests below: on a CPU their verify of γ+1 tokens each is compute-bound, so
    batching 16 of them saves little whatever the front end does (the gRPC client alone takes
    ~9-13x one request there)."""
    run = solo_outputs
    assert [text for text, _ in run["together"]] == [text for text, _ in run["solo"]]
    assert len({text for text, _ in run["solo"]}) > 8  # distinct outputs: a mixed-up stream would show
    one_request = statistics.median(seconds for _, seconds in run["solo"])
    assert run["wall"] < 8 * one_request, f"16 concurrent took {run['wall']:.1f} s, one alone {one_request:.2f} s"
    assert run["mean_batch"] > 4  # they overlapped upstream


@pytest.mark.slow
def test_sixteen_concurrent_speculative_streams_equal_the_solo_outputs_and_overlap_upstream(
        base_url, verifier_proc, solo_outputs):
    run = asyncio.run(_concurrently(base_url, API_KEY, False, verifier_proc.address))
    # Greedy speculative decoding emits the target's tokens: each equals its solo (target-only) output.
    assert [text for text, _ in run["together"]] == [text for text, _ in solo_outputs["solo"]]
    assert run["mean_batch"] > 1.5  # rounds of different requests shared the verifier's forwards


@pytest.mark.slow
def test_responses_are_not_held_back_by_nagle(base_url):
    """Without TCP_NODELAY on the gateway's connections each response body waits for the
    client's delayed ACK: ~40 ms per request instead of ~1."""
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        http.get("/v1/models")
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            http.get("/v1/models").raise_for_status()
            times.append(time.perf_counter() - t0)
    assert statistics.median(times) < 0.025, times


@pytest.mark.slow
def test_metrics_count_requests_tokens_and_drafts(oai, model, base_url):
    def scrape() -> dict[str, float]:
        text = httpx.get(f"{base_url}/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[s.name + json.dumps(s.labels, sort_keys=True)] = s.value
        return out

    before = scrape()
    # A seeded sampled request runs with a fixed γ (reproducible), so it drafts from its second round on.
    reply = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                        temperature=0.7, seed=3)
    with pytest.raises(openai.BadRequestError):  # refused by the services: no served request, as a gateway 400
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                    extra_body={"allowed_token_ids": [5], "stop_token_ids": [5], "min_tokens": 3})
    # lm-eval's scoring request: the token generated for the prompt's last logits is no answer's
    scored = oai.completions.create(model=model, prompt="Hi there", max_tokens=0, echo=True, logprobs=1)
    after = scrape()

    def delta(name: str, **labels) -> float:
        key = name + json.dumps(labels, sort_keys=True)
        return after.get(key, 0.0) - before.get(key, 0.0)

    # vLLM's names and model_name label: a vLLM dashboard reads them unchanged.
    labels = {"model_name": model, "endpoint": "/v1/chat/completions"}
    assert delta("specdec_gateway_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    for histogram in ("time_to_first_token", "e2e_request_latency", "time_per_output_token"):
        assert delta(f"vllm:{histogram}_seconds_count", **labels) == 1, histogram
    assert delta("vllm:inter_token_latency_seconds_count", **labels) == reply.usage.completion_tokens - 1
    assert delta("vllm:generation_tokens_total", **labels) == reply.usage.completion_tokens
    # the gateway froze its start-up heap (the collector no longer walks it) and times its collections
    assert after["specdec_gc_frozen_objects{}"] > 50_000
    assert after['specdec_gc_pause_seconds_count{"generation": "0"}'] > 0
    assert delta("vllm:prompt_tokens_total", **labels) == reply.usage.prompt_tokens
    assert delta("vllm:request_success_total", **labels, finished_reason="length") == 1
    # the per-request histograms of vLLM's dashboard: one observation each, lengths as in usage
    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(f"vllm:request_{phase}_time_seconds_count", **labels) == 1, phase
    assert delta("vllm:request_prompt_tokens_sum", **labels) == reply.usage.prompt_tokens
    assert delta("vllm:request_generation_tokens_sum", **labels) == reply.usage.completion_tokens
    spec = reply.model_extra["speculative"]
    assert delta("vllm:spec_decode_num_draft_tokens_total", **labels) == spec["num_draft_tokens"] > 0
    assert delta("vllm:spec_decode_num_accepted_tokens_total", **labels) == spec["num_accepted_tokens"]
    assert delta("vllm:spec_decode_num_drafts_total", **labels) == spec["num_speculative_rounds"]
    assert 0 < spec["num_speculative_rounds"] < spec["num_rounds"]  # the first round never drafts
    assert after.get("vllm:num_requests_running" + json.dumps({"model_name": model})) == 0
    scoring = {"model_name": model, "endpoint": "/v1/completions"}
    assert scored.usage.completion_tokens == 0 and delta("vllm:generation_tokens_total", **scoring) == 0
    assert delta("vllm:prompt_tokens_total", **scoring) == scored.usage.prompt_tokens
    assert delta("vllm:request_success_total", **scoring, finished_reason="length") == 1


def test_logprob_offsets_and_bytes_follow_characters_cut_between_tokens(oai, model, tokenizer):
    """Completions' text_offset point into the text, a token that holds part of a character at
    that character (the echoed prompt: 日 and 首 are 2 and 3 tokens); chat's `bytes` join to the
    reply's UTF-8."""
    prompt = "日本の首都は東京です"
    scored = oai.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    choice = scored.choices[0]
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    offsets = choice.logprobs.text_offset
    assert choice.text == prompt and len(offsets) == len(ids)
    assert offsets == sorted(offsets) and max(offsets) < len(prompt)  # decoded alone, they ran to len(ids) - 1
    for token_id, offset in zip(ids, offsets):
        piece = tokenizer.decode([token_id])
        if "\ufffd" not in piece:  # a token of whole characters sits where its text is
            assert prompt[offset : offset + len(piece)] == piece
    reply = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say 東京 in English."}],
                                        max_tokens=12, temperature=0, logprobs=True)
    content = reply.choices[0].logprobs.content
    joined, text = bytes(b for entry in content for b in entry.bytes), reply.choices[0].message.content.encode()
    # the whole reply; past it at most a character that max_tokens cut, which the reply does not show
    assert joined.startswith(text) and len(joined) - len(text) < 4


def test_models_retrieve_answers_a_served_name_and_404s_another(oai, model):
    """OpenAI's GET /v1/models/{id} (the SDK's models.retrieve), the card /v1/models lists."""
    card = oai.models.retrieve(model)
    assert card.model_dump() == oai.models.list().data[0].model_dump()
    # vLLM's ModelCard fields beyond OpenAI's: no LoRA parent, one permission entry
    extra = card.model_extra
    assert extra["parent"] is None and extra["max_model_len"] > 0
    assert [p["object"] for p in extra["permission"]] == ["model_permission"]
    assert extra["permission"][0]["allow_sampling"] and extra["permission"][0]["allow_logprobs"]
    with pytest.raises(openai.NotFoundError) as err:
        oai.models.retrieve("no-such-model")
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"


def test_the_callers_request_id_names_the_response_and_ping_answers_as_health(base_url, model):
    """vLLM's: an X-Request-Id header names the response (chatcmpl-<id>) and comes back as a
    header; without one, the body's request_id names it. /ping (GET or POST) is /health."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    chat = httpx.post(f"{base_url}/v1/chat/completions", headers={**auth, "X-Request-Id": "req-42"}, timeout=120,
                      json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert chat.json()["id"] == "chatcmpl-req-42" and chat.headers["x-request-id"] == "req-42"
    with httpx.stream("POST", f"{base_url}/v1/completions", headers={**auth, "X-Request-Id": "req-43"}, timeout=120,
                      json={"model": model, "prompt": "Hi", "max_tokens": 2, "stream": True}) as streamed:
        assert streamed.headers["x-request-id"] == "req-43"
        events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    assert events and {e["id"] for e in events} == {"cmpl-req-43"}
    body = httpx.post(f"{base_url}/v1/completions", headers=auth, timeout=120,
                      json={"model": model, "prompt": "Hi", "max_tokens": 2, "request_id": "mine-1"})
    assert body.json()["id"] == "cmpl-mine-1" and "x-request-id" not in body.headers
    plain = httpx.post(f"{base_url}/v1/completions", headers=auth, timeout=120,
                       json={"model": model, "prompt": "Hi", "max_tokens": 2})
    assert plain.json()["id"].startswith("cmpl-") and len(plain.json()["id"]) > 20  # a fresh uuid
    for method in ("GET", "POST"):
        ping = httpx.request(method, f"{base_url}/ping")
        assert ping.status_code == 200 and ping.json() == httpx.get(f"{base_url}/health").json()


@pytest.mark.slow
def test_every_served_name_is_answered_and_counted_as_the_first(verifier_proc, drafter_proc):
    """vLLM's aliases (--served-model-name alpha beta): each is listed and retrieved, a request
    may name either, and its response and metrics say the first (a request for beta answered
    "beta" and counted its tokens under beta, its running gauge under alpha)."""
    with start_gateway(verifier_proc.address, drafter_proc.address,
                       ["--served-model-name", "alpha", "beta", "--log-level", "WARNING"]) as gw, \
            openai.OpenAI(base_url=f"http://{gw.address}/v1", api_key="none", max_retries=0, timeout=120) as client:
        assert [m.id for m in client.models.list().data] == ["alpha", "beta"]
        assert client.models.retrieve("beta").id == "beta"
        reply = client.completions.create(model="beta", prompt="Hi", max_tokens=2, temperature=0)
        assert reply.model == "alpha"
        families = text_string_to_metric_families(httpx.get(f"http://{gw.address}/metrics").text)
        named = {s.labels["model_name"] for f in families for s in f.samples if "model_name" in s.labels}
        assert named == {"alpha"}


def test_an_explicit_null_max_tokens_runs_past_the_completions_default_of_16(base_url, model):
    """vLLM's completions: max_tokens absent is 16, an explicit null is up to the context (here a
    stop string ends it first)."""
    body = {"model": model, "prompt": "Counting: 1, 2, 3,", "temperature": 0, "stop": [" 25"]}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    default = httpx.post(f"{base_url}/v1/completions", json=body, headers=headers, timeout=120).json()
    unbounded = httpx.post(f"{base_url}/v1/completions", json={**body, "max_tokens": None}, headers=headers,
                           timeout=120).json()
    assert default["usage"]["completion_tokens"] == 16 and default["choices"][0]["finish_reason"] == "length"
    assert unbounded["choices"][0]["finish_reason"] == "stop"
    assert unbounded["usage"]["completion_tokens"] > 16
    assert unbounded["choices"][0]["text"].startswith(default["choices"][0]["text"])


# ---- the load harness through HTTP -------------------------------------------------------------


@pytest.fixture(scope="module")
def bench_results(base_url, verifier_proc, drafter_proc, tmp_path_factory) -> tuple:
    out = tmp_path_factory.mktemp("bench")
    common = ["--num-prompts", "2", "--max-tokens", "6", "--warmup-requests", "0", "--disable-tqdm"]
    assert main(["bench", "serve", "--drafter", drafter_proc.address, "--verifier", verifier_proc.address, *common,
                 "--result-json", str(out / "grpc.json")]) == 0
    assert main(["bench", "serve", "--backend", "openai", "--base-url", base_url, "--api-key", API_KEY, *common,
                 "--result-json", str(out / "gateway.json")]) == 0
    return out / "grpc.json", out / "gateway.json"


@pytest.mark.slow
def test_bench_serve_openai_backend_writes_the_same_json_keys_as_grpc(bench_results):
    grpc_res, http_res = (json.loads(p.read_text()) for p in bench_results)
    assert set(http_res) == set(grpc_res)
    assert set(http_res["per_category"]) == set(grpc_res["per_category"])
    for cat, metrics in http_res["per_category"].items():
        assert set(metrics) == set(grpc_res["per_category"][cat]), cat
    assert [set(r) for r in http_res["per_request"]] == [set(r) for r in grpc_res["per_request"]]
    assert (http_res["backend"], http_res["completed"], http_res["failed"]) == ("openai", 2, 0)
    # Same prompts, same chat template, greedy: the same token counts on both paths.
    assert http_res["total_input_tokens"] == grpc_res["total_input_tokens"] > 0
    assert http_res["total_output_tokens"] == grpc_res["total_output_tokens"] > 0
    # (acceptance may be None: with adaptive γ six tokens can pass before a first draft)
    assert http_res["median_ttft_ms"] > 0 and "acceptance_rate" in http_res
    # the gateway's counters carry the rounds that drafted: the same share as through gRPC's
    # counting (it read 0.0 through HTTP whatever the gateway did)
    spec_rounds = [r["speculative_rounds"] for r in http_res["per_request"]]
    assert http_res["speculative_round_share"] == pytest.approx(sum(spec_rounds) / http_res["total_rounds"])
    assert all(0 <= n <= r["rounds"] for n, r in zip(spec_rounds, http_res["per_request"]))


@pytest.mark.slow
def test_bench_compare_results_prints_both_runs_side_by_side(bench_results, capsys):
    assert main(["bench", "compare-results", *map(str, bench_results), "--labels", "grpc", "gateway"]) == 0
    table = capsys.readouterr().out
    assert "grpc" in table and "gateway" in table and "B / A" in table
    row = next(line for line in table.splitlines() if line.startswith("total input tokens"))
    assert row.split()[-1] == "1.00"
    assert "same workload" in table


# ---- stream assembly (no services) ---------------------------------------------------------------


def _stream_text(builder: ResponseBuilder, chunks: list[StreamChunk]) -> str:
    bodies = [b for c in chunks for b in builder.chunks(c)]
    return "".join(b["choices"][0]["text"] for b in bodies if b["choices"])


def test_a_stop_string_across_rounds_is_never_streamed(tokenizer):
    """One token a round, as the client's OutputProcessor settles them: the stop string ends
    in a later round than it begins, and no streamed chunk carries any of it."""
    ids = tokenizer("Hello world! More text", add_special_tokens=False).input_ids
    result = GenerationResult(text="", token_ids=[], prompt_token_ids=[0], finish_reason="length")
    output = OutputProcessor(tokenizer, SamplingParams(max_tokens=32, stop=["world!"]), (), result, 0.0)
    builder = ResponseBuilder(chat=False, model="m", prompt_tokens=1, decode=str)
    streamed = []
    for tok in ids:
        chunk = output.commit([tok], None, 0.0)
        streamed += [b["choices"][0]["text"] for b in builder.chunks(chunk) if b["choices"]]
        if chunk.result is not None:
            break
    assert "".join(streamed) == result.text == "Hello " and result.finish_reason == "stop"
    assert len(ids) > 3  # "world!" spans rounds: it is held back, then cut


def test_without_stop_strings_every_round_is_streamed_at_once():
    result = GenerationResult(text="ab cd", token_ids=[1, 2], prompt_token_ids=[0], finish_reason="length")
    builder = ResponseBuilder(chat=False, model="m", prompt_tokens=1, decode=str)
    first = builder.chunks(StreamChunk([1], "ab"))
    assert [b["choices"][0]["text"] for b in first] == ["ab"]
    assert _stream_text(builder, [StreamChunk([2], " cd", result=result)]) == " cd"


def test_concurrent_encodings_get_their_own_tokenizer_copy_and_reuse_it(tokenizer):
    """The gateway tokenizes on worker threads, each encoding with a copy of its own (a fast
    tokenizer shared by threads can fail, and a long prompt would hold up the rest); copies
    are reused, and a new client (after a redeploy) gets copies of its own tokenizer."""
    import threading
    import types

    from gateway.upstream import _TokenizerCopies

    copies = _TokenizerCopies()
    client = types.SimpleNamespace(tokenizer=tokenizer)
    first, second = copies.take(client), copies.take(client)
    assert first is not second and tokenizer not in (first, second)
    assert first("a b", add_special_tokens=False).input_ids == tokenizer("a b", add_special_tokens=False).input_ids
    copies.give_back(client, first)
    assert copies.take(client) is first  # reused, not copied again
    errors = []

    def encode(i: int) -> None:
        for _ in range(50):
            tok = copies.take(client)
            try:
                if tok("x y %d" % i, add_special_tokens=False).input_ids != tokenizer("x y %d" % i,
                                                                                       add_special_tokens=False).input_ids:
                    errors.append(i)
            finally:
                copies.give_back(client, tok)

    threads = [threading.Thread(target=encode, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    spike = [copies.take(client) for _ in range(3 * copies.MAX_IDLE)]  # a burst of concurrent encodings
    for tok in spike:
        copies.give_back(client, tok)
    assert len(copies._idle) == copies.MAX_IDLE  # the burst's copies are not all kept for good
    other = types.SimpleNamespace(tokenizer=tokenizer)
    assert copies.take(other) is not first  # a new client's copies start afresh
