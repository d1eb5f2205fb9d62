"""Prompt tokenization through the gateway, as vLLM's server does it: a text prompt gets the
tokenizer's own special tokens (a BOS for Llama, Mistral or Gemma tokenizers), a chat gets its
template's alone, `add_special_tokens` overrides either, and /tokenize + /detokenize answer the
ids a request would send; a prompt near the context without max_tokens gets the room left. A tiny random Llama whose tokenizer prepends a BOS (the embedded
SmolLM2 tokenizer adds none, so it cannot tell the two apart), a real verifier and gateway
process with an API key, the official `openai` package."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest

from client.launcher import start_service
from tests.conftest import SERVICE_THREADS

KEY = "tokenize-test-key"
MAX_MODEL_LEN = 256  # prompts that reach the context cost milliseconds on the tiny model
BOS = "<|im_start|>"  # id 1 in the embedded vocabulary


def _prepend_bos(tokenizer_json) -> None:
    """A TemplateProcessing post-processor that puts BOS before every sequence, as Llama's."""
    spec = json.loads(tokenizer_json.read_text())
    bos = {"SpecialToken": {"id": BOS, "type_id": 0}}
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {BOS: {"id": BOS, "ids": [1], "tokens": [BOS]}},
    }
    tokenizer_json.write_text(json.dumps(spec))


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("bos-model")
    subprocess.run([sys.executable, "-m", "cli", "random-model", "--preset", "tiny", "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    _prepend_bos(out / "tokenizer.json")
    template = out / "chat_template.jinja"  # a tools block, as tool-aware templates (Qwen, Llama 3.1) have,
    template.write_text("{%- if tools %}{{ '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}"
                        "{%- endif %}"  # and a documents block, as RAG templates (Command-R, Granite) have
                        "{%- if documents %}{%- for d in documents %}{{ '<|im_start|>document\\n' + d['text'] + "
                        "'<|im_end|>\\n' }}{%- endfor %}{%- endif %}" + template.read_text())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    plain = tokenizer("Hello world", add_special_tokens=False).input_ids
    assert tokenizer("Hello world").input_ids == [1, *plain]  # the fixture is what it claims
    return out, tokenizer


@pytest.fixture(scope="module")
def gateway(bos_model):
    model, _ = bos_model
    with start_service("verifier", ["--model", str(model), "--max-model-len", str(MAX_MODEL_LEN), "--log-level",
                                    "WARNING"], threads=SERVICE_THREADS) as v:
        with start_service("gateway", ["--verifier", v.address, "--api-key", KEY, "--log-level", "WARNING"]) as gw:
            yield f"http://{gw.address}"


@pytest.fixture(scope="module")
def oai(gateway):
    with openai.OpenAI(base_url=f"{gateway}/v1", api_key=KEY, max_retries=0, timeout=120) as client:
        yield client


def _post(gateway: str, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{gateway}{path}", json=body, headers=headers, timeout=60)


def test_a_text_prompt_gets_the_tokenizers_bos_unless_add_special_tokens_is_false(gateway, oai, bos_model):
    _, tokenizer = bos_model
    plain = tokenizer("Hello world", add_special_tokens=False).input_ids
    default = oai.completions.create(model="", prompt="Hello world", max_tokens=1, temperature=0)
    without = oai.completions.create(model="", prompt="Hello world", max_tokens=1, temperature=0,
                                     extra_body={"add_special_tokens": False})
    assert default.usage.prompt_tokens == len(plain) + 1 and without.usage.prompt_tokens == len(plain)
    tokenized = _post(gateway, "/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()
    assert tokenized["tokens"] == [1, *plain] and tokenized["count"] == len(plain) + 1
    assert tokenized["token_strs"][0] == BOS and tokenized["max_model_len"] > 0
    bare = _post(gateway, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False}).json()
    assert bare["tokens"] == plain and "token_strs" not in bare


def test_a_chat_gets_its_templates_tokens_and_tokenize_counts_what_the_request_sends(gateway, oai, bos_model):
    _, tokenizer = bos_model
    messages = [{"role": "user", "content": "Hi there"}]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    reply = oai.chat.completions.create(model="", messages=messages, max_tokens=1, temperature=0)
    tokenized = _post(gateway, "/tokenize", {"messages": messages}).json()
    assert tokenized["tokens"] == expected and reply.usage.prompt_tokens == len(expected)
    doubled = _post(gateway, "/tokenize", {"messages": messages, "add_special_tokens": True}).json()
    assert doubled["tokens"] == [1, *expected]  # the template's text, then the tokenizer's BOS in front
    with_bos = oai.chat.completions.create(model="", messages=messages, max_tokens=1, temperature=0,
                                           extra_body={"add_special_tokens": True})
    assert with_bos.usage.prompt_tokens == len(expected) + 1


def test_detokenize_inverts_tokenize_and_bad_input_is_a_400_naming_the_field(gateway):
    ids = _post(gateway, "/tokenize", {"prompt": "The quick brown fox", "add_special_tokens": False}).json()["tokens"]
    assert _post(gateway, "/detokenize", {"tokens": ids}).json() == {"prompt": "The quick brown fox"}
    # a field these endpoints lack is ignored, as vLLM's and our completion endpoints do (a 400 before)
    assert _post(gateway, "/tokenize", {"prompt": "The quick brown fox", "add_special_tokens": False,
                                        "unknown_field": 1}).json()["tokens"] == ids
    assert _post(gateway, "/detokenize", {"tokens": ids, "unknown_field": 1}).status_code == 200
    cases = [("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
             ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
             ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
             ("/tokenize", {}, 400, "prompt"),
             ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, 400, "prompt"),
             ("/tokenize", {"prompt": "x", "model": "another-model"}, 404, "model")]
    for path, body, status, param in cases:
        got = _post(gateway, path, body)
        assert got.status_code == status and got.json()["error"]["param"] == param, (path, body, got.text)


def test_tokenize_and_detokenize_need_the_api_key_as_the_v1_routes(gateway):
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]})):
        assert _post(gateway, path, body, key=None).status_code == 401
        assert _post(gateway, path, body, key="wrong").status_code == 401
        assert _post(gateway, path, body).status_code == 200


