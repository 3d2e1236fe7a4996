"""The benchmark's table and JSON file."""

from __future__ import annotations

import json
import os
import platform
import time
from typing import Dict, List, Optional

import torch

from minivllm.bench.metrics import RunResult, median_run

COLUMNS = [
    ("system", "system", "{}"),
    ("output tok/s", "output_tok_s", "{:.1f}"),
    ("total tok/s", "total_tok_s", "{:.1f}"),
    ("decode tok/s", "decode_tok_s", "{:.1f}"),
    ("TTFT p50 ms", "ttft_p50_s", "ms"),
    ("TTFT p99 ms", "ttft_p99_s", "ms"),
    ("ITL p50 ms", "itl_p50_s", "ms"),
    ("ITL p99 ms", "itl_p99_s", "ms"),
    ("peak MiB", "peak_mem_mib", "{:.0f}"),
    ("preempt", "num_preemptions", "{}"),
    ("runs", None, "{}"),
]


def _cell(value, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "ms":
        return f"{value * 1000:.1f}"
    return fmt.format(value)


def format_table(results: Dict[str, Dict[str, List[RunResult]]], ratios: Dict[str, Dict[str, float]]) -> str:
    """One block per workload: a row per system (median run of each), then minivllm's speed-up over each peer."""
    lines = []
    for case, systems in results.items():
        rows = [[name for name, _, _ in COLUMNS]]
        for label, runs in systems.items():
            m = median_run(runs)
            row = []
            for _, attr, fmt in COLUMNS:
                if attr == "system":
                    row.append(label)
                elif attr is None:
                    row.append(str(len(runs)))
                else:
                    row.append(_cell(getattr(m, attr), fmt))
            rows.append(row)
        widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
        first = next(iter(systems.values()))[0]
        lines.append(f"== {case}: {first.num_requests} requests, {first.prompt_tokens} prompt tokens ==")
        for k, r in enumerate(rows):
            lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
            if k == 0:
                lines.append("  ".join("-" * w for w in widths))
        for peer, ratio in ratios.get(case, {}).items():
            lines.append(f"   minivllm / {peer}: {ratio:.2f}x")
        lines.append("")
    return "\n".join(lines)


def compute_ratios(results: Dict[str, Dict[str, List[RunResult]]], ours: str = "minivllm") -> Dict[str, Dict[str, float]]:
    """``{case: {peer: ours_median / peer_median}}`` of output tokens/s (decode tokens/s for a batch-1 case).

    Peers are the systems whose label does not start with ``ours`` (variants such as
    ``minivllm-no-prefix-cache`` are shown in the table but are not peers)."""
    out: Dict[str, Dict[str, float]] = {}
    for case, systems in results.items():
        if ours not in systems:
            continue
        mine = median_run(systems[ours])
        key = "decode_tok_s" if mine.num_requests == 1 and mine.decode_tok_s else "output_tok_s"
        for peer, runs in systems.items():
            if peer.startswith(ours):
                continue
            other = getattr(median_run(runs), key)
            if other:
                out.setdefault(case, {})[peer] = getattr(mine, key) / other
    return out


#: The CPU flags that decide which kernels and dtypes minivllm (and vLLM's CPU build) can use fast: AVX2 only means
#: float32 matmuls at 8 lanes; AVX-512 doubles the lanes; AVX512-BF16 and AMX make bfloat16 fast.
CPU_CLASS_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def cpu_class(cpuinfo: Optional[str] = None) -> List[str]:
    """The ``CPU_CLASS_FLAGS`` this machine has (``cpuinfo``: the text of ``/proc/cpuinfo``, read when ``None``;
    an empty list where there is none), so that a figure can be read without its machine."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return []
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
            break
    return [f for f in CPU_CLASS_FLAGS if f in flags]


def environment_line(env: Optional[Dict] = None) -> str:
    """One line naming the CPU, its class, the threads and the load average, printed with every table."""
    env = env or environment()
    flags = ", ".join(env.get("cpu_flags") or []) or "no AVX2"
    return (f"machine: {env['cpu']} ({flags}), {env['cpu_count']} CPUs, {env['torch_threads']} torch threads, "
            f"load average {env['loadavg'][0]:.2f}")


def environment() -> Dict:
    """Machine and software facts stored with every result."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
    except OSError:
        pass  # no /proc/cpuinfo: the platform's processor name stays
    import transformers

    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": cpu,
        "cpu_flags": cpu_class(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "loadavg": list(os.getloadavg()),
    }


def write_json(path: str, results: Dict[str, Dict[str, List[RunResult]]], ratios, workloads: Dict, args: Dict,
               skipped: Optional[Dict[str, str]] = None) -> str:
    """Write everything (environment, arguments, workloads, every run and the medians, ratios) to ``path``."""
    data = {
        "environment": environment(),
        "args": args,
        "workloads": workloads,
        "results": {
            case: {sys_: {"median": median_run(runs).to_json(), "runs": [r.to_json() for r in runs]}
                   for sys_, runs in systems.items()}
            for case, systems in results.items()
        },
        "ratios": ratios,
        "skipped": skipped or {},
    }
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    return path
