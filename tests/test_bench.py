"""`specdec bench`: workload, metrics and outputs, against the real services on loopback."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from scipy import stats

from bench.datasets import CATEGORIES, CUSTOM, SHAREGPT, RandomDataset, load_dataset, load_shipped
from bench.serve import (
    LATENCY_METRICS,
    accepted_per_round,
    RequestRecord,
    compute_metrics,
    efficiency,
    expected_tokens_per_round,
    inter_arrival_times,
    server_stats,
)
from cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _bench(*args: str) -> int:
    return main(["bench", *args, "--disable-tqdm"])


def _servers(drafter_proc, verifier_proc) -> list[str]:
    return ["--drafter", drafter_proc.address, "--verifier", verifier_proc.address]


@pytest.mark.slow
def test_serve_writes_json_whose_counts_add_up_and_percentiles_are_ordered(drafter_proc, verifier_proc, tmp_path,
                                                                          capsys):
    out = tmp_path / "serve.json"
    rc = _bench("serve", *_servers(drafter_proc, verifier_proc), "--num-prompts", "7", "--max-tokens", "8",
                "--num-speculative-tokens", "4", "--max-concurrency", "2", "--request-rate", "20",
                "--goodput", "e2el:60000", "--result-json", str(out),
                "--metric-percentiles", "50,99.9", "--percentile-metrics", "ttft,e2el")  # vLLM's flags
    assert rc == 0
    res = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "P50 TTFT (ms):" in printed and "P99.9 E2EL (ms):" in printed and "TPOT (ms)" not in printed
    for name in LATENCY_METRICS:  # every latency has the extra percentiles in the JSON, and vLLM's std
        assert res[f"p50_{name}_ms"] <= res[f"p99.9_{name}_ms"] and res[f"std_{name}_ms"] >= 0, name
    assert res["metric_percentiles"] == [50.0, 90.0, 99.0, 99.9] and res["request_goodput"] == res["goodput"]
    done = [r for r in res["per_request"] if r["error"] is None]
    assert res["num_prompts"] == 7 and res["completed"] + res["failed"] == 7
    assert res["failed"] == 0, [r["error"] for r in res["per_request"]]
    assert res["total_output_tokens"] == sum(r["output_tokens"] for r in done) > 0
    assert res["total_input_tokens"] == sum(r["input_tokens"] for r in done)
    for name in LATENCY_METRICS:
        assert res[f"median_{name}_ms"] <= res[f"p90_{name}_ms"] <= res[f"p99_{name}_ms"], name
    assert res["mean_e2el_ms"] == pytest.approx(1000 * np.mean([r["e2el"] for r in done]))
    # vLLM's per-request arrays, in seconds, for scripts that read `vllm bench serve` results
    assert res["ttfts"] == [r["ttft"] for r in res["per_request"]] and res["errors"] == [""] * 7
    assert res["output_lens"] == [r["output_tokens"] for r in done] and len(res["input_lens"]) == 7
    assert res["mean_itl_ms"] == pytest.approx(1000 * np.mean([gap for gaps in res["itls"] for gap in gaps]))
    assert 0.0 <= res["acceptance_rate"] <= 1.0
    assert res["goodput"] == pytest.approx(res["request_throughput"])  # every request meets a 60 s SLO
    # 7 prompts interleave the 7 categories: one each, and the categories add up to the total.
    assert set(res["per_category"]) == {r["category"] for r in res["per_request"]} == set(CATEGORIES)
    assert sum(m["total_output_tokens"] for m in res["per_category"].values()) == res["total_output_tokens"]
    for metrics in res["per_category"].values():
        assert metrics["completed"] == 1 and metrics["median_ttft_ms"] > 0
    assert res["system_efficiency"] is None  # no target-only baseline given


def test_random_dataset_draws_vllms_lengths_reproducibly():
    spec = RandomDataset(input_len=40, output_len=10, range_ratio=0.5, prefix_len=5)
    prompts = spec.prompts(200, vocab_size=300, seed=3)
    assert prompts == spec.prompts(200, vocab_size=300, seed=3) != spec.prompts(200, vocab_size=300, seed=4)
    inputs = [len(p.token_ids) - 5 for p in prompts]
    assert set(inputs) <= set(range(20, 61)) and len(set(inputs)) >= 35  # uniform on [40·0.5, 40·1.5]
    assert {p.max_tokens for p in prompts} == set(range(5, 16))
    assert len({p.token_ids[:5] for p in prompts}) == 1 and len({p.token_ids[5:] for p in prompts}) == 200
    assert all(0 <= t < 300 for p in prompts for t in p.token_ids) and spec.longest() == 5 + 60 + 15
    for bad in ({"range_ratio": 1.0}, {"input_len": 0}, {"prefix_len": -1}):
        with pytest.raises(ValueError):
            RandomDataset(**bad)


@pytest.mark.slow
def test_random_dataset_sends_ids_with_their_own_output_lengths(drafter_proc, verifier_proc, tmp_path):
    out = tmp_path / "random.json"
    assert _bench("serve", *_servers(drafter_proc, verifier_proc), "--dataset", "random", "--random-input-len", "24",
                  "--random-output-len", "6", "--random-range-ratio", "0.5", "--random-prefix-len", "4",
                  "--num-prompts", "4", "--ignore-eos", "--warmup-requests", "0", "--result-json", str(out)) == 0
    res = json.loads(out.read_text())
    expected = RandomDataset(24, 6, 0.5, 4).prompts(4, vocab_size=10**9, seed=0)  # (lengths only: vocab differs)
    assert [r["input_tokens"] for r in res["per_request"]] == [len(p.token_ids) for p in expected]
    assert [r["output_tokens"] for r in res["per_request"]] == [p.max_tokens for p in expected]
    assert res["random_dataset"] == {"input_len": 24, "output_len": 6, "range_ratio": 0.5, "prefix_len": 4}
    assert res["chat"] is False and res["failed"] == 0


@pytest.mark.slow
def test_target_only_never_calls_the_drafter_but_speculative_does(drafter_proc, verifier_proc, tmp_path):
    common = [*_servers(drafter_proc, verifier_proc), "--num-prompts", "2", "--max-tokens", "6",
              "--warmup-requests", "0"]
    before = server_stats(drafter_proc.address, "drafter")
    assert _bench("serve", *common, "--target-only", "--result-json", str(tmp_path / "base.json")) == 0
    after_target_only = server_stats(drafter_proc.address, "drafter")
    assert _bench("serve", *common, "--baseline-json", str(tmp_path / "base.json"), "--num-speculative-tokens", "4",
                  "--result-json", str(tmp_path / "spec.json")) == 0
    after_speculative = server_stats(drafter_proc.address, "drafter")

    assert after_target_only["requests"] == before["requests"]
    assert after_target_only["draft_tokens"] == before["draft_tokens"]
    assert after_speculative["requests"] > after_target_only["requests"]
    base = json.loads((tmp_path / "base.json").read_text())
    spec = json.loads((tmp_path / "spec.json").read_text())
    assert "drafter" not in base["server_stats"] and base["server_stats"]["verifier"]["delta"]["requests"] > 0
    assert spec["server_stats"]["drafter"]["delta"]["draft_tokens"] == spec["total_draft_tokens"] > 0
    assert spec["system_efficiency"] is not None  # the baseline makes it computable
    # the client's verdict on where the engines compute: both on this host's CPUs, so drafts take
    # turns with verifies (shares_device); a target-only run has no drafter to judge
    assert spec["shared_device"] is True and base["shared_device"] is None
    # A baseline of another workload is refused before the run: nothing sent, nothing written
    # (it was refused after the run, its meaningless speedup printed and written first).
    other = [a if a != "6" else "7" for a in common]  # --max-tokens 7
    assert _bench("serve", *other, "--baseline-json", str(tmp_path / "base.json"), "--num-speculative-tokens", "4",
                  "--result-json", str(tmp_path / "other.json")) == 2
    # Arrivals of another shape, too (burstiness was not compared: a baseline of 5 stood for 0.5)
    assert _bench("serve", *common, "--burstiness", "0.5", "--baseline-json", str(tmp_path / "base.json"),
                  "--num-speculative-tokens", "4", "--result-json", str(tmp_path / "other.json")) == 2
    assert server_stats(drafter_proc.address, "drafter")["requests"] == after_speculative["requests"]
    assert not (tmp_path / "other.json").exists()


def test_poisson_inter_arrivals_match_the_requested_rate():
    # H0: the gaps are Exponential(rate). n = 4000, fixed seed.
    rate = 3.0
    gaps = inter_arrival_times(4000, rate, seed=1234)
    assert stats.kstest(gaps, "expon", args=(0, 1 / rate)).pvalue > 0.001
    # Power: the same samples reject a rate 1.5x off.
    assert stats.kstest(gaps, "expon", args=(0, 1 / (1.5 * rate))).pvalue < 0.001


def test_infinite_request_rate_sends_everything_at_once():
    assert not inter_arrival_times(50, float("inf"), seed=0).any()


def test_shipped_dataset_has_120_prompts_covering_all_seven_categories():
    prompts = load_shipped()
    counts = {cat: sum(p.category == cat for p in prompts) for cat in CATEGORIES}
    assert len(prompts) >= 120
    assert min(counts.values()) >= 15, counts  # roughly equal
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(len(p.messages) >= 3 for p in prompts if p.category == "multi_turn")


def test_sharegpt_file_loads_the_first_human_turn(tmp_path):
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "Hello there?"}, {"from": "gpt", "value": "Hi."},
                                      {"from": "human", "value": "second turn"}]},
        {"id": "b", "conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "Why?"}]},
        {"id": "c", "conversations": [{"from": "gpt", "value": "no human turn"}]},
        {"id": "d", "conversations": [{"from": "user", "value": "As some exports write it"},
                                      {"from": "assistant", "value": "ok"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    prompts = load_dataset(str(path))
    assert [p.messages for p in prompts] == [("Hello there?",), ("Why?",), ("As some exports write it",)]
    assert {p.category for p in prompts} == {SHAREGPT}


def test_a_jsonl_file_of_prompts_loads_as_vllms_custom_dataset_and_bad_files_are_named(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "Hello there?"}\n\n{"prompt": "Why?", "category": "qa", "output_tokens": 9}\n')
    prompts = load_dataset(str(path))
    assert [(p.messages, p.category) for p in prompts] == [(("Hello there?",), CUSTOM), (("Why?",), "qa")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: .*'prompt'"):
        load_dataset(str(bad))
    lines = tmp_path / "lines.json"  # JSON lines under a .json name: say what is wrong, and where
    lines.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    with pytest.raises(ValueError, match="lines.json: not a JSON file.*jsonl"):
        load_dataset(str(lines))
    odd = tmp_path / "odd.json"  # turns that are not objects are skipped, not a crash
    odd.write_text(json.dumps([{"conversations": ["text"]}, {"conversations": [{"from": "human", "value": "Hi"}]}]))
    assert [p.messages for p in load_dataset(str(odd))] == [("Hi",)]


def test_metrics_follow_vllm_definitions():
    # Two requests: 5 tokens in 3 chunks, and 1 token in 1 chunk; 1 failed.
    a = RequestRecord(0, "qa", "x", input_tokens=10, output_tokens=5, ttft=0.1, e2el=0.5, itl=[0.2, 0.2], rounds=3,
                      draft_tokens=8, accepted_tokens=2)
    b = RequestRecord(1, "qa", "y", input_tokens=4, output_tokens=1, ttft=0.3, e2el=0.3, rounds=1)
    c = RequestRecord(2, "qa", "z", input_tokens=4, error="UNAVAILABLE: down")
    m = compute_metrics([a, b, c], duration=2.0, goodput_slos_ms={"ttft": 200})
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (2, 1, 6)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_token_throughput"] == pytest.approx(10.0)
    assert m["mean_tpot_ms"] == pytest.approx(100.0)  # (0.5 - 0.1) / 4; one-token outputs have no TPOT
    assert m["median_itl_ms"] == pytest.approx(200.0)  # one gap per chunk
    assert m["acceptance_rate"] == pytest.approx(0.25)
    assert m["goodput"] == pytest.approx(0.5)  # only `a` has TTFT <= 200 ms


def test_expected_tokens_per_round():
    assert expected_tokens_per_round(1.0, 4) == 5.0
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25


def test_engine_metrics_split_each_round_into_device_and_host_time():
    """Two requests of 10 tokens in 4 rounds each; the verifier's steps took 2 ms of device time
    per round, the client measured 5 ms per Verify call, the drafter 1 ms of device per round:
    host = 5 - 2 = 3 ms per round; engine-bound = 20 tokens / (8 x 3 ms) of device time."""
    recs = [RequestRecord(i, "qa", str(i), input_tokens=4, output_tokens=10, ttft=0.01, e2el=0.1, rounds=4,
                          draft_tokens=12, accepted_tokens=6, verify_time=0.020, verify_device_time=0.008,
                          verify_step_time=0.012, draft_device_time=0.004) for i in range(2)]
    m = compute_metrics(recs, duration=0.2)
    assert m["mean_verify_device_ms_per_round"] == pytest.approx(2.0)
    assert m["mean_verify_step_ms_per_round"] == pytest.approx(3.0)
    assert m["mean_verify_host_ms_per_round"] == pytest.approx(3.0)
    assert m["mean_draft_device_ms_per_round"] == pytest.approx(1.0)
    assert m["engine_tokens_per_request_s"] == pytest.approx(20 / 0.024)
    assert m["output_tokens_per_request_s"] == pytest.approx(100.0)
    assert m["engine_efficiency"] == pytest.approx(100.0 / (20 / 0.024))


def test_engine_metrics_are_null_when_the_services_report_no_device_time():
    rec = RequestRecord(0, "qa", "x", input_tokens=4, output_tokens=5, ttft=0.01, e2el=0.1, rounds=5,
                        verify_time=0.05)
    m = compute_metrics([rec], duration=0.1)
    assert m["engine_tokens_per_request_s"] is None and m["engine_efficiency"] is None
    assert m["mean_verify_host_ms_per_round"] is None


def test_ideal_speedup_comes_from_the_engines_device_times_not_the_measured_latencies():
    """Speculative: 30 tok/s measured, 100 tok/s engine-bound; target-only: 10 measured, 25
    engine-bound. Ideal = 100 / 25 = 4 whatever the latencies; measured = 3; efficiency 0.75."""
    spec = {"output_tokens_per_request_s": 30.0, "engine_tokens_per_request_s": 100.0}
    base = {"output_tokens_per_request_s": 10.0, "engine_tokens_per_request_s": 25.0}
    out = efficiency(spec, base)
    assert out["ideal_speedup"] == pytest.approx(4.0)
    assert out["measured_speedup"] == pytest.approx(3.0)
    assert out["system_efficiency"] == pytest.approx(0.75)
    assert efficiency(spec, None)["system_efficiency"] is None
    no_engine = efficiency({"output_tokens_per_request_s": 30.0}, {"output_tokens_per_request_s": 10.0})
    assert no_engine["measured_speedup"] == pytest.approx(3.0) and no_engine["ideal_speedup"] is None


def test_a_sweep_point_can_read_below_its_ideal():
    """The old call-cost model could not fall below ~1; this one does when the host path is slow:
    both modes at half their engine-bound rate give measured = ideal (efficiency 1), while a
    speculative run at a quarter of it gives 0.5."""
    from bench.sweep import point_efficiency

    target = {"output_tokens_per_request_s": 50.0, "engine_tokens_per_request_s": 100.0, "engine_efficiency": 0.5}
    fine = point_efficiency({"output_tokens_per_request_s": 100.0, "engine_tokens_per_request_s": 200.0}, target)
    slow = point_efficiency({"output_tokens_per_request_s": 50.0, "engine_tokens_per_request_s": 200.0}, target)
    assert fine["ideal_speedup"] == pytest.approx(2.0) and fine["system_efficiency"] == pytest.approx(1.0)
    assert slow["measured_speedup"] == pytest.approx(1.0) and slow["system_efficiency"] == pytest.approx(0.5)
    assert slow["engine"]["target_only"]["engine_efficiency"] == 0.5


@pytest.mark.slow
def test_duration_limit_stops_the_run_by_itself(drafter_proc, verifier_proc, tmp_path):
    out = tmp_path / "limited.json"
    start = time.monotonic()
    # 0.1 req/s: the later requests are due long after the 3 s limit.
    _bench("serve", *_servers(drafter_proc, verifier_proc), "--num-prompts", "4", "--max-tokens", "6",
           "--request-rate", "0.1", "--duration-limit-s", "3", "--warmup-requests", "0", "--result-json", str(out))
    assert time.monotonic() - start < 20
    res = json.loads(out.read_text())
    assert res["duration"] < 3 + 3  # the run itself stopped at the limit, not at the last arrival (10.4 s)
    assert res["completed"] + res["failed"] == 4
    assert any(r["error"] == "not sent: duration limit reached" for r in res["per_request"])


@pytest.mark.slow
def test_sweep_writes_a_png_and_both_modes_per_point(drafter_proc, verifier_proc, tmp_path):
    png, out = tmp_path / "sweep.png", tmp_path / "sweep.json"
    rc = _bench("sweep", *_servers(drafter_proc, verifier_proc), "--num-prompts", "2", "--max-tokens", "6",
                "--num-speculative-tokens", "4", "--concurrency", "1,2", "--plot", str(png), "--result-json", str(out))
    assert rc == 0
    assert png.read_bytes()[:8] == PNG_MAGIC
    res = json.loads(out.read_text())
    assert [p["max_concurrency"] for p in res["points"]] == [1, 2]
    # each prompt is prefilled once before the first point's modes (neither meets a prompt length
    # first: on one H100 the mode that did ran 0.57x); the second point's prompts are the same
    assert [p["primed"]["requests"] for p in res["points"]] == [2, 0]
    assert res["points"][0]["primed"]["failed"] == 0
    for point in res["points"]:
        assert point["speculative"]["mode"] == "speculative" and point["speculative"]["completed"] == 2
        assert point["target_only"]["mode"] == "target-only" and point["target_only"]["completed"] == 2
        assert point["system_efficiency"] is not None and point["system_efficiency"] > 0
        assert point["warmup"]["speculative"]["requests"] == point["warmup"]["target_only"]["requests"] == 2
        for mode in ("speculative", "target_only"):
            run = point[mode]
            assert run["mean_verify_device_ms_per_round"] > 0 and run["mean_verify_host_ms_per_round"] is not None
            assert 0 < run["engine_efficiency"] <= 1.05  # measured tok/s cannot beat what the device time allows
        spec = point["speculative"]
        # the first round of each request never drafts; with a fixed γ the others do
        assert 0 < spec["speculative_round_share"] < 1
        assert spec["mean_drafts_per_round"] == pytest.approx(spec["total_draft_tokens"] / spec["total_rounds"])


@pytest.mark.slow
@pytest.mark.parametrize("front,proposal", [("unary", "ids"), ("batched", "sparse"), ("stream", "dense")])
def test_verifier_bench_reports_the_engine_step_and_the_cost_of_an_empty_call(verifier_proc, tmp_path, front,
                                                                              proposal):
    """Each front, and each proposal form: sampled rounds whose drafts the verifier accepts as
    drawn from the proposal sent (a refused round fails the run)."""
    out = tmp_path / "verifier.json"
    rc = main(["bench", "verifier", "--verifier", verifier_proc.address, "--concurrency", "1,3",
               "--num-speculative-tokens", "2", "--seconds", "1", "--prompt-len", "8", "--empty-calls", "20",
               "--json", str(out), "--front", front, "--proposal", proposal, "--top-n", "8"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["empty_call_p50_ms"] > 0
    assert [x["concurrency"] for x in res["levels"]] == [1, 3]
    for level in res["levels"]:
        assert level["front"] == front and level["proposal"] == proposal and level["gamma"] == 2
        assert level["rounds"] > 0
        assert level["scored_tokens_per_s"] == pytest.approx(3 * level["rounds_per_s"], rel=0.01)
        assert level["mean_step_ms"] >= level["mean_device_ms"] > 0
        assert level["max_round_ms"] >= level["p999_round_ms"] >= level["p99_round_ms"] >= level["p50_round_ms"] > 0
        # each round contains the step that served it (paired round by round, not against a mean
        # step, which a p50 round undercuts when step times spread), so the excess is positive
        assert level["p50_over_step_ms"] > 0 and 0 < level["efficiency"] <= 1.05
        assert 1 <= level["mean_batch_size"] <= level["concurrency"]  # the server's batched rows / batches
    assert res["levels"][1]["mean_step_rows"] > 1  # three sessions share steps


def test_the_accepted_histogram_counts_full_rounds_of_a_fixed_gamma_and_every_drafting_round_under_auto():
    """The plot's histogram: rounds that drafted the full γ for a fixed γ; under "auto" (γ
    varies by round) every round that drafted. It came out empty under "auto" before."""
    result = {"per_request": [
        {"error": None, "drafts_per_round": [0, 4, 4, 2, 0], "accepted_per_round": [0, 3, 4, 1, 0]},
        {"error": "failed", "drafts_per_round": [0, 4], "accepted_per_round": [0, 4]},
    ]}
    assert accepted_per_round([result], 4) == [3, 4]
    assert accepted_per_round([result], "auto") == [3, 4, 1]


@pytest.mark.parametrize("chat", [False, True])
def test_an_openai_reply_whose_first_token_is_eos_is_timed_not_nan(chat):
    """A server whose model emits EOS first streams one chunk with no text and a finish_reason
    (vLLM and llama-server do): its TTFT and E2EL are that chunk's arrival, as vLLM's bench
    times them, not NaN and 0 (which broke --goodput and the JSON). The SSE replies come from
    httpx's MockTransport: this checks the backend's parsing, not a server."""
    import httpx

    from bench.datasets import BenchPrompt
    from bench.openai_backend import OpenAIServer, OpenAITarget
    from bench.serve import BenchRequest, WorkloadConfig, compute_metrics

    def reply(request: httpx.Request) -> httpx.Response:
        time.sleep(0.02)  # the model's time to its first (and only) token
        choice = {"index": 0, "finish_reason": "stop", **({"delta": {"content": ""}} if chat else {"text": ""})}
        events = [{"choices": [choice]}, {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    config = WorkloadConfig(verifier="", chat=chat, num_prompts=1)
    server = OpenAIServer(OpenAITarget("http://test", model="m"), config)
    server.http = httpx.Client(base_url="http://test", transport=httpx.MockTransport(reply))
    rec = server.send(BenchRequest(0, BenchPrompt(id="p", category="c", messages=("hi",)), ()), config, None,
                      time.perf_counter(), None)
    assert rec.ok and rec.finish_reason == "stop" and rec.output_tokens == 1
    assert 0.02 <= rec.ttft == rec.e2el < 5 and rec.itl == []
    metrics = compute_metrics([rec], 1.0, goodput_slos_ms={"ttft": 10_000.0})
    assert metrics["request_goodput"] == 1.0
    json.dumps(metrics, allow_nan=False)  # strict JSON: no NaN anywhere


def test_bench_arguments_that_would_mislead_are_refused_and_repeated_slos_add_up(capsys):
    """--burstiness inf sent every request at once (NaN gaps) under a printed finite rate and
    wrote Infinity into the JSON; --max-tokens beside --dataset random was ignored (its output
    lengths are --random-output-len); a variant listed twice overwrote the first's runs; a
    second --goodput dropped the first's SLOs."""
    from cli import build_parser

    servers = ["--verifier", "127.0.0.1:1", "--drafter", "127.0.0.1:1"]
    with pytest.raises(SystemExit):
        main(["bench", "serve", *servers, "--burstiness", "inf"])
    assert "--burstiness must be <=" in capsys.readouterr().err
    assert _bench("serve", *servers, "--dataset", "random", "--max-tokens", "8") == 2
    assert "--random-output-len" in capsys.readouterr().err
    assert _bench("compare", *servers, "--variants", "gamma=2", "gamma=2") == 2
    assert "lists one twice" in capsys.readouterr().err
    args = build_parser(bench=True).parse_args(["bench", "serve", *servers, "--goodput", "ttft:100",
                                               "--goodput", "tpot:5", "e2el:900"])
    assert dict(args.goodput) == {"ttft": 100.0, "tpot": 5.0, "e2el": 900.0}


