"""scripts/gpu-check, the one-command GPU validation, kept from rotting while no GPU is around:
its `--device cpu --quick` mode runs the whole pipeline here (the GPU tests' CPU twin, bench
engine, bench sampler, random-weight models, both services under bench sweep with each
drafter) and writes its report; these tests check that every step ran and what the report
holds. (`--prepare`, which needs the package index, checks itself when run.)"""

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
                      "engine": "passed", "sampler": "passed", "models": "passed", "sweep-copy": "passed",
                      "sweep-drafter": "passed"}, report["steps"]
    assert report["ok"] and report["failed_steps"] == []
    assert report["seconds"] < 540
    # What the device tool brings back: at most 8 files, no folders.
    assert sorted(p.name for p in out.iterdir()) == ["junit.xml", "log.txt", "report.json", "report.md"]


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
def test_the_report_holds_engine_sampler_sweep_and_expected_speedup_tables(cpu_run):
    _, out, report = cpu_run
    engine = report["engine"]["rows"]
    assert {(r["role"], r["batch"], r["width"]) for r in engine} == {
        ("verify", 1, 5), ("verify", 4, 5), ("target-decode", 1, 1), ("target-decode", 4, 1)}
    assert all(r["fast_ms"] > 0 and r["eager_ms"] > 0 and r["greedy_agreement"] == 1.0 for r in engine)
    sampler = report["sampler"]["rows"]
    assert [r["batch_size"] for r in sampler] == [1, 4] and all(r["rejection_dense_q_us"] > 0 for r in sampler)
    for name in ("sweep-copy", "sweep-drafter"):
        points = report["sweeps"][name]["points"]
        assert [p["concurrency"] for p in points] == [1, 2]
        for p in points:
            for mode in ("speculative", "target_only"):
                assert p[mode]["completed"] == p["num_prompts"] and p[mode]["failed"] == 0
            # (efficiency and acceptance are None where the controller drafted nothing)
            assert p["measured_speedup"] > 0 and {"ideal_speedup", "system_efficiency"} <= p.keys()
    expected = report["expected_speedup"]
    assert expected["acceptance"] == 0.991 and "embedded pair" in expected["acceptance_source"]
    assert [r["batch"] for r in expected["rows"]] == [1, 4] and all(r["expected_speedup"] > 0 for r in expected["rows"])
    assert {g["status"] for g in report["goals"]} == {"n/a (cpu run)"}
    md = (out / "report.md").read_text()
    for heading in ("**PASSED**", "## Steps", "## GPU tests", "## Engine", "## Sampler", "## Sweep (sweep-copy)",
                    "## Sweep (sweep-drafter)", "## Expected speedup", "## Goals"):
        assert heading in md, heading


@pytest.mark.slow
def test_a_failed_step_fails_the_run_and_the_summary_says_which(tmp_path):
    """A wheel folder that was never prepared: the wheels step fails, the run exits 1, and the
    summary names the step and the remedy (the other steps left out to keep this quick)."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(tmp_path),
                           "--wheels", str(tmp_path / "never-prepared"), "--skip", "tests", "--skip", "engine",
                           "--skip", "sampler", "--skip", "sweep"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 1, proc.stdout[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["failed_steps"] == ["wheels"] and not report["ok"]
    md = (tmp_path / "report.md").read_text()
    assert "**FAILED**" in md and "| wheels | FAILED |" in md and "--prepare" in md


def _load_script():
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.SourceFileLoader("gpu_check_script", str(SCRIPT))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[loader.name] = module  # dataclasses look their module up there
    loader.exec_module(module)
    return module


@pytest.mark.parametrize("slow", [False, True], ids=["goals-met", "goals-missed"])
def test_gpu_figures_give_expected_speedup_and_goal_verdicts(slow):
    """The GPU-only parts of the report, on made-up H100 figures: the expected speedup is
    E(gamma) t_target / (gamma t_draft + t_verify) per batch size, and each goal reads met or
    not met against the issue's thresholds; the summary renders them."""
    gc = _load_script()
    k = 2.0 if slow else 1.0
    plan = gc.make_plan("cuda", quick=False)
    rows = [{"role": role, "preset": preset, "batch": b, "width": w, "context": 512, "eager_ms": 19.0,
             "slot_ms": 9.0, "fast_ms": ms * k, "speedup": 19.0 / (ms * k), "limit_ms": 1.0, "fast_over_limit": ms * k,
             "fast_gbps": 3000.0 / (ms * k), "greedy_agreement": 1.0}
            for role, preset, w, b, ms in (("verify", "target-1.5b", 5, 1, 2.0), ("verify", "target-1.5b", 5, 64, 5.0),
                                           ("target-decode", "target-1.5b", 1, 1, 1.8),
                                           ("target-decode", "target-1.5b", 1, 64, 3.0),
                                           ("drafter-decode", "drafter-270m", 1, 1, 0.5),
                                           ("drafter-decode", "drafter-270m", 1, 64, 0.9))]
    point = {"concurrency": 1, "num_prompts": 8, "measured_speedup": 1.5 / k, "ideal_speedup": 1.6,
             "system_efficiency": 0.94 / k,
             **{m: {key: 1.0 for key in gc.SWEEP_KEYS} for m in ("speculative", "target_only")}}
    report = {"mode": {"device": "cuda", "quick": False}, "date": "now", "plan": {"target": plan.target,
                                                                                 "drafter": plan.drafter},
              "engine": {"device": "NVIDIA H100", "dtype": "torch.bfloat16", "peak_gbps": 3350.0, "rows": rows},
              "sampler": {"rows": [{"vocab": 32000, "gamma": 4, "batch_size": 1, "rejection_dense_q_us": 90.0,
                                    "triton_dense_q_us": 20.0 * k, "triton_with_draws_us": 25.0 * k,
                                    "flashinfer_chain_us": 30.0, "flashinfer_over_triton": 30 / (25 * k),
                                    "plain_torch_us": 900.0}]},
              "sweeps": {"sweep-copy": {"drafter": "copy", "points": [point]},
                         "sweep-drafter": {"drafter": "drafter-270m", "points": [point]}}}
    report["expected_speedup"] = gc.expected_speedup(report, 0.991)
    b1 = report["expected_speedup"]["rows"][0]
    e = (1 - 0.991 ** 5) / (1 - 0.991)
    assert b1["batch"] == 1 and b1["expected_speedup"] == pytest.approx(e * 1.8 / (4 * 0.5 + 2.0))
    report["goals"] = gc.goals(report, plan)
    verdicts = {g["goal"]: g["status"] for g in report["goals"]}
    assert len(verdicts) == 7 and set(verdicts.values()) == {"not met" if slow else "met"}
    md = gc.render_markdown({**report, "steps": [], "ok": True, "seconds": 1.0, "environment": {}})
    assert "## Expected speedup" in md and ("| not met |" if slow else "| met |") in md
