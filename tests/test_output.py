"""The client's output processor: stop conditions and incremental text, round by round,
with the embedded model's real tokenizer (no services: this is the client's own logic)."""

from __future__ import annotations

import pytest

from client.output import GenerationResult, OutputProcessor
from specdec.models import ModelSpec, load_tokenizer
from specdec.sampling import SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelSpec())


def _processor(tokenizer, **params) -> OutputProcessor:
    params = SamplingParams(**params)
    result = GenerationResult(text="", token_ids=[], prompt_token_ids=[1], finish_reason="length",
                              logprobs=[] if params.logprobs is not None else None)
    return OutputProcessor(tokenizer, params, [tokenizer.eos_token_id], result, t0=0.0)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def _rounds(out: OutputProcessor, rounds: list[list[int]]) -> list:
    chunks = []
    for i, ids in enumerate(rounds):
        chunks.append(out.commit(ids, None, now=float(i + 1)))
        if out.finished:
            break
    return chunks


def test_a_stop_string_split_across_rounds_never_streams(tokenizer):
    ids = _ids(tokenizer, " Hello world. STOP here")
    out = _processor(tokenizer, max_tokens=50, stop=[" STOP"])
    # " STOP" is one token here; split the text so the stop's first characters come a round early.
    chunks = _rounds(out, [[i] for i in ids])
    streamed = "".join(c.text for c in chunks)
    assert out.finished and out.result.finish_reason == "stop" and out.result.stop_reason == " STOP"
    assert out.result.text == " Hello world." == streamed
    assert "STOP" not in streamed and chunks[-1].result is out.result


def test_a_stop_string_inside_one_round_cuts_the_text_there(tokenizer):
    out = _processor(tokenizer, max_tokens=50, stop=["world"])
    chunk = out.commit(_ids(tokenizer, " Hello world. STOP here"), None, now=1.0)
    assert out.finished and chunk.text == " Hello " == out.result.text


@pytest.mark.parametrize("stop, min_tokens", [([" 8"], 0), ([",", " 8"], 0), ([" 7, 8"], 0), (["8,"], 0),
                                              ([","], 5), ([", 8", " 1"], 5), ([" 7, 8, 9"], 8), ([", 1"], 9)])
def test_a_stop_string_ends_at_the_token_that_completes_it_whatever_the_round_size(tokenizer, stop, min_tokens):
    """Token ids, their logprobs and the text do not depend on how many tokens a round
    verified: a round of 9 ends where rounds of one token each end (the tokens after the one
    that completes the stop string are dropped). With min_tokens, a stop string counts when a
    token past the min_tokens-th completes it (vLLM V1), in rounds of any size."""
    ids = _ids(tokenizer, " 6, 7, 8, 9, 10, 11, 12")
    runs = []
    for size in (1, 2, 3, 9, len(ids)):
        for include in (False, True):  # include_stop_str_in_output: the text goes on to the stop string's end
            out = _processor(tokenizer, max_tokens=50, stop=stop, min_tokens=min_tokens, logprobs=0,
                             include_stop_str_in_output=include)
            chunks = []
            for i in range(0, len(ids), size):
                chunks.append(out.commit(ids[i:i + size], [{"logprob": -float(j)} for j in range(i, i + size)], 1.0))
                if out.finished:
                    break
            assert out.finished and out.result.finish_reason == "stop" and out.result.stop_reason in stop
            assert sum((c.token_ids for c in chunks), []) == out.result.token_ids
            assert "".join(c.text for c in chunks) == out.result.text
            assert [e["logprob"] for e in out.result.logprobs] == [-float(j) for j in range(len(out.result.token_ids))]
            text = out.result.text
            if include:
                assert text.endswith(out.result.stop_reason)
                text = text[:-len(out.result.stop_reason)]
            runs.append((out.result.token_ids, text, len(out.result.token_times_s), out.result.stop_reason))
    assert all(run == runs[0] for run in runs), runs
    kept = len(runs[0][0])
    assert kept < len(ids) and runs[0][2] == kept
    if min_tokens:
        assert kept > min_tokens
    else:
        assert runs[0][3] not in runs[0][1]  # the first occurrence stopped it


