"""The benchmark's table and JSON file."""

from __future__ import annotations

import json
import os
import platform
import time
from typing import Dict, List, Optional

import torch

from minivllm.bench.isa import active_cap
from minivllm.bench.metrics import RunResult, median_run
from minivllm.i18n import TABLE_LABEL, L_, _, ljust, pgettext, rjust, text_width

# The table's column labels are English in the JSON and the code, and shown in the current language
# (minivllm.i18n: notebook 09's Chinese edition prints this table).
COLUMNS = [
    (L_("system"), "system", "{}"),
    (L_("output tok/s"), "output_tok_s", "{:.1f}"),
    (L_("total tok/s"), "total_tok_s", "{:.1f}"),
    (L_("decode tok/s"), "decode_tok_s", "{:.1f}"),
    (L_("TTFT p50 ms"), "ttft_p50_s", "ms"),
    (L_("TTFT p99 ms"), "ttft_p99_s", "ms"),
    (L_("ITL p50 ms"), "itl_p50_s", "ms"),
    (L_("ITL p99 ms"), "itl_p99_s", "ms"),
    (L_("peak MiB"), "peak_mem_mib", "{:.0f}"),
    (L_("preempt"), "num_preemptions", "{}"),
    (L_("runs"), None, "{}"),
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
        rows = [[pgettext(TABLE_LABEL, name) for name, _attr, _fmt in COLUMNS]]
        for label, runs in systems.items():
            m = median_run(runs)
            row = []
            for _name, attr, fmt in COLUMNS:
                if attr == "system":
                    row.append(label)
                elif attr is None:
                    row.append(str(len(runs)))
                else:
                    row.append(_cell(getattr(m, attr), fmt))
            rows.append(row)
        widths = [max(text_width(r[i]) for r in rows) for i in range(len(COLUMNS))]
        first = next(iter(systems.values()))[0]
        lines.append(_("== {case}: {requests} requests, {prompt_tokens} prompt tokens ==").format(
            case=case, requests=first.num_requests, prompt_tokens=first.prompt_tokens))
        for k, r in enumerate(rows):
            lines.append("  ".join(rjust(c, w) if i else ljust(c, w) for i, (c, w) in enumerate(zip(r, widths))))
            if k == 0:
                lines.append("  ".join("-" * w for w in widths))
        for peer, ratio in ratios.get(case, {}).items():
            lines.append(_("   minivllm / {peer}: {ratio:.2f}x").format(peer=peer, ratio=ratio))
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


def bandwidth_floor(weight_bytes: int, bandwidth: float, decode_tok_s: Optional[float]) -> Dict:
    """The batch-1 decode ceiling that memory bandwidth sets: a decode step of one request reads every weight
    once (the LM head reads the tied embedding matrix whole; the KV cache of a short context is small beside it),
    so no engine decodes faster than ``bandwidth / weight_bytes`` tokens/s on this machine.

    Args:
        weight_bytes: the model's parameters in bytes (each tensor once).
        bandwidth: bytes/s, as ``minivllm.bench.roofline.measure_bandwidth`` measures it (a large copy).
        decode_tok_s: minivllm's measured batch-1 decode tokens/s, or ``None``.
    Returns ``{"weight_bytes", "bandwidth_bytes_s", "ceiling_tok_s", "decode_tok_s", "fraction"}`` (fraction of
    the ceiling reached, ``None`` without a measurement). Raises ``ValueError`` for a weight size or bandwidth <= 0.
    """
    if weight_bytes <= 0 or bandwidth <= 0:
        raise ValueError(f"weight_bytes and bandwidth must be > 0, got {weight_bytes} and {bandwidth}")
    ceiling = bandwidth / weight_bytes
    return {"weight_bytes": weight_bytes, "bandwidth_bytes_s": bandwidth, "ceiling_tok_s": ceiling,
            "decode_tok_s": decode_tok_s, "fraction": decode_tok_s / ceiling if decode_tok_s else None}


def format_floor(floor: Dict) -> str:
    """One line: the batch-1 bandwidth ceiling and how much of it minivllm reached."""
    line = _("batch 1: a decode step reads the {mb:.0f} MB of weights; at {gbs:.1f} GB/s (copy bandwidth, measured "
             "now) no engine decodes more than {ceiling:.1f} tok/s here").format(
        mb=floor["weight_bytes"] / 1e6, gbs=floor["bandwidth_bytes_s"] / 1e9, ceiling=floor["ceiling_tok_s"])
    if floor.get("fraction") is not None:
        line += _("; minivllm {ours:.1f} tok/s, {percent:.0f} % of it").format(
            ours=floor["decode_tok_s"], percent=100 * floor["fraction"])
    return line


def load_line(results: Dict[str, Dict[str, List[RunResult]]]) -> Optional[str]:
    """The load average (1 minute) before and after the runs, lowest and highest over every run of every system:
    a figure measured while other work ran reads differently. ``None`` when no run recorded it."""
    before = [r.config["loadavg_before"][0] for systems in results.values() for runs in systems.values()
              for r in runs if "loadavg_before" in r.config]
    after = [r.config["loadavg_after"][0] for systems in results.values() for runs in systems.values()
             for r in runs if "loadavg_after" in r.config]
    if not before or not after:
        return None
    return _("load average during the runs: {b0:.2f}-{b1:.2f} at their start, {a0:.2f}-{a1:.2f} at their end").format(
        b0=min(before), b1=max(before), a0=min(after), a1=max(after))


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
    flags = ", ".join(env.get("cpu_flags") or []) or _("no AVX2")
    line = _("machine: {cpu} ({flags}), {cpus} CPUs, {threads} torch threads, load average {load:.2f}").format(
        cpu=env["cpu"], flags=flags, cpus=env["cpu_count"], threads=env["torch_threads"], load=env["loadavg"][0])
    if env.get("isa_cap"):
        line += "\n" + _("run as the {isa} class runs (bench --isa): every library capped to {isa} and minivllm's "
                         "kernels built for it, on this machine's memory, caches and clocks, so not that class's "
                         "figures").format(isa=env["isa_cap"].upper())
    return line


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
        "isa_cap": active_cap(),  # bench --isa: the class this run was capped to, None for the machine's own
    }


def write_json(path: str, results: Dict[str, Dict[str, List[RunResult]]], ratios, workloads: Dict, args: Dict,
               skipped: Optional[Dict[str, str]] = None, bandwidth_floor: Optional[Dict] = None) -> str:
    """Write everything (environment, arguments, workloads, every run and the medians, ratios, the batch-1
    bandwidth floor when measured) to ``path``."""
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
        "bandwidth_floor": bandwidth_floor,
    }
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    return path
