"""Runs one scheduler step on the model (vLLM: ``vllm/v1/worker/gpu_model_runner.py``).

Per step: update the per-request state from the ``SchedulerOutput``, build one flattened batch
(``input_ids``, ``positions``, ``query_start_loc``, ``seq_lens``, ``slot_mapping``, ``block_table``,
``logits_indices``), run the model, compute logits only at ``logits_indices`` (the last scheduled token of each
request), sample, and return one token per request, or ``[]`` for a request whose step was a partial prefill.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional

import numpy as np
import torch

from minivllm import custom_ops
from minivllm.attention.paged_attention import AttentionMetadata, DecodeGroup, split_decode_groups
from minivllm.core.sched.output import SchedulerOutput
from minivllm.model.llama import LlamaForCausalLM
from minivllm.outputs import ModelRunnerOutput
from minivllm.sampling_params import SamplingParams
from minivllm.worker.cuda_graphs import DecodeGraphRunner
from minivllm.worker.sampler import Sampler, SamplingMetadata

if TYPE_CHECKING:
    from minivllm.distributed.kv_transfer.base import KVConnectorBase


@dataclass
class CachedRequestState:
    """What the runner remembers about a request between steps (vLLM ``CachedRequestState``)."""

    req_id: str
    token_ids: List[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: List[int]
    num_computed_tokens: int
    generator: Optional[torch.Generator]
    eos_token_id: Optional[int] = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class StepInputs:
    """The flattened batch of one step, kept for inspection (``ModelRunner.last_inputs``).

    All tensors are int64. ``T`` = tokens this step, ``R`` = requests this step.

    Attributes:
        req_ids: ``R`` request ids in batch order.
        input_ids, positions, slot_mapping: ``[T]``.
        query_start_loc: ``[R + 1]``.
        seq_lens, num_computed_tokens: ``[R]``.
        block_table: ``[R, max_blocks]`` (padded with 0).
        logits_indices: ``[R]``: rows whose hidden state goes through the LM head (``query_start_loc[1:] - 1``).
        discard_mask: ``bool [R]``: True where the sampled token is thrown away (a partial prefill).
        logits: ``float32 [R, vocab]`` of the last step when ``keep_logits`` is on, else ``None``.
        sampled: ``[R]`` the tokens sampled (including the discarded ones).
    """

    req_ids: List[str]
    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_computed_tokens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    discard_mask: torch.Tensor
    logits: Optional[torch.Tensor] = None
    sampled: Optional[torch.Tensor] = None
    hidden_states: Optional[torch.Tensor] = field(default=None, repr=False)


class ModelRunner:
    """Owns the model, the paged KV cache tensors and the per-request runner state.

    Args:
        model: a ``LlamaForCausalLM``.
        num_gpu_blocks: blocks per layer.
        block_size: tokens per block.
        device: torch device of the model and cache.
        seed: seed of the shared generator used by requests without their own ``seed``.
        connector: optional KV connector (worker side).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_gpu_blocks: int,
        block_size: int,
        device: torch.device,
        seed: int = 0,
        connector: Optional["KVConnectorBase"] = None,
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.dtype = next(model.parameters()).dtype
        self._head_dim = model.config.head_dim
        self.requests: Dict[str, CachedRequestState] = {}
        self.kv_caches: List[torch.Tensor] = self._allocate_kv_caches(0)
        self.graph_runner: Optional[DecodeGraphRunner] = None
        if self.device.type == "cuda" and os.environ.get("MINIVLLM_ENFORCE_EAGER", "0") != "1":
            self.enable_decode_graphs()
        self.shared_generator = torch.Generator(device=self.device).manual_seed(seed)
        self.sampler = Sampler(self.shared_generator)
        self.connector = connector
        self.keep_logits = False
        self.keep_hidden_states = False
        self.last_inputs: Optional[StepInputs] = None
        self._decode_workspace: Optional[torch.Tensor] = None

    def _allocate_kv_caches(self, extra_blocks: int) -> List[torch.Tensor]:
        cfg = self.model.config
        shape = (2, self.num_gpu_blocks + extra_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        # One tensor per layer: [K|V, block, offset in block, kv head, head dim].
        return [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_hidden_layers)]

    def enable_decode_graphs(self, max_batch: int = 256, emulate: bool = False) -> None:
        """Replay pure-decode steps from CUDA graphs (``minivllm.worker.cuda_graphs``); on by default on CUDA
        (``MINIVLLM_ENFORCE_EAGER=1`` turns it off, like vLLM's ``enforce_eager``).

        Re-allocates the KV caches with one scratch block at the end, so call it before any request runs.
        ``emulate=True`` runs the padded graph inputs eagerly (CPU tests of the padding logic).

        Raises:
            ValueError: if requests are running, or (without ``emulate``) the device is not CUDA.
        """
        if self.requests:
            raise ValueError("enable_decode_graphs must be called before any request runs")
        if self.device.type != "cuda" and not emulate:
            raise ValueError(f"CUDA graphs need a CUDA device, this runner is on {self.device}")
        self.kv_caches = self._allocate_kv_caches(1)
        max_blocks = min(self.num_gpu_blocks, -(-self.model.config.max_position_embeddings // self.block_size))
        self.graph_runner = DecodeGraphRunner(self.model, self.kv_caches, self.block_size, max_batch, max_blocks,
                                              emulate=emulate)

    # ---------------------------------------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for new in so.scheduled_new_reqs:
            sp = new.sampling_params
            gen = None
            if sp.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(sp.seed)
            self.requests[new.req_id] = CachedRequestState(
                new.req_id,
                list(new.prompt_token_ids),
                len(new.prompt_token_ids),
                sp,
                list(new.block_ids),
                new.num_computed_tokens,
                gen,
                sp.eos_token_id,
            )
        c = so.scheduled_cached_reqs
        for rid, blocks, ncomp in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            st = self.requests[rid]
            if rid in c.resumed_req_ids:
                st.block_ids = list(blocks)  # a resumed request gets a whole new block table
                st.token_ids = list(c.all_token_ids[rid])
            else:
                st.block_ids.extend(blocks)
            st.num_computed_tokens = ncomp

    def _use_cpu_kernels(self) -> bool:
        """Whether this step's bfloat16 CPU forward runs minivllm's C++ kernels (``minivllm.custom_ops``)."""
        return (
            self.device.type == "cpu"
            and self.dtype == torch.bfloat16
            and self.model.model.layers[0].self_attn.backend == "sdpa"
            and not torch.is_grad_enabled()  # the kernels have no backward
            and custom_ops.enabled()
            and custom_ops.load()
        )

    def _prepare_inputs(self, so: SchedulerOutput):
        req_ids = list(so.num_scheduled_tokens)
        qlens = [so.num_scheduled_tokens[r] for r in req_ids]
        states = [self.requests[r] for r in req_ids]
        computed = [s.num_computed_tokens for s in states]
        bs = self.block_size
        max_blocks = max(len(s.block_ids) for s in states)
        bt_np = np.zeros((len(req_ids), max_blocks), dtype=np.int64)
        ids_parts, pos_parts = [], []
        for i, s in enumerate(states):
            bt_np[i, : len(s.block_ids)] = s.block_ids
            ids_parts.append(s.token_ids[computed[i] : computed[i] + qlens[i]])
            pos_parts.append(np.arange(computed[i], computed[i] + qlens[i]))
        positions_np = np.concatenate(pos_parts)
        req_of_token = np.repeat(np.arange(len(req_ids)), qlens)
        slot_np = bt_np[req_of_token, positions_np // bs] * bs + positions_np % bs
        qsl = np.zeros(len(req_ids) + 1, dtype=np.int64)
        np.cumsum(qlens, out=qsl[1:])
        seq_lens = [c + q for c, q in zip(computed, qlens)]
        dev = self.device
        t = lambda a: torch.as_tensor(np.asarray(a, dtype=np.int64)).to(dev)  # noqa: E731
        block_table = t(bt_np)
        decode_reqs = [i for i, q in enumerate(qlens) if q == 1]
        prefill_reqs = [i for i, q in enumerate(qlens) if q > 1]
        md = AttentionMetadata(
            query_start_loc=t(qsl),
            seq_lens=t(seq_lens),
            num_computed_tokens=t(computed),
            block_table=block_table,
            slot_mapping=t(slot_np),
            positions=t(positions_np),
            block_size=bs,
            query_lens=qlens,
            seq_lens_list=seq_lens,
            computed_list=computed,
            query_start_list=qsl[:-1].tolist(),
            decode_reqs=decode_reqs,
            prefill_reqs=prefill_reqs,
        )
        if decode_reqs:
            dl = [seq_lens[i] for i in decode_reqs]
            nblk = -(-max(dl) // bs)
            md.decode_token_idx = t(qsl[decode_reqs])
            md.decode_block_table = block_table[decode_reqs, :nblk]
        kernels = self._use_cpu_kernels()
        if prefill_reqs and kernels and self._head_dim in (64, 128) and custom_ops.prefill_kernel_available():
            md.prefill_kernel_args = (
                block_table[prefill_reqs], t(qsl[prefill_reqs]), t([qlens[i] for i in prefill_reqs]),
                t([computed[i] for i in prefill_reqs]),
            )
        if decode_reqs and kernels:
            md.decode_seq_lens = t(dl)  # the kernel reads each request's own blocks: no mask, groups or padding
        elif decode_reqs:
            key_pos = torch.arange(nblk * bs, device=dev)
            md.decode_key_mask = (key_pos[None, :] >= t(dl)[:, None])[:, None, None, :]
            # Each group costs a few more operators; with two threads each operator also costs a barrier, and two
            # groups measured faster than four (one thread: four).
            parts = split_decode_groups(dl, max_groups=4 if torch.get_num_threads() == 1 else 2)
            if len(parts) > 1:
                md.decode_groups = []
                for part in parts:
                    reqs = [decode_reqs[j] for j in part]
                    g_nblk = -(-max(dl[j] for j in part) // bs)
                    g_pos = torch.arange(g_nblk * bs, device=dev)
                    md.decode_groups.append(DecodeGroup(
                        t(qsl[reqs]), block_table[reqs, :g_nblk], g_pos[None, :] >= t([dl[j] for j in part])[:, None]
                    ))
        md.decode_workspace = self._decode_workspace  # kept across steps: a fresh 10-50 MB buffer costs page faults
        input_ids = t(np.concatenate([np.asarray(p, dtype=np.int64) for p in ids_parts]))
        logits_indices = md.query_start_loc[1:] - 1
        discard = [seq_lens[i] < len(states[i].token_ids) for i in range(len(states))]
        return req_ids, states, input_ids, md, logits_indices, discard

    # ---------------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step. Returns ``sampled_token_ids[i] == [tok]``, or ``[]`` for a partial prefill."""
        self._update_states(so)
        finished_sending = finished_recving = None
        if self.connector is not None:
            self.connector.bind_connector_metadata(so.kv_connector_metadata)
            self.connector.start_load_kv(self.kv_caches)
        if so.total_num_scheduled_tokens == 0:
            if self.connector is not None:
                finished_sending, finished_recving = self.connector.get_finished(so.finished_req_ids)
                self.connector.clear_connector_metadata()
            return ModelRunnerOutput([], {}, [], finished_recving, finished_sending)

        req_ids, states, input_ids, md, logits_indices, discard = self._prepare_inputs(so)
        if self.connector is not None:
            conn = self.connector
            self.model.layer_hooks = [lambda layer, kv_cache: conn.save_kv_layer(layer, kv_cache, md)]
        hidden = None
        if (self.graph_runner is not None and self.connector is None and not md.prefill_reqs
                and self.model.model.layers[0].self_attn.backend == "sdpa"):
            hidden = self.graph_runner.run(input_ids, md)  # None when the batch is too large to replay
            if hidden is not None and self.keep_hidden_states:
                hidden = hidden.clone()  # the graph's output buffer is overwritten by the next replay
        if hidden is None:
            try:
                hidden = self.model(input_ids, md.positions, self.kv_caches, md)
            finally:
                self.model.layer_hooks = []
        self._decode_workspace = md.decode_workspace
        if self.connector is not None:
            self.connector.wait_for_save()
            finished_sending, finished_recving = self.connector.get_finished(so.finished_req_ids)
            self.connector.clear_connector_metadata()
        logits = self.model.compute_logits(hidden[logits_indices])

        # Partial prefills are sampled too (simpler than masking them out of the batch, as in vLLM) and their
        # token discarded. A seeded request's generator is restored afterwards, so the discarded draw leaves its
        # random stream untouched: the first real token is the same whether or not the prompt was chunked.
        # (vLLM rewinds the Philox offset on GPU; CPU generators have no offset, so the state is saved instead.)
        saved = {i: states[i].generator.get_state() for i in range(len(states)) if discard[i] and states[i].generator is not None}
        smd = SamplingMetadata(
            params=[s.sampling_params for s in states],
            generators=[s.generator for s in states],
            num_output_tokens=[s.num_output_tokens for s in states],
            eos_token_ids=[s.eos_token_id for s in states],
            all_greedy=all(s.sampling_params.greedy and s.num_output_tokens >= s.sampling_params.min_tokens for s in states),
        )
        sampled = self.sampler(logits, smd)
        for i, state in saved.items():
            states[i].generator.set_state(state)
        sampled_list = sampled.tolist()
        out_ids: List[List[int]] = []
        for i, s in enumerate(states):
            if discard[i]:
                out_ids.append([])
            else:
                s.token_ids.append(sampled_list[i])
                out_ids.append([sampled_list[i]])

        self.last_inputs = StepInputs(
            req_ids=req_ids,
            input_ids=input_ids,
            positions=md.positions,
            query_start_loc=md.query_start_loc,
            seq_lens=md.seq_lens,
            num_computed_tokens=md.num_computed_tokens,
            block_table=md.block_table,
            slot_mapping=md.slot_mapping,
            logits_indices=logits_indices,
            discard_mask=torch.tensor(discard),
            logits=logits if self.keep_logits else None,
            sampled=sampled,
            hidden_states=hidden if self.keep_hidden_states else None,
        )
        return ModelRunnerOutput(
            req_ids, {r: i for i, r in enumerate(req_ids)}, out_ids, finished_recving, finished_sending
        )