def test_a_stop_string_ending_in_the_min_tokens_th_token_does_not_count(tokenizer):
    """vLLM V1 (vllm#22014): stop strings are searched only in the text of tokens after the
    first min_tokens; one that the min_tokens-th token completes does not end the generation,
    one that the next completes does, whatever the rounds."""
    ids = _ids(tokenizer, " 6, 7, 8, 9, 10, 11, 12")
    k = ids.index(_ids(tokenizer, " 6, 7, 8")[-1]) + 1  # " 8" is token k
    for size in (1, 3, len(ids)):
        kept = _processor(tokenizer, max_tokens=len(ids), stop=[" 8"], min_tokens=k)
        _rounds(kept, [ids[i:i + size] for i in range(0, len(ids), size)])
        assert kept.result.finish_reason == "length" and kept.result.token_ids == ids, size
        ended = _processor(tokenizer, max_tokens=len(ids), stop=[" 8"], min_tokens=k - 1)
        _rounds(ended, [ids[i:i + size] for i in range(0, len(ids), size)])
        assert ended.result.finish_reason == "stop" and ended.result.token_ids == ids[:k], size


def test_max_tokens_drops_the_rest_of_a_round(tokenizer):
    ids = _ids(tokenizer, " one two three four five six")
    out = _processor(tokenizer, max_tokens=4)
    first = out.commit(ids[:3], None, now=1.0)
    last = out.commit(ids[3:], None, now=2.0)
    assert first.token_ids == ids[:3] and last.token_ids == ids[3:4]
    assert out.result.token_ids == ids[:4] and out.result.finish_reason == "length"
    assert out.result.token_times_s == [1.0, 1.0, 1.0, 2.0] and out.result.ttft_s == 1.0


def test_eos_ends_a_round_unless_before_min_tokens_or_ignored(tokenizer):
    eos = tokenizer.eos_token_id
    word = _ids(tokenizer, " word")[0]
    stops = _processor(tokenizer, max_tokens=10)
    assert stops.commit([word, eos, word], None, now=1.0).token_ids == [word, eos]
    assert stops.finished and stops.result.finish_reason == "stop" and stops.result.stop_reason is None  # as vLLM

    early = _processor(tokenizer, max_tokens=10, min_tokens=3)
    assert early.commit([word, eos, word], None, now=1.0).token_ids == [word, eos, word]
    assert not early.finished

    ignored = _processor(tokenizer, max_tokens=3, ignore_eos=True)
    ignored.commit([eos, eos, eos], None, now=1.0)
    assert ignored.result.finish_reason == "length" and ignored.result.stop_reason is None


def test_a_stop_token_id_ends_the_generation_without_its_text_unless_asked(tokenizer):
    """As vLLM v1's detokenizer: the stop token id is in token_ids, its text only with
    include_stop_str_in_output (it was always in the text)."""
    ids = _ids(tokenizer, " a b c d")
    for include, text in ((False, " a b"), (True, " a b c")):
        out = _processor(tokenizer, max_tokens=10, stop_token_ids=[ids[2]], include_stop_str_in_output=include)
        chunks = _rounds(out, [ids[:2], ids[2:]])
        assert chunks[-1].token_ids == ids[2:3] and out.result.token_ids == ids[:3]
        assert out.result.finish_reason == "stop" and out.result.stop_reason == ids[2]
        assert out.result.text == text == "".join(c.text for c in chunks)


def test_a_stop_string_completed_past_min_tokens_counts_inside_a_multibyte_character(tokenizer):
    """The first min_tokens tokens end inside an emoji: the floor a stop string must end past
    was the length of their text *with* U+FFFD for the partial bytes, which put it past the
    emoji that token min_tokens + 1 completes, so that stop was skipped."""
    ids = _ids(tokenizer, "🍕🍕🍕🍕")
    per = len(_ids(tokenizer, "🍕"))
    assert per > 1 and len(ids) == 4 * per  # several byte tokens per emoji
    for min_tokens in range(per, 2 * per):  # the second emoji is completed by token 2·per
        out = _processor(tokenizer, max_tokens=50, stop=["🍕"], min_tokens=min_tokens, include_stop_str_in_output=True)
        _rounds(out, [[i] for i in ids])
        assert out.result.text == "🍕🍕" and len(out.result.token_ids) == 2 * per, min_tokens


def test_the_stop_string_reported_is_the_one_that_ended_the_generation(tokenizer):
    """Two stop strings at one index, the shorter complete before min_tokens: the longer one
    ends the generation, in either order of the list (the first listed was reported, and kept)."""
    ids = _ids(tokenizer, " The answer is")
    first = len(_ids(tokenizer, " The"))
    for stops in ([" The", " The answer"], [" The answer", " The"]):
        for include in (False, True):
            out = _processor(tokenizer, max_tokens=50, stop=stops, min_tokens=first,
                             include_stop_str_in_output=include)
            _rounds(out, [[i] for i in ids])
            assert out.result.stop_reason == " The answer", stops
            assert out.result.text == (" The answer" if include else "")


