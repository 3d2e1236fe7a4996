"""The ``TRITON_ATTN`` attention backend (``minivllm/attention/backends/triton_attn.py``): its metadata builder and
implementation against the reference backend, the engine's greedy tokens against the default backend (chunked
prefill, preemption, the CUDA-graph padding path emulated), and the selector's choices and refusals.

The kernels run on the CPU through Triton's interpreter, which must be switched on before the process first imports
triton; as in ``tests/worker/test_triton_kernels.py`` (read why there), this file runs itself in a child process
started with ``TRITON_INTERPRET=1`` (``test_in_fresh_process``). The tests of the selector outside the interpreter
run here.
"""

import random

import pytest
import torch
from triton_child import run_under_interpreter, where_it_runs

pytest.importorskip("triton", reason="triton is not installed (pip install -r requirements.txt installs it on Linux)")

from minivllm.attention.backends.reference import (  # noqa: E402
    ReferenceAttentionImpl,
    ReferenceAttentionMetadataBuilder,
)
from minivllm.attention.backends.torch_sdpa import TorchSDPABackend  # noqa: E402
from minivllm.attention.backends.triton_attn import (  # noqa: E402
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)
from minivllm.attention.ops.triton_unified_attention import kernel_unified_attention  # noqa: E402
from minivllm.attention.ops.triton_utils import (  # noqa: E402
    interpreter_problem,
    is_interpreted,
    triton_language_interpreted,
)
from minivllm.attention.selector import get_attn_backend  # noqa: E402
from minivllm.engine.llm_engine import LLMEngine  # noqa: E402
from minivllm.sampling_params import SamplingParams  # noqa: E402
from minivllm.worker.block_table import create_common_attn_metadata  # noqa: E402

INTERPRETED_HERE = triton_language_interpreted() and is_interpreted(kernel_unified_attention)
if interpreter_problem():
    pytest.skip(interpreter_problem(), allow_module_level=True)
OUTSIDE_THE_INTERPRETER = ("test_in_fresh_process", "test_selector_outside_the_interpreter")
_where_it_runs = where_it_runs(INTERPRETED_HERE, OUTSIDE_THE_INTERPRETER)


def test_in_fresh_process():
    run_under_interpreter(__file__, min_passed=6, MINIVLLM_CPU_KERNELS="0")


def test_selector_outside_the_interpreter():
    # Compiled kernels: chosen by default on CUDA (the selector only inspects the device, it needs no GPU) ...
    assert get_attn_backend(torch.device("cuda"), torch.bfloat16) is TritonAttentionBackend
    assert get_attn_backend(torch.device("cuda"), torch.float32, head_size=64) is TritonAttentionBackend
    # ... but not for a head size its tl.dot tiles cannot take, nor by default on the CPU.
    assert get_attn_backend(torch.device("cuda"), torch.bfloat16, head_size=48) is TorchSDPABackend
    assert get_attn_backend(torch.device("cpu"), torch.float32) is TorchSDPABackend
    # Named on the CPU without the interpreter: refused, saying what to do.
    with pytest.raises(ValueError, match=r"TRITON_ATTN cannot run for torch.float32 on cpu: .*TRITON_INTERPRET=1"):
        LLMEngine("tiny", attention_backend="TRITON_ATTN")
    with pytest.raises(ValueError, match=r"TRITON_ATTN cannot run .* head size that is a power of two"):
        get_attn_backend(torch.device("cuda"), torch.float16, "triton_attn", head_size=96)


def test_selector_under_the_interpreter():
    assert get_attn_backend(torch.device("cpu"), torch.float32, "TRITON_ATTN") is TritonAttentionBackend
    assert get_attn_backend(torch.device("cpu"), torch.float16, "TRITON_ATTN") is TritonAttentionBackend
    with pytest.raises(ValueError, match="TRITON_ATTN cannot run for torch.bfloat16 on cpu: bfloat16 is not supported"):
        get_attn_backend(torch.device("cpu"), torch.bfloat16, "TRITON_ATTN")
    # Interpreted kernels cannot run on CUDA tensors: the CUDA default falls back to TORCH_SDPA.
    assert get_attn_backend(torch.device("cuda"), torch.bfloat16) is TorchSDPABackend
    with pytest.raises(ValueError, match="TRITON_ATTN cannot run for torch.bfloat16 on cuda: .*TRITON_INTERPRET=1"):
        get_attn_backend(torch.device("cuda"), torch.bfloat16, "TRITON_ATTN")


