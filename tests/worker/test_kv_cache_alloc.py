"""The KV cache's memory (minivllm/worker/kv_cache_alloc.py): zeros, and on the CPU resident only where written."""

import os

import pytest
import torch

from minivllm.worker.kv_cache_alloc import allocate_kv_cache, zeroed_cpu_tensor


def _rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS line")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zeroed_cpu_tensor_is_zeros_of_its_shape_and_writable(dtype):
    t = zeroed_cpu_tensor((2, 5, 16, 3, 64), dtype)
    assert t.shape == (2, 5, 16, 3, 64) and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
    assert t.data_ptr() % 4096 == 0  # page-aligned, as the vector kernels like it
    assert torch.count_nonzero(t) == 0
    t[1, 4, 15, 2, 63] = 3.0
    t[0, 0] += 1
    assert t[1, 4, 15, 2, 63].item() == 3.0 and torch.count_nonzero(t) == 1 + 16 * 3 * 64


def test_zeroed_cpu_tensor_outlives_its_mapping_variable():
    ts = [zeroed_cpu_tensor((1024,), torch.float32) for _ in range(3)]
    for i, t in enumerate(ts):
        t.fill_(i)
    assert [t.sum().item() for t in ts] == [0.0, 1024.0, 2048.0]


def test_zeroed_cpu_tensor_refuses_an_empty_shape():
    with pytest.raises(ValueError, match="at least one element"):
        zeroed_cpu_tensor((2, 0, 16), torch.float32)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS from /proc (Linux)")
def test_cpu_cache_is_resident_only_where_written():
    # torch.zeros would make all 256 MiB resident at once; the mapped cache grows with the blocks written.
    before = _rss_mib()
    caches = allocate_kv_cache((2, 1024, 16, 4, 64), torch.float32, torch.device("cpu"), num_layers=8)  # 256 MiB
    assert len(caches) == 8 and all(c.shape == (2, 1024, 16, 4, 64) for c in caches)
    allocated = _rss_mib()
    assert allocated - before < 32, (before, allocated)
    for c in caches:
        c[:, :512] = 1.0  # half of every layer's blocks
    written = _rss_mib()
    assert written - allocated > 100, (allocated, written)  # 128 MiB written
    assert all(torch.count_nonzero(c[:, 512:]) == 0 for c in caches)


def test_non_cpu_devices_get_torch_zeros():
    meta = allocate_kv_cache((2, 4, 16, 1, 8), torch.float16, torch.device("meta"), num_layers=2)
    assert [c.device.type for c in meta] == ["meta", "meta"] and meta[0].shape == (2, 4, 16, 1, 8)
