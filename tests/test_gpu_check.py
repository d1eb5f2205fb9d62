"""scripts/gpu-check, the one-command GPU validation, kept from rotting while no GPU is around:
its `--device cpu --quick` mode runs every part here in one go (the GPU tests' CPU twin, bench
engine, bench sampler, the verifier alone under bench verifier, random-weight models, both
services under bench sweep with each drafter, a synthetic pair) and writes its report; these
tests check that every step ran and that the report has every section. The merge of parts,
the verifier-alone table and the goal verdicts are pure functions, tested on made-up figures.
(`--prepare`, which needs the package index, checks itself when run.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check"


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else None
    return proc, out, report


@pytest.mark.slow
def test_the_cpu_quick_run_passes_every_step_it_can_run_here(cpu_run):
    proc, out, report = cpu_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    status = {s["name"]: s["status"] for s in report["steps"]}
    assert status == {"wheels": "skipped", "env": "passed", "tests": "passed", "flashinfer": "skipped",
                      "sampler": "passed", "engine": "passed", "models-target": "passed", "verifier-alone": "passed",
                      "models": "passed", "sweep-copy": "passed", "sweep-drafter": "passed",
                      "models-synthetic": "passed", "sweep-synthetic-0.9": "passed"}, report["steps"]
    assert report["ok"] and report["failed_steps"] == [] and report["missing_parts"] == []
    assert list(report["parts"]) == ["tests", "engine", "serve", "synthetic"]
    assert report["seconds"] < 540
    # What the device tool brings back: at most 8 files, no folders.
    assert sorted(p.name for p in out.iterdir()) == ["junit.xml", "log.txt", "part-engine.json", "part-serve.json",
                                                     "part-synthetic.json", "part-tests.json", "report.json",
                                                     "report.md"]


@pytest.mark.slow
def test_the_gpu_tests_ran_as_their_cpu_twin(cpu_run):
    _, _, report = cpu_run
    tests = report["tests"]
    assert tests["failed"] == tests["errors"] == tests["skipped"] == 0
    assert tests["passed"] == tests["total"] >= 9
    names = {c["name"].split("[")[0] for c in tests["cases"]}
    assert {"test_fast_path_matches_eager_transformers_over_the_bucket_grid",
            "test_a_freed_slot_serves_a_new_session_as_a_fresh_slot_would",
            "test_compiled_kernel_emits_the_torch_paths_tokens",
            "test_compiled_kernel_first_tokens_follow_the_target_distribution",
            "test_services_on_the_device_speculate_greedily_as_target_only",
            "test_nothing_is_left_on_the_gpu_after_the_services_stop"} <= names


@pytest.mark.slow
def test_the_cpu_quick_report_has_every_section(cpu_run):
    """tests, engine, sampler, the verifier alone, the sweeps (copy, random drafter, a synthetic
    pair) with their efficiency columns (host ms beside device ms), expected speedup, goals."""
    _, out, report = cpu_run
    engine = report["engine"]["rows"]
    assert {(r["role"], r["batch"], r["width"]) for r in engine} == {
        ("verify", 1, 5), ("verify", 2, 5), ("target-decode", 1, 1), ("target-decode", 2, 1),
        ("prefill", 1, 256), ("prefill", 4, 256)}  # prompt chunks: static pieces on the fast path
    assert all(r["fast_ms"] > 0 and r["eager_ms"] > 0 and r["greedy_agreement"] == 1.0 for r in engine)
    sampler = report["sampler"]["rows"]
    assert [r["batch_size"] for r in sampler] == [1, 4] and all(r["rejection_dense_q_us"] > 0 for r in sampler)
    table = report["verifier_alone_table"]
    assert [(x["gamma"], x["front"], x["concurrency"]) for x in table] == [  # the batched front second
        (g, f, c) for g, f in ((0, "unary"), (0, "stream"), (4, "unary")) for c in (1, 2)]
    for x in table:  # the service's own step and bench engine's, beside the measured rounds/s
        assert x["rounds_per_s"] > 0 and x["device_ms"] > 0 and x["host_ms"] >= 0
        assert x["engine_rows_per_s"] > 0 and x["bench_engine_rows_per_s"] > 0 and x["bench_engine_efficiency"] > 0
    pairs = report["synthetic"]["pairs"]
    assert [x["level"] for x in pairs] == [0.9] and abs(pairs[0]["greedy_agreement"] - 0.9) < 0.05
    assert set(report["sweeps"]) == {"sweep-copy", "sweep-drafter", "sweep-synthetic-0.9"}
    assert report["sweeps"]["sweep-synthetic-0.9"]["kind"] == "synthetic"
    # The sweeps of the serve part took the verifier-alone service (no second start of the target);
    # the synthetic pair's target is another model, so it starts its own.
    starts = [(x["part"], x["role"]) for x in report["service_starts"]]
    assert starts.count(("engine", "verifier")) == 1 and ("serve", "verifier") not in starts, starts
    assert starts.count(("synthetic", "verifier")) == 1, starts
    for name, sweep in report["sweeps"].items():
        assert [p["concurrency"] for p in sweep["points"]] == [1, 2], name
        for p in sweep["points"]:
            assert p["measured_speedup"] > 0 and p["ideal_speedup"] > 0 and p["system_efficiency"] > 0
            assert p["shared_device"] is True  # both services on this host's CPUs
            # each mode's GetStats deltas: the verifier served every round; target-only never called the drafter
            assert p["speculative"]["verifier_calls"] > 0 and p["target_only"]["verifier_calls"] > 0
            assert "drafter_calls" not in p["target_only"] and p["speculative"]["drafter_calls"] is not None
            for mode in ("speculative", "target_only"):
                m = p[mode]
                assert m["completed"] == p["num_prompts"] and m["failed"] == 0
                assert m["mean_verify_device_ms_per_round"] > 0 and m["mean_verify_host_ms_per_round"] is not None
                assert m["engine_tokens_per_request_s"] > 0 and 0 < m["engine_efficiency"] <= 1.05
                assert p["warmup"][mode] > 0  # a warm-up wave ran before the measured run
    expected = report["expected_speedup"]
    assert expected["acceptance"] == 0.991 and "embedded pair" in expected["acceptance_source"]
    assert [r["batch"] for r in expected["rows"]] == [1, 2] and all(r["expected_speedup"] > 0 for r in expected["rows"])
    assert {g["status"] for g in report["goals"]} == {"n/a (cpu run)"}
    md = (out / "report.md").read_text()
    for heading in ("**PASSED**", "## Steps", "## GPU tests", "## Engine", "## Sampler", "## Verifier alone",
                    "## Synthetic pairs", "## Sweep (sweep-copy)", "## Sweep (sweep-drafter)",
                    "## Sweep (sweep-synthetic-0.9)", "Host ms beside device ms per round (sweep-synthetic-0.9)",
                    "## Service starts", "## Expected speedup", "## Goals"):
        assert heading in md, heading
    for column in ("| verify device ms | verify step ms | verify host ms | draft device ms | engine-bound tok/s",
                   "| speedup | ideal | speedup eff. |", "| engine rows/s | efficiency | bench engine ms",
                   "| warm-up s | verifier calls / forwards | drafter calls / forwards |"):
        assert column in md, column


@pytest.mark.slow
def test_a_failed_step_fails_the_run_and_the_summary_says_which(tmp_path):
    """A wheel folder that was never prepared: the wheels step fails, the run exits 1, and the
    summary names the step and the remedy (the other steps left out to keep this quick)."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(tmp_path),
                           "--wheels", str(tmp_path / "never-prepared"), "--skip", "tests", "--skip", "engine",
                           "--skip", "sampler", "--skip", "verifier", "--skip", "sweep", "--skip", "synthetic"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 1, proc.stdout[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["failed_steps"] == ["tests/wheels"] and not report["ok"]
    md = (tmp_path / "report.md").read_text()
    assert "**FAILED**" in md and "| tests | wheels | FAILED |" in md and "--prepare" in md


def _load_script():
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.SourceFileLoader("gpu_check_script", str(SCRIPT))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[loader.name] = module  # dataclasses look their module up there
    loader.exec_module(module)
    return module


def _h100_parts(gc, k: float) -> list[dict]:
    """Made-up H100 figures, one dict per part as the parts write them; k > 1 makes everything slower."""
    plan = gc.make_plan("cuda", quick=False)
    meta = {"mode": {"device": "cuda", "quick": False, "acceptance": 0.991},
            "plan": {"target": plan.target, "drafter": plan.drafter}}
    rows = [{"role": role, "preset": preset, "batch": b, "width": w, "context": 512, "eager_ms": 19.0,
             "slot_ms": 9.0, "fast_ms": ms * k, "speedup": 19.0 / (ms * k), "limit_ms": 1.0, "fast_over_limit": ms * k,
             "fast_gbps": 3000.0 / (ms * k), "greedy_agreement": 1.0}
            for role, preset, w, b, ms in (("verify", "target-1.5b", 5, 1, 2.0), ("verify", "target-1.5b", 5, 64, 5.0),
                                           ("target-decode", "target-1.5b", 1, 1, 1.8),
                                           ("target-decode", "target-1.5b", 1, 64, 3.0),
                                           ("drafter-decode", "drafter-270m", 1, 1, 0.5),
                                           ("drafter-decode", "drafter-270m", 1, 64, 0.9))]
    levels = [{"gamma": 4, "concurrency": c, "rounds_per_s": rps / k, "mean_batch_size": float(c),
               "p50_round_ms": p50 * k, "p99_round_ms": p50 * 1.5 * k ** 2, "mean_step_ms": 3.0, "mean_device_ms": 2.5,
               "mean_host_ms": 0.5, "engine_rows_per_s": 12000.0, "efficiency": rps / k / 12000.0}
              for c, rps, p50 in ((1, 330.0, 3.0), (64, 9000.0, 7.0))]
    levels.append({**levels[-1], "gamma": 0, "front": "stream", "rounds_per_s": 13000.0 / k})

    def point(c: int, speedup: float) -> dict:
        return {"concurrency": c, "num_prompts": 8, "measured_speedup": speedup / k, "ideal_speedup": 2.5,
                "system_efficiency": speedup / k / 2.5,
                **{m: {key: 1.0 for key in gc.SWEEP_KEYS} for m in ("speculative", "target_only")}}

    def sweep(kind: str, speedup: float, **extra) -> dict:
        return {"drafter": kind, "kind": kind, "points": [point(c, speedup) for c in (1, 8, 32, 64)], **extra}

    ok = {"ok": True, "seconds": 100.0, "date": "2026-11-25T00:00:00+00:00"}
    return [
        {"part": "tests", **meta, **ok, "environment": {"gpu": "NVIDIA H100"},
         "steps": [{"name": "tests", "status": "passed", "seconds": 90.0, "note": ""}],
         "sampler": {"rows": [{"vocab": 32000, "gamma": 4, "batch_size": 1, "rejection_dense_q_us": 90.0,
                               "triton_dense_q_us": 20.0 * k, "triton_with_draws_us": 25.0 * k,
                               "flashinfer_chain_us": 30.0, "flashinfer_over_triton": 30 / (25 * k),
                               "plain_torch_us": 900.0}]}},
        {"part": "engine", **meta, **ok, "steps": [{"name": "engine", "status": "passed", "seconds": 60.0, "note": ""}],
         "engine": {"device": "NVIDIA H100", "dtype": "torch.bfloat16", "peak_gbps": 3350.0, "rows": rows},
         "verifier_alone": {"levels": levels}},
        {"part": "serve", **meta, **ok, "steps": [], "sweeps": {"sweep-copy": sweep("copy", 1.5),
                                                              "sweep-drafter": sweep("drafter", 1.0)}},
        {"part": "synthetic", **meta, **ok, "steps": [],
         "sweeps": {f"sweep-synthetic-{a}": sweep("synthetic", s, level=a, greedy_agreement=a)
                    for a, s in ((0.3, 1.0), (0.6, 1.2), (0.9, 2.2))}},
    ]


def test_parts_merge_into_one_report_that_names_the_missing_ones(tmp_path):
    """Each part's file in its own folder (one device command each): --merge renders one report
    with every part's sections and steps; without a part, the report says it was not run."""
    gc = _load_script()
    parts = _h100_parts(gc, 1.0)
    for part in parts:
        folder = tmp_path / part["part"]
        folder.mkdir()
        (folder / f"part-{part['part']}.json").write_text(json.dumps(part))
    merged = gc.merge_parts(gc.read_parts([tmp_path / p["part"] for p in parts]))
    assert list(merged["parts"]) == ["tests", "engine", "serve", "synthetic"] and merged["missing_parts"] == []
    assert [f"{s['part']}/{s['name']}" for s in merged["steps"]] == ["tests/tests", "engine/engine"]
    assert set(merged["sweeps"]) == {"sweep-copy", "sweep-drafter", "sweep-synthetic-0.3", "sweep-synthetic-0.6",
                                     "sweep-synthetic-0.9"}
    assert merged["ok"] and merged["seconds"] == 400.0 and merged["environment"]["gpu"] == "NVIDIA H100"
    out = tmp_path / "merged"
    rc = subprocess.run([sys.executable, str(SCRIPT), "--merge", *[str(tmp_path / p["part"]) for p in parts],
                         "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert rc.returncode == 0, rc.stdout[-2000:] + rc.stderr[-2000:]
    md = (out / "report.md").read_text()
    assert "## Verifier alone" in md and "## Sweep (sweep-synthetic-0.9)" in md and "not run" not in md
    partial = gc.merge_parts([p for p in parts if p["part"] != "synthetic"])
    assert partial["missing_parts"] == ["synthetic"] and "not run: synthetic" in gc.render_markdown(partial)


def test_a_later_folder_replaces_an_earlier_ones_part(tmp_path):
    gc = _load_script()
    old, new = ({"part": "engine", "date": d, "seconds": 1.0, "ok": ok, "steps": []} for d, ok in (("a", False),
                                                                                                   ("b", True)))
    for name, part in (("first", old), ("second", new)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "part-engine.json").write_text(json.dumps(part))
    assert gc.read_parts([tmp_path / "first", tmp_path / "second"]) == [new]


def test_the_verifier_alone_table_sets_rounds_beside_both_engine_figures():
    """γ 4 at c=64: 9,000 rounds/s; the service's own step allows 12,000 rows/s; bench engine's
    verify step at B=64 takes 5 ms, i.e. 64 x 1000 / 5 = 12,800 rows/s, of which 9,000 is 0.703.
    γ 0 reads bench engine's decode row."""
    gc = _load_script()
    report = gc.merge_parts(_h100_parts(gc, 1.0))
    rows = {(x["gamma"], x["front"], x["concurrency"]): x for x in report["verifier_alone_table"]}
    x = rows[(4, "unary", 64)]
    assert x["bench_engine_ms"] == 5.0 and x["bench_engine_rows_per_s"] == pytest.approx(12800.0)
    assert x["bench_engine_efficiency"] == pytest.approx(9000.0 / 12800.0)
    assert x["service_efficiency"] == pytest.approx(0.75) and x["host_ms"] == 0.5
    decode = gc.verifier_alone_rows({"engine": {"rows": [{"role": "target-decode", "batch": 8, "fast_ms": 2.0}]},
                                     "verifier_alone": {"levels": [{"gamma": 0, "concurrency": 8,
                                                                    "rounds_per_s": 2000.0}]}})
    assert decode[0]["bench_engine_rows_per_s"] == pytest.approx(4000.0)
    assert decode[0]["bench_engine_efficiency"] == pytest.approx(0.5)


@pytest.mark.parametrize("slow", [False, True], ids=["goals-met", "goals-missed"])
def test_gpu_figures_give_expected_speedup_and_goal_verdicts(slow):
    """The GPU-only parts of the report, on made-up H100 figures: the expected speedup is
    E(gamma) t_target / (gamma t_draft + t_verify) per batch size, and each goal (issue 18's
    engine and sampler, issue 25's verifier alone and end to end) reads met or not met against
    its threshold; the summary renders them."""
    gc = _load_script()
    report = gc.merge_parts(_h100_parts(gc, 2.0 if slow else 1.0))
    b1 = report["expected_speedup"]["rows"][0]
    e = (1 - 0.991 ** 5) / (1 - 0.991)
    k = 2.0 if slow else 1.0
    assert b1["batch"] == 1 and b1["expected_speedup"] == pytest.approx(e * 1.8 * k / (4 * 0.5 * k + 2.0 * k))
    verdicts = {g["goal"]: g["status"] for g in report["goals"]}
    assert len(verdicts) == 13 and set(verdicts.values()) == {"not met" if slow else "met"}, verdicts
    md = gc.render_markdown(report)
    assert "## Expected speedup" in md and ("| not met |" if slow else "| met |") in md


def test_capture_all_visits_every_bucket_once_and_is_a_no_op_without_graphs(monkeypatch):
    """The fast path captures every (batch, width, context) bucket at service start: the
    enumeration, with the capture itself stubbed (it needs CUDA); on the CPU nothing happens."""
    import torch

    from specdec import static_forward as sf

    class Slots:
        model = type("M", (), {"config": type("C", (), {"rope_scaling": None})()})()
        device = torch.device("cpu")
        max_len = 256

    fast = object.__new__(sf.StaticForward)
    fast.graphs, fast.max_len, fast._buckets = False, 256, {}
    assert fast.capture_all() == (0, 0.0) and fast._buckets == {}
    fast.graphs = True
    fast.batch_buckets, fast.width_buckets = (1, 2, 4), (1, 5, 10)
    fast.pool = type("P", (), {"scratch": 0})()
    fast.device = torch.device("cpu")
    captured = []
    warmups = []
    monkeypatch.setattr(fast, "_capture", lambda bucket, C, warmup: (captured.append((bucket.B, bucket.T, C)),
                                                                    warmups.append(warmup)), raising=False)
    monkeypatch.setattr(fast, "_on_device", lambda: __import__("contextlib").nullcontext(), raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    n, seconds = fast.capture_all()
    contexts = (64, 96, 128, 192, 256)
    assert n == len(captured) == 3 * 3 * len(contexts) and seconds >= 0
    assert set(captured) == {(b, t, c) for b in (1, 2, 4) for t in (1, 5, 10) for c in contexts}
    assert sum(w > 0 for w in warmups) == 3 * 3  # warm-up runs once per (batch, width)
    assert fast.capture_all()[0] == 0  # a second call finds every bucket there