# ---- builder and implementation against the reference ----------------------------------------------------------
BS, HEADS, KV_HEADS, D = 16, 6, 2, 32


def _mixed_batch(dtype, seed=0):
    """A cache with random context, then one step of: a prefill chunk after 21 cached tokens, a decode, a first
    chunk crossing a block boundary, a decode whose token opens a new block. Returns (cm, q, k, v, cache)."""
    g = torch.Generator().manual_seed(seed)
    tables = [[3, 17, 5], [1, 2], [30, 31], [20, 21, 9]]
    computed, qlens = [21, 6, 0, 32], [7, 1, 19, 1]
    cache = torch.randn(2, 40, BS, KV_HEADS, D, generator=g).to(dtype)
    cm = create_common_attn_metadata(tables, computed, qlens, BS, pad_block_id=39)
    t = sum(qlens)
    q, k, v = (torch.randn(t, n, D, generator=g).to(dtype) for n in (HEADS, KV_HEADS, KV_HEADS))
    return cm, q, k, v, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_builder_and_impl_match_reference_on_mixed_batch(dtype):
    cm, q, k, v, cache = _mixed_batch(dtype)
    md = TritonAttentionMetadataBuilder(BS, HEADS, KV_HEADS, D, dtype, torch.device("cpu")).build(cm)
    assert isinstance(md, TritonAttentionMetadata)
    assert (md.num_actual_tokens, md.max_query_len, md.max_seq_len, md.num_par_softmax_segments) == (28, 19, 33, 1)
    # The kernels take the step's tensors as they are: no copies, no per-request split.
    assert md.query_start_loc is cm.query_start_loc and md.seq_lens is cm.seq_lens
    assert md.block_table is cm.block_table_tensor and md.slot_mapping is cm.slot_mapping
    ref_md = ReferenceAttentionMetadataBuilder(BS, HEADS, KV_HEADS, D, dtype, torch.device("cpu")).build(cm)
    ref_cache = cache.clone()
    scale = D ** -0.5
    ref = ReferenceAttentionImpl(HEADS, D, scale, KV_HEADS).forward(q.float(), k.float(), v.float(),
                                                                    ref_cache.float(), ref_md)
    out = TritonAttentionImpl(HEADS, D, scale, KV_HEADS).forward(q, k, v, cache, md)
    assert out.dtype == dtype and out.shape == q.shape
    assert (out.float() - ref).abs().max().item() < {torch.float32: 2e-5, torch.float16: 3e-3}[dtype]
    expected_cache = cache.clone()
    ReferenceAttentionImpl(HEADS, D, scale, KV_HEADS).forward(q, k, v, expected_cache, ref_md)
    assert torch.equal(cache, expected_cache)  # the KV write put the step's keys and values at the same slots


def test_builder_splits_long_decodes_over_the_context():
    cm = create_common_attn_metadata([list(range(40))], [600], [1], BS)
    md = TritonAttentionMetadataBuilder(BS, HEADS, KV_HEADS, D, torch.float32, torch.device("cpu")).build(cm)
    assert md.num_par_softmax_segments == 2  # one request, 601 keys: 2 segments of >= 256 keys
    cache = torch.randn(2, 41, BS, KV_HEADS, D, generator=torch.Generator().manual_seed(2))
    q, k, v = torch.randn(1, HEADS, D), torch.randn(1, KV_HEADS, D), torch.randn(1, KV_HEADS, D)
    ref_md = ReferenceAttentionMetadataBuilder(BS, HEADS, KV_HEADS, D, torch.float32, torch.device("cpu")).build(cm)
    ref = ReferenceAttentionImpl(HEADS, D, 0.2, KV_HEADS).forward(q, k, v, cache.clone(), ref_md)
    out = TritonAttentionImpl(HEADS, D, 0.2, KV_HEADS).forward(q, k, v, cache, md)
    assert (out - ref).abs().max().item() < 2e-5