def test_a_character_cut_by_max_tokens_is_not_shown(tokenizer):
    ids = _ids(tokenizer, "ok 🍕")
    out = _processor(tokenizer, max_tokens=len(ids) - 1)
    chunks = _rounds(out, [[i] for i in ids])
    assert out.result.finish_reason == "length" and out.result.text == "ok " == "".join(c.text for c in chunks)


def test_invalid_bytes_just_before_a_stop_string_are_kept_as_the_tokenizer_decodes_them(tokenizer):
    """An emoji's first byte token, then "STOP": those bytes are no character and nothing can
    complete them. The stop string's cut left them at the end of the text, where the strip of
    an incomplete character (meant for a max_tokens cut) removed them: text no longer matched
    token_ids' decoding."""
    ids = _ids(tokenizer, "🍕")[:1] + _ids(tokenizer, "STOP now")
    assert tokenizer.decode(ids).startswith("\ufffdSTOP")
    out = _processor(tokenizer, max_tokens=50, stop=["STOP"])
    chunks = _rounds(out, [[i] for i in ids])
    assert out.result.finish_reason == "stop" and out.result.text == "\ufffd" == "".join(c.text for c in chunks)


def test_an_incomplete_utf8_character_is_held_until_complete(tokenizer):
    ids = _ids(tokenizer, "🦙 llama")
    out = _processor(tokenizer, max_tokens=len(ids))
    chunks = _rounds(out, [[i] for i in ids])
    assert all("\ufffd" not in c.text for c in chunks)
    assert chunks[0].text == ""  # the first byte token alone is not a character yet
    assert "".join(c.text for c in chunks) == "🦙 llama" == out.result.text


def test_logprobs_are_kept_for_committed_tokens_only(tokenizer):
    ids = _ids(tokenizer, " one two three")
    out = _processor(tokenizer, max_tokens=2, logprobs=1)
    entries = [{"token_id": t, "logprob": -0.5, "rank": 1, "top_logprobs": {t: -0.5}} for t in ids]
    chunk = out.commit(ids, entries, now=1.0)
    assert chunk.logprobs == entries[:2] == out.result.logprobs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_incremental_detokenization_streams_exactly_the_text_of_the_whole_sequence(tokenizer, seed):
    """Rounds of 1-5 random tokens (byte tokens that split UTF-8 characters included, and
    special tokens): the chunks concatenate to the full sequence's decode, and every round's
    text so far is a prefix of it (nothing streamed is ever taken back)."""
    import random

    rng = random.Random(seed)
    vocab = len(tokenizer)
    ids = [rng.randrange(vocab) for _ in range(300)]
    ids += _ids(tokenizer, " ünïcödé 日本語 🙂 done")  # multi-byte characters over several tokens
    out = _processor(tokenizer, max_tokens=len(ids), ignore_eos=True)
    rounds, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 5)
        rounds.append(ids[i:i + n])
        i += n
    chunks = _rounds(out, rounds)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    streamed = ""
    for chunk in chunks:
        streamed += chunk.text
        assert full.startswith(streamed)
    assert out.finished and streamed == full == out.result.text


@pytest.mark.parametrize("ignore_eos,reason", [(False, None), (True, "the id")])
def test_eos_listed_in_stop_token_ids_ends_as_eos_unless_eos_is_ignored(tokenizer, ignore_eos, reason):
    """vLLM's check_stop tests EOS first: stop_reason None for it even when stop_token_ids
    lists it; with ignore_eos only the stop token id ends the generation, and names it."""
    eos = tokenizer.eos_token_id
    out = _processor(tokenizer, max_tokens=50, stop_token_ids=[eos], ignore_eos=ignore_eos)
    _rounds(out, [_ids(tokenizer, " Hello"), [eos]])
    assert out.finished and out.result.finish_reason == "stop"
    assert out.result.stop_reason == (eos if reason == "the id" else None)


def test_token_bytes_rebuild_text_whose_characters_span_tokens(tokenizer):
    """OpenAI's logprobs `bytes`: joined, a generation's tokens give its UTF-8, characters cut
    between tokens included (decoded alone such a token is U+FFFD, whose bytes are not its own)."""
    from client.output import TokenBytes

    token_bytes = TokenBytes(tokenizer)
    for text in ["日本の首都は東京です", "émigré café 🎉 naïve", " spaces  and\ttabs\n", "plain ASCII"]:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert b"".join(token_bytes(t) for t in ids) == text.encode("utf-8"), text
    cut = [t for t in tokenizer("日本", add_special_tokens=False).input_ids if "\ufffd" in tokenizer.decode([t])]
    assert cut and all(token_bytes(t) != "\ufffd".encode() for t in cut)  # the case this is for