def test_a_messages_text_parts_are_joined_by_newlines_as_vllm_does(gateway):
    parts = [{"type": "text", "text": "Translate to French:"}, {"type": "text", "text": "Good morning"}]
    as_parts = _post(gateway, "/tokenize", {"messages": [{"role": "user", "content": parts}]}).json()
    as_text = _post(gateway, "/tokenize", {"messages": [{"role": "user",
                                                         "content": "Translate to French:\nGood morning"}]}).json()
    assert as_parts["tokens"] == as_text["tokens"] and as_parts["count"] > 0


def test_the_model_id_is_the_verifiers_model_without_its_runtime_tag(gateway, oai, bos_model):
    """Without --served-model-name the id is the verifier's --model as given, not the runtime
    tag it reports ("[float32+onednn]"), so a restart with other flags keeps it; the tagged
    name still works."""
    model, _ = bos_model
    listed = oai.models.list().data
    assert [m.id for m in listed] == [str(model)] and listed[0].root.startswith(f"{model}[")
    for name in (str(model), listed[0].root):
        assert oai.completions.create(model=name, prompt="Hello", max_tokens=1).model == str(model)
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model=f"{model}-other", prompt="Hello", max_tokens=1)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def test_tools_with_tool_choice_none_are_rendered_into_the_prompt_as_vllm_does(gateway, oai):
    """vLLM renders `tools` through the chat template when tool_choice is "none"; tools alone
    default tool_choice to "auto", which needs a tool-call parser: a 400 naming tool_choice."""
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    plain = _post(gateway, "/tokenize", {"messages": messages}).json()
    with_tools = _post(gateway, "/tokenize", {"messages": messages, "tools": TOOLS}).json()
    assert with_tools["count"] > plain["count"] + 10  # the tool's JSON schema is in the prompt
    reply = oai.chat.completions.create(model="", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=2)
    assert reply.usage.prompt_tokens == with_tools["count"] and reply.choices[0].message.tool_calls is None
    for choice in ({}, {"tool_choice": "auto"}, {"tool_choice": "required"}):
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model="", messages=messages, tools=TOOLS, max_tokens=2, **choice)
        assert err.value.body["param"] == "tool_choice"


def test_documents_are_rendered_by_the_chat_template_as_vllm_does(gateway, oai, bos_model):
    """vLLM's `documents` (RAG templates) reach the chat template; they were dropped with a log
    line, and the reply ignored them."""
    _, tokenizer = bos_model
    messages = [{"role": "user", "content": "What is the capital?"}]
    documents = [{"title": "France", "text": "Paris is the capital of France."}]
    with_docs = _post(gateway, "/tokenize", {"messages": messages, "documents": documents}).json()
    expected = tokenizer.apply_chat_template(messages, documents=documents, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "input_ids") else expected
    assert with_docs["tokens"] == list(expected)
    assert with_docs["count"] > _post(gateway, "/tokenize", {"messages": messages}).json()["count"] + 5
    reply = oai.chat.completions.create(model="", messages=messages, max_tokens=1,
                                        extra_body={"documents": documents})
    assert reply.usage.prompt_tokens == with_docs["count"]


def test_a_prompt_that_fits_without_max_tokens_gets_the_room_left_not_an_error(oai):
    """An unset max_tokens is the default (16 for completions) only where it fits: a prompt 4
    tokens short of the context gets those 4, as vLLM clamps it; a chat gets all the room left."""
    max_context = oai.models.list().data[0].model_extra["max_model_len"]
    assert max_context == MAX_MODEL_LEN
    out = oai.completions.create(model="", prompt=[1] + [28] * (max_context - 5), temperature=0,
                                 extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "length"
    short = oai.completions.create(model="", prompt=[1, 28, 28], temperature=0, extra_body={"ignore_eos": True})
    assert short.usage.completion_tokens == 16  # the completions default where it fits
    chat = oai.chat.completions.create(model="", messages=[{"role": "user", "content": "word " * 150}],
                                       temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == max_context
    assert chat.choices[0].finish_reason == "length"