def test_a_run_whose_drafter_went_away_says_so():
    """Rounds that ran target-only because no drafter answered (one killed mid-run) make the
    result say it is no clean speculative run; it read as one, with acceptance and speedup."""
    from bench.serve import WorkloadConfig, assemble_result, format_result

    def record(i: int, fallback: int) -> RequestRecord:
        return RequestRecord(i, "qa", str(i), input_tokens=4, output_tokens=8, ttft=0.1, e2el=0.5, itl=[0.1] * 3,
                             rounds=4, speculative_rounds=4 - fallback, draft_tokens=4, accepted_tokens=4,
                             drafter_fallback_rounds=fallback)

    config = WorkloadConfig(verifier="127.0.0.1:1", drafter="127.0.0.1:2")
    clean = assemble_result(config, [record(0, 0), record(1, 0)], 1.0, backend="grpc", gamma=4, server_stats={},
                            verifier_model="m", drafter_model="d")
    broken = assemble_result(config, [record(0, 0), record(1, 3)], 1.0, backend="grpc", gamma=4, server_stats={},
                             verifier_model="m", drafter_model="d")
    assert clean["drafter_fallback_round_share"] == 0 and "WARNING" not in format_result(clean)
    assert broken["drafter_fallback_round_share"] == pytest.approx(3 / 8)
    assert "WARNING: 37.5% of the rounds ran target-only" in format_result(broken)


def test_a_dataset_smaller_than_num_prompts_is_said_to_be_sent_again(caplog):
    """Requests past the dataset's prompts cycle through it again; that was silent."""
    from bench.serve import WorkloadConfig, warn_if_cycled

    config = WorkloadConfig(verifier="127.0.0.1:1", dataset="two.jsonl", num_prompts=6)
    with caplog.at_level("WARNING"):
        warn_if_cycled(6, config)
        assert not caplog.records
        warn_if_cycled(2, config)
    assert "two.jsonl has 2 usable prompts for --num-prompts 6" in caplog.text