def test_capture_metadata_with_padding_rows():
    # As DecodeGraphRunner builds a captured step: 2 real decodes padded to B = 4 rows and NB = 4 blocks, the
    # padding rows one-token requests whose table, slot and key are the scratch block (39); *_cpu lists empty.
    scratch = 39
    table = torch.full((4, 4), scratch)
    table[0, :3] = torch.tensor([3, 17, 5])
    table[1, :2] = torch.tensor([1, 2])
    seq_lens = torch.tensor([40, 17, 1, 1])
    slots = torch.tensor([5 * BS + 7, 2 * BS + 0, scratch * BS, scratch * BS])
    from minivllm.attention.backend import CommonAttentionMetadata

    cm = CommonAttentionMetadata(
        query_start_loc=torch.arange(5), seq_lens=seq_lens, block_table_tensor=table, slot_mapping=slots,
        positions=torch.tensor([39, 16, 0, 0]), query_start_loc_cpu=list(range(5)),
        seq_lens_cpu_upper_bound=[], num_reqs=4, num_actual_tokens=4, max_query_len=1, max_seq_len=4 * BS)
    builder = TritonAttentionMetadataBuilder(BS, HEADS, KV_HEADS, D, torch.float32, torch.device("cpu"))
    md = builder.build_for_cudagraph_capture(cm)
    assert md.max_seq_len == 64 and md.num_par_softmax_segments == 1 and md.block_table is table
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 40, BS, KV_HEADS, D, generator=g)
    q, k, v = (torch.randn(4, n, D, generator=g) for n in (HEADS, KV_HEADS, KV_HEADS))
    before = cache.clone()
    out = TritonAttentionImpl(HEADS, D, 0.2, KV_HEADS).forward(q, k, v, cache, md)
    # The real rows equal the reference on the real requests alone ...
    real = create_common_attn_metadata([[3, 17, 5], [1, 2]], [39, 16], [1, 1], BS)
    ref_md = ReferenceAttentionMetadataBuilder(BS, HEADS, KV_HEADS, D, torch.float32, torch.device("cpu")).build(real)
    ref = ReferenceAttentionImpl(HEADS, D, 0.2, KV_HEADS).forward(q[:2], k[:2], v[:2], before.clone(), ref_md)
    assert (out[:2] - ref).abs().max().item() < 2e-5
    # ... and the padding rows wrote only into the scratch block; each attends to the one key there, so its output
    # is that key's value (both padding rows write the same slot: either may win).
    changed = (cache != before).flatten(2).any(-1).nonzero()[:, 1].unique().tolist()
    assert changed == [2, 5, scratch]
    scratch_v = cache[1, scratch, 0].repeat_interleave(HEADS // KV_HEADS, 0)
    assert torch.allclose(out[2], scratch_v) and torch.allclose(out[3], scratch_v)
    bad = CommonAttentionMetadata(**{**cm.__dict__, "max_seq_len": 40})
    with pytest.raises(ValueError, match="must be the block table's capacity"):
        builder.build_for_cudagraph_capture(bad)


# ---- the engine ----------------------------------------------------------------------------------------------
def _greedy(backend, emulate_graphs=False, **engine_kw):
    eng = LLMEngine("tiny", attention_backend=backend, enable_prefix_caching=False, **engine_kw)
    if emulate_graphs:
        eng.model_runner.enable_decode_graphs(max_batch=4, emulate=True)
    rng = random.Random(0)
    for i in range(4):
        eng.add_request(str(i), {"prompt_token_ids": [rng.randrange(17, 512) for _ in range(rng.randint(12, 45))]},
                        SamplingParams(temperature=0, max_tokens=rng.randint(6, 12), ignore_eos=True))
    out = eng.run_to_completion()
    return {r: o.outputs[0].token_ids for r, o in out.items()}, eng


@pytest.mark.parametrize("scenario", ["chunked_prefill", "preemption", "decode_graphs_emulated"])
def test_engine_greedy_tokens_equal_default_backend(scenario):
    kw = dict(max_num_batched_tokens=16)  # prompts of 12-45 tokens: chunks of at most 16
    if scenario == "preemption":
        kw.update(num_gpu_blocks=4, max_model_len=64)  # 4 requests of up to 57 tokens in 64 slots: preemption
    emulate = scenario == "decode_graphs_emulated"
    expected, ref_eng = _greedy(None, **kw)
    got, eng = _greedy("TRITON_ATTN", emulate_graphs=emulate, **kw)
    assert eng.model_runner.attn_backend is TritonAttentionBackend
    assert ref_eng.model_runner.attn_backend is TorchSDPABackend  # the CPU default stays
    assert got == expected
    assert all(len(t) >= 6 for t in got.values())
    if scenario == "preemption":
        assert eng.num_preemptions > 0 and eng.num_preemptions == ref_eng.num_preemptions
    if emulate:
        assert eng.model_runner.graph_runner.num_replays >= 5
