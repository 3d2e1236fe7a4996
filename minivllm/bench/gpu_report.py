"""A GPU check's results file (``./course.sh gpu-check``, :mod:`minivllm.bench.gpu_check`) read back as text.

``python -m minivllm.bench.gpu_report [FILE]`` prints it; notebook 09 prints the committed run on an NVIDIA H200
(:data:`H200_RESULTS`) the same way, so that every GPU number it shows is read from that file, none typed in.

The report has five parts: where and with what it ran (GPU, versions, date), whether every correctness check
passed (greedy tokens equal to transformers' in float32 for every backend and scenario, each Triton kernel against
the reference attention), the 64-request workload's output tokens per second for every (backend, mode) and for
transformers, batch-1 decode against the bandwidth floor (SmolLM2-135M's shape and a 1B Llama shape), and the
GPU's measured copy bandwidth and matrix rate.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Dict, List, Optional

from minivllm.i18n import _, ljust

#: The prepared check run once on an NVIDIA H200 (2026-12-04), as ``./course.sh gpu-check`` wrote it.
H200_RESULTS = Path(__file__).resolve().parent / "measurements" / "gpu_check_h200.json"

_MODES = {"eager": "eager", "cuda_graphs": "CUDA graphs"}


def load(path: Optional[Path] = None) -> Dict:
    """The results of one GPU check (default: :data:`H200_RESULTS`).

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not a GPU check's results on a GPU (no ``env`` section with a GPU, or a dry run).
    """
    path = Path(path) if path is not None else H200_RESULTS
    results = json.loads(path.read_text())
    env = results.get("env")
    if not isinstance(env, dict) or not env.get("gpu") or env.get("dry_run"):
        raise ValueError(f"{path} holds no GPU check's env section with a GPU (a CPU dry run, or not a results "
                         "file; ./course.sh gpu-check on a GPU machine writes one)")
    return results


def _run_label(run: Dict) -> str:
    return f"minivllm {run['backend']}, {_(_MODES.get(run['mode'], run['mode']))}"


def _provenance(r: Dict) -> List[str]:
    env = r["env"]
    return [
        _("GPU check run on {gpu} (compute capability {cap}, {sms} multiprocessors, {mem:.1f} GiB), "
          "{date} UTC").format(gpu=env["gpu"], cap=env["gpu_capability"], sms=env["gpu_sms"],
                               mem=env["gpu_memory_gib"], date=env["date_utc"][:16].replace("T", " ")),
        _("Python {py}, torch {torch} (CUDA {cuda}), triton {triton}, transformers {tf}; "
          "attention backend by default: {backend}").format(
            py=env["python"], torch=env["torch"], cuda=env["torch_cuda"], triton=env["triton"],
            tf=env["transformers"], backend=env["default_backend"]["bfloat16"]),
        _("correctness checks: all passed") if r["correctness_passed"] else _("correctness checks: SOME FAILED"),
    ]


def _equality(r: Dict) -> List[str]:
    eq = r["equality"]
    lines = [_("Greedy tokens equal to transformers' generate, float32, {n} prompts x {t} tokens "
               "(SmolLM2-135M's shape, random weights):").format(n=len(eq["prompt_lens"]), t=eq["max_tokens"])]
    by_backend: Dict[str, List[str]] = {}
    for s in eq["scenarios"]:
        item = f"{s['scenario']} " + (_("equal") if s["equal"] else _("DIFFERENT"))
        if s["num_preemptions"]:
            item += _(", {n} preemption(s)").format(n=s["num_preemptions"])
        if s["equal"] and not s["passed"]:
            item += _(" (check failed: the scenario did not happen as planned)")
        by_backend.setdefault(s["backend"], []).append(item)
    for backend, items in by_backend.items():
        lines.append(f"  {backend:12s} " + _("; ").join(items))
    return lines


def _kernels(r: Dict) -> List[str]:
    k = r["kernels"]
    worst: Dict[str, Dict] = {}
    for c in k["attention"]:
        w = worst.get(c["dtype"])
        if w is None or c["max_abs_err"] / c["tol"] > w["max_abs_err"] / w["tol"]:
            worst[c["dtype"]] = c
    lines = [_("Triton attention against the reference, {n} cases on real sizes, worst per dtype:").format(
        n=len(k["attention"]))]
    for dtype, c in worst.items():
        lines.append(_("  {dtype:9s} max |error| {err:.1e} (tolerance {tol:.0e}, case {case})").format(
            dtype=dtype, err=c["max_abs_err"], tol=c["tol"], case=c["case"]))
    writes = k["kv_write"]
    lines.append(_("  KV write by slot mapping equal to the reference in {ok} of {n} cases").format(
        ok=sum(w["equal"] for w in writes), n=len(writes)))
    return lines


def _throughput(r: Dict) -> List[str]:
    t = r["throughput"]
    wl = t["workload"]
    lines = [_("{n} requests (prompts {p0}-{p1} tokens, {o0}-{o1} new, greedy), {dtype}, output tokens/s:").format(
        n=wl["num_requests"], p0=wl["prompt_len"][0], p1=wl["prompt_len"][1], o0=wl["output_len"][0],
        o1=wl["output_len"][1], dtype=t["dtype"])]
    rows = [(_run_label(run), run["output_tok_s"]) for run in t["runs"]]
    rows += [(_("transformers generate, batches of {b}").format(b=run["config"]["batch_size"]), run["output_tok_s"])
             for run in t["transformers"]]
    for label, tok_s in sorted(rows, key=lambda x: -x[1]):
        lines.append(f"  {ljust(label, 40)} {tok_s:8.0f}")
    lines.append(_("  best minivllm / best transformers: {x:.2f}x").format(x=t["speedup_vs_best_transformers"]))
    return lines


def _batch1(section: Dict, title: str) -> List[str]:
    lw = section["latency_workload"]
    rows = section["batch1_vs_limits"]
    some = next(iter(rows.values()))
    lines = [_("{title}, batch 1 ({p}-token prompt, {o} new tokens), {dtype}: {mb:.0f} MB read per step (every "
               "weight once, and the KV cache), {floor:.3f} ms at {bw:.1f} TB/s").format(
        title=title, p=lw["prompt_tokens"], o=lw["output_tokens"], dtype=section["dtype"],
        mb=some["bytes_per_step"] / 1e6, floor=some["bandwidth_floor_ms"],
        bw=some["bytes_per_step"] / some["bandwidth_floor_ms"] / 1e9)]
    for key, row in rows.items():
        label = key
        if key.startswith("minivllm[") and key.endswith("]"):  # "minivllm[TRITON_ATTN,cuda_graphs]"
            backend, mode = key[len("minivllm["):-1].split(",")
            label = _run_label({"backend": backend, "mode": mode})
        lines.append(_("  {label} {tok:6.1f} tok/s  {ms:6.2f} ms/token  {share:5.1%} of the bandwidth-bound "
                       "speed").format(label=ljust(label, 34), tok=row["decode_tok_s"], ms=row["ms_per_token"],
                                       share=row["fraction_of_bandwidth_bound"]))
    return lines


def _limits(r: Dict) -> List[str]:
    lim = r["limits"]
    return [_("Measured on this GPU: copy {bw:.2f} TB/s, bfloat16 matrix product {fl:.0f} TFLOP/s ({bwp:.0%} and "
              "{flp:.0%} of the {nbw:.1f} TB/s and {nfl:.0f} TFLOP/s that earlier runs on such machines measured, "
              "the figures the bounds above use)").format(
        bw=lim["copy_bandwidth_bytes_s"] / 1e12, bwp=lim["bandwidth_fraction_of_nominal"],
        nbw=lim["nominal_h200_bandwidth_bytes_s"] / 1e12, fl=lim["bf16_matmul_flops"] / 1e12,
        flp=lim["flops_fraction_of_nominal"], nfl=lim["nominal_h200_bf16_flops"] / 1e12)]


#: The report's parts in order, each with the sections of the results file it reads.
_PARTS = (
    (("env",), _provenance),
    (("equality",), _equality),
    (("kernels",), _kernels),
    (("throughput",), _throughput),
    (("throughput",), lambda r: _batch1(r["throughput"], "SmolLM2-135M")),
    (("bandwidth_1b",), lambda r: _batch1(r["bandwidth_1b"], _("Llama 1B shape ({p:.2f} B parameters)").format(
        p=r["bandwidth_1b"]["params"] / 1e9))),
    (("limits",), _limits),
)


def report(results: Dict) -> str:
    """The results as lines of text, in the current language (:func:`minivllm.i18n.set_language`). A section the
    file lacks (a check cut short, or run with ``--sections``) is named with its error, if the file has one."""
    parts = []
    for needs, part in _PARTS:
        missing = [n for n in needs if n not in results]
        if missing:
            for n in missing:
                why = (results.get("errors") or {}).get(n) or (results.get("skipped") or {}).get(n) or _("not run")
                parts.append([_("{section}: missing ({why})").format(section=n, why=str(why).splitlines()[0])])
            continue
        parts.append(part(results))
    for n, why in sorted((results.get("errors") or {}).items()):
        if n in results:
            parts.append([_("{section}: error ({why})").format(section=n, why=str(why).splitlines()[0])])
    return "\n\n".join("\n".join(p) for p in parts)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minivllm.bench.gpu_report", description=__doc__.split("\n")[0])
    p.add_argument("file", nargs="?", default=None, help=f"a gpu-check results file (default: {H200_RESULTS.name})")
    print(report(load(p.parse_args(argv).file)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
