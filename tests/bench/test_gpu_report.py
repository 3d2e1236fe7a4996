"""The GPU check's committed H200 record (``minivllm/bench/measurements/gpu_check_h200.json``) and its report.

Notebook 09 prints this record; these tests hold it to what issue 31 asked of the run on the H200, and check that
the report shows the file's numbers, not numbers of its own.
"""

import json

import pytest

from minivllm.bench import gpu_report
from minivllm.i18n import set_language


@pytest.fixture(scope="module")
def record():
    return gpu_report.load()


def test_the_record_is_a_real_gpu_run_with_its_provenance(record):
    env = record["env"]
    assert env["gpu"] == "NVIDIA H200" and env["gpu_capability"] == "9.0"
    assert env["dry_run"] is False and env["device"] == "cuda"
    assert env["date_utc"].startswith("2026-12-04")
    for key in ("python", "torch", "torch_cuda", "triton", "transformers"):
        assert env[key]
    assert record["errors"] == {} and record["skipped"] == {}


def test_the_record_meets_the_gpu_issue_targets(record):
    assert record["correctness_passed"] is True
    scenarios = record["equality"]["scenarios"]
    assert {s["scenario"] for s in scenarios} >= {"chunked", "preemption"}
    assert all(s["passed"] and s["equal"] for s in scenarios)
    assert any(s["num_preemptions"] > 0 for s in scenarios if s["scenario"] == "preemption")
    cases = record["kernels"]["attention"]
    assert {c["dtype"] for c in cases} == {"float32", "float16", "bfloat16"}
    assert all(c["max_abs_err"] <= c["tol"] for c in cases)
    tp = record["throughput"]
    best_hf = max(r["output_tok_s"] for r in tp["transformers"])
    best_ours = max(r["output_tok_s"] for r in tp["runs"])
    assert best_ours / best_hf == pytest.approx(tp["speedup_vs_best_transformers"], rel=1e-2)
    assert best_ours >= 3 * best_hf
    modes = {r["mode"] for r in tp["batch1"]}
    assert modes == {"eager", "cuda_graphs"}
    assert record["bandwidth_1b"]["params"] > 1e9


def test_the_report_prints_the_files_numbers(record, tmp_path):
    set_language("en")
    text = gpu_report.report(record)
    assert "NVIDIA H200" in text and record["env"]["date_utc"][:10] in text
    tp = record["throughput"]
    assert f"{tp['speedup_vs_best_transformers']:.2f}x" in text
    for run in tp["runs"]:
        assert f"{run['output_tok_s']:8.0f}" in text
    # A changed record changes the report: nothing in it is typed in.
    changed = json.loads(json.dumps(record))
    changed["throughput"]["speedup_vs_best_transformers"] = 1.23
    changed["env"]["gpu"] = "Some Other GPU"
    path = tmp_path / "other.json"
    path.write_text(json.dumps(changed))
    other = gpu_report.report(gpu_report.load(path))
    assert "1.23x" in other and "Some Other GPU" in other and "NVIDIA H200" not in other


def test_the_report_in_chinese(record):
    try:
        set_language("zh_CN")
        text = gpu_report.report(record)
    finally:
        set_language("en")
    assert "正确性检查：全部通过" in text and "抢占 1 次" in text


@pytest.mark.parametrize("env", [None, {"device": "cpu", "dry_run": True, "gpu": None},
                                 {"device": "cuda", "dry_run": True, "gpu": "NVIDIA H200"}])
def test_a_file_without_a_gpu_run_is_refused(tmp_path, env):
    path = tmp_path / "dry.json"
    path.write_text(json.dumps({"env": env, "correctness_passed": True}))
    with pytest.raises(ValueError, match="no GPU check's env section with a GPU"):
        gpu_report.load(path)


def test_the_readmes_quote_the_record(record):
    """The READMEs quote the H200 run; their figures must be the file's."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    tp = record["throughput"]
    best = max(tp["runs"], key=lambda r: r["output_tok_s"])
    eager = next(r for r in tp["batch1"] if r["backend"] == "TRITON_ATTN" and r["mode"] == "eager")
    graphs = next(r for r in tp["batch1"] if r["backend"] == "TRITON_ATTN" and r["mode"] == "cuda_graphs")
    figures = [f"{best['output_tok_s']:.0f}", f"{tp['speedup_vs_best_transformers']:.2f}",
               f"{eager['decode_tok_s']:.1f}", f"{graphs['decode_tok_s']:.1f}", record["env"]["date_utc"][:10]]
    for name in ("README.md", "README.zh-CN.md"):
        text = (root / name).read_text()
        for figure in figures:
            assert figure in text, (name, figure)


def test_optimisations_quotes_the_records_cuda_graph_gains(record):
    from pathlib import Path

    bench = Path(gpu_report.__file__).resolve().parent
    gains = record["throughput"]["gains"]
    figures = [f"{gains['workload_output_tok_s']['cuda_graphs_over_eager_triton']:.1f}",
               f"{gains['batch1_decode_tok_s']['cuda_graphs_over_eager_triton']:.1f}"]
    for name in ("OPTIMISATIONS.md", "OPTIMISATIONS.zh-CN.md"):
        text = (bench / name).read_text()
        for figure in figures:
            assert figure in text, (name, figure)


def test_the_readmes_batch1_shares_of_the_bound(record):
    """The READMEs' "0.3 % and 2.2 %" are the record's shares of the bandwidth-bound speed."""
    from pathlib import Path

    rows = record["throughput"]["batch1_vs_limits"]
    eager, graphs = rows["minivllm[TRITON_ATTN,eager]"], rows["minivllm[TRITON_ATTN,cuda_graphs]"]
    a, b = (f"{100 * row['fraction_of_bandwidth_bound']:.1f} %" for row in (eager, graphs))
    root = Path(__file__).resolve().parents[2]
    for name, quoted in (("README.md", f"{a} and {b}"), ("README.zh-CN.md", f"{a} 和 {b}")):
        assert quoted in (root / name).read_text(), (name, quoted)


def test_a_cut_short_file_and_a_scenario_that_did_not_happen(record):
    set_language("en")
    partial = json.loads(json.dumps(record))
    del partial["bandwidth_1b"], partial["limits"]
    partial["errors"] = {"bandwidth_1b": "CUDA error: out of memory\nTraceback ..."}
    scenario = next(s for s in partial["equality"]["scenarios"] if s["scenario"] == "preemption")
    scenario.update(num_preemptions=0, passed=False)  # equal tokens, but no preemption: the check failed
    text = gpu_report.report(partial)
    assert "bandwidth_1b: missing (CUDA error: out of memory)" in text and "limits: missing (not run)" in text
    assert "preemption equal (check failed: the scenario did not happen as planned)" in text
    assert "Llama 1B" not in text and "SmolLM2-135M, batch 1" in text
