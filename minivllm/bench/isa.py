"""Running the benchmark as a narrower CPU class runs it: ``python -m minivllm bench --isa avx2`` on an AVX-512
machine.

The project's machines differ between sessions (AVX512-BF16 on some, AVX2 only on others), and what runs on an
AVX2 machine is other code: PyTorch's kernels for another vector width, oneDNN's and MKL's AVX2 paths, minivllm's C++
kernels compiled without AVX-512 (where GCC lowers some 16-lane vector code through the stack), other dispatch
thresholds (``packed_linear.fp32_packed_rows``), and in vLLM's CPU build its AVX2 library (``vllm._C_AVX2``, its
kernels, attention's included, compiled for AVX2). Each library has its own documented cap, and ``--isa avx2`` sets
all of them for minivllm, transformers and vLLM alike:

* PyTorch: ``ATEN_CPU_CAPABILITY=avx2`` (its kernels' dispatch, and ``torch.compile``'s code generation in vLLM);
* oneDNN: ``ONEDNN_MAX_CPU_ISA=AVX2``; MKL: ``MKL_ENABLE_INSTRUCTIONS=AVX2``;
* minivllm's kernels: ``MINIVLLM_CPU_ISA=avx2`` (``-march=x86-64-v3``, ``minivllm.custom_ops.cflags``);
* vLLM: its platform and attention backend ask ``torch.cpu._is_avx512_supported()`` and its siblings, which read the
  CPU itself; a ``sitecustomize.py`` put on the vLLM child's ``PYTHONPATH`` (so also in the engine-core process vLLM
  spawns) makes them answer ``False`` (``vllm_child_sitecustomize``).

What this does not emulate: the machine itself. Memory bandwidth, caches, clock and the core's microarchitecture stay
this machine's, so an emulated figure shows which code runs and how it compares with vLLM's on the same hardware,
not what the AVX2 class measures. The environment line and the results file say that the run was capped.
"""

from __future__ import annotations

import os
from typing import Dict, Mapping, Optional

from minivllm.envs import CPU_ISAS

# The libraries' own variables, per class (module doc).
ISA_CAPS: Dict[str, Dict[str, str]] = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "MINIVLLM_CPU_ISA": "avx2",
    },
}
assert set(ISA_CAPS) == set(CPU_ISAS)

# torch.cpu's queries that read the CPU itself (cpuinfo), not ATEN_CPU_CAPABILITY; vLLM 0.32 reads them in
# vllm/platforms/cpu.py (which library to import: _C_AVX2 without AVX-512; import_kernels,
# https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/platforms/cpu.py#L631, 0.33: L657),
# vllm/v1/attention/backends/cpu_attn.py (AMX for bfloat16) and vllm/model_executor/layers/utils.py (weight packing).
_AVX512_QUERIES = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
                   "_is_amx_tile_supported", "_is_amx_fp16_supported")


def check_isa(isa: str) -> str:
    """``isa`` itself when it is ``native`` or a class of ``ISA_CAPS``.

    Raises:
        ValueError: naming ``--isa`` and the classes, for anything else.
    """
    if isa != "native" and isa not in ISA_CAPS:
        raise ValueError(f"--isa must be native or one of {', '.join(ISA_CAPS)}, got {isa!r}")
    return isa


def capped_env(isa: str, base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """A copy of ``base`` (default ``os.environ``) with ``isa``'s caps set; for ``native``, unchanged.

    Raises:
        ValueError: for an unknown ``isa`` (``check_isa``).
    """
    env = dict(os.environ if base is None else base)
    if check_isa(isa) != "native":
        env.update(ISA_CAPS[isa])
    return env


def active_cap(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The class this process runs capped to (every variable of ``ISA_CAPS[isa]`` set to its value), or ``None``."""
    env = os.environ if env is None else env
    for isa, caps in ISA_CAPS.items():
        if all(env.get(k) == v for k, v in caps.items()):
            return isa
    return None


def vllm_child_sitecustomize(isa: str) -> str:
    """The text of a ``sitecustomize.py`` that makes torch's AVX-512 and AMX queries answer ``False`` in every Python
    process started with it on ``PYTHONPATH`` (module doc); empty for ``native``."""
    if check_isa(isa) == "native":
        return ""
    return (
        "# Written by minivllm's benchmark (minivllm/bench/isa.py) for a run capped to " + isa + ": torch's CPU\n"
        "# queries below read the CPU itself, and vLLM chooses its library and attention ISA from them.\n"
        "import torch.cpu as _cpu\n"
        f"for _name in {_AVX512_QUERIES!r}:\n"
        "    if hasattr(_cpu, _name):\n"
        "        setattr(_cpu, _name, lambda: False)\n"
    )


def write_vllm_child_sitecustomize(isa: str, folder: str, env: Dict[str, str]) -> Dict[str, str]:
    """Write ``vllm_child_sitecustomize(isa)`` into ``folder`` (made if missing) and return ``env`` with ``folder``
    first on ``PYTHONPATH``; ``env`` unchanged for ``native``."""
    text = vllm_child_sitecustomize(isa)
    if not text:
        return env
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(text)
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (folder, env.get("PYTHONPATH")) if p)
    return env
