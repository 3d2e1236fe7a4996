"""What both model runners do with a step (vLLM: ``vllm/v1/worker/gpu_model_runner.py``; Model Runner V2's
``vllm/v1/worker/gpu/model_runner.py`` does the same phases its own way).

Per step: update the per-request state and the ``InputBatch``'s block table from the ``SchedulerOutput``
(``_update_states``, each runner's own), build one flattened batch and its ``CommonAttentionMetadata``
(``input_ids``, ``positions``, ``query_start_loc``, ``seq_lens``, ``slot_mapping``, ``block_table``;
``_prepare_inputs``), let the attention backend's builder turn it into the backend's metadata, run the model,
compute logits only at ``logits_indices`` (the last scheduled token of each request): that is ``execute_model``.
Then ``sample_tokens`` samples (``_sample``, each runner's own) and returns one token per request, or ``[]`` for a
request whose step was a partial prefill (``minivllm.request.is_partial_prefill``, decided once per row in
``_prepare_inputs``). The two calls are vLLM 0.32's (``GPUModelRunner.execute_model`` keeps the logits in
``execute_model_state`` and returns ``None``; ``sample_tokens(grammar_output)`` samples from them), so that the
engine core can compute the structured-output bitmask between them; minivllm has no structured output and always
passes ``None``. With ``logprobs`` the
sampled token's logprobs come back too (``ModelRunnerOutput.logprobs``); with ``prompt_logprobs`` the runner also
computes logits at every prompt position of the chunk and keeps their logprobs across chunks in the request's
state until the prompt is done (``_prompt_logprobs``; vLLM's ``in_progress_prompt_logprobs_cpu``).

``ModelRunnerBase`` holds the phases that do not differ between the runners: the KV cache, the block table, the
attention backend, the forward pass, the connector and CUDA-graph hooks. ``ModelRunner`` (``model_runner.py``) is
vLLM's V1 runner, ``ModelRunnerV2`` (``v2/model_runner.py``) its second one; neither derives from the other.
Where minivllm differs from vLLM: vLLM's two runners share no base class (V2 has its own input batch and block
tables); minivllm shares these phases so that the two files show only what V2 changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from minivllm import custom_ops
from minivllm.attention.backend import CommonAttentionMetadata
from minivllm.attention.selector import get_attn_backend
from minivllm.core.sched.output import SchedulerOutput, block_updates
from minivllm.kv_cache_interface import FullAttentionSpec
from minivllm.model.llama import LlamaForCausalLM
from minivllm.outputs import LogprobsEntry, ModelRunnerOutput
from minivllm.request import is_partial_prefill
from minivllm.worker.cuda_graphs import DecodeGraphRunner
from minivllm.worker.input_batch import CachedRequestState, InputBatch, ModelInputs
from minivllm.worker.kv_cache_alloc import allocate_kv_cache
from minivllm.worker.sampler import Sampler, SamplingMetadata, gather_logprobs

if TYPE_CHECKING:
    from minivllm.distributed.kv_transfer.base import KVConnectorBase

__all__ = ["ExecuteModelState", "ModelRunnerBase", "StepInputs"]


@dataclass
class StepInputs:
    """The flattened batch of one step, kept for inspection (``ModelRunner.last_inputs``).

    All tensors are int64. ``T`` = tokens this step, ``R`` = requests this step.

    Attributes:
        req_ids: ``R`` request ids in batch order.
        input_ids, positions, slot_mapping: ``[T]``.
        query_start_loc: ``[R + 1]``.
        seq_lens, num_computed_tokens: ``[R]``.
        block_table: ``[R, max_blocks]`` (padded with the scratch block, ``ModelRunner.scratch_block_id``).
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


@dataclass
class ExecuteModelState:
    """What ``execute_model`` leaves for ``sample_tokens`` (vLLM 0.32 ``ExecuteModelState``, its fields that
    minivllm has): the step's inputs, its logits ``float32 [R, vocab]`` and final hidden states ``[T, hidden]``,
    the finished prompt logprobs, and the connector's finished-transfer sets."""

    scheduler_output: SchedulerOutput
    inputs: ModelInputs
    logits: torch.Tensor
    hidden_states: torch.Tensor
    prompt_logprobs_dict: Dict[str, List[Optional[LogprobsEntry]]]
    finished_sending: Optional[set]
    finished_recving: Optional[set]


class ModelRunnerBase:
    """Owns the model, the paged KV cache tensors and the per-request runner state; the subclasses say how a
    request's state is kept (``_update_states``) and how a row is sampled (``_sample``).

    The attention backend is chosen here, once (``minivllm.attention.selector.get_attn_backend``): its builder
    turns each step's ``CommonAttentionMetadata`` into the backend's metadata, its implementation runs in every
    attention layer of the model.

    Every layer's cache holds ``num_gpu_blocks + 1`` blocks: the last one, ``scratch_block_id``, is never handed out
    by the scheduler. Padding points there: the padding entries of block tables (never read) and the padding rows
    of CUDA-graph batches (which write their keys and values there).

    Args:
        model: a ``LlamaForCausalLM``.
        num_gpu_blocks: blocks per layer that the scheduler hands out; ``None``: the KV cache is allocated later,
            by ``initialize_kv_cache`` (the ``Worker`` does so once the engine core has sized the pool).
        block_size: tokens per block.
        device: torch device of the model and cache.
        seed: seed of the shared generator used by requests without their own ``seed``.
        connector: optional KV connector (worker side).
        attention_backend: a backend name or an ``AttentionBackend`` subclass (``get_attn_backend``), or ``None``
            to choose from device and dtype.
        enforce_eager: never replay CUDA graphs (vLLM's ``enforce_eager``); without it, pure-decode steps on CUDA
            are replayed from graphs when the backend supports them.
    """

    sampler_cls = Sampler

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_gpu_blocks: Optional[int],
        block_size: int,
        device: torch.device,
        seed: int = 0,
        connector: Optional["KVConnectorBase"] = None,
        attention_backend: Any = None,
        enforce_eager: bool = False,
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        self.enforce_eager = enforce_eager
        self.dtype = next(model.parameters()).dtype
        cfg = model.config
        # This rank's heads (all of them on one device; a share under tensor parallelism: QKVParallelLinear).
        attn = model.model.layers[0].self_attn
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.attn_backend = get_attn_backend(self.device, self.dtype, attention_backend, cfg.head_dim)
        self.attn_metadata_builder = self.attn_backend.get_builder_cls()(
            block_size, self.num_heads, self.num_kv_heads, cfg.head_dim, self.dtype, self.device
        )
        self.model.set_attention_backend(self.attn_backend)
        # The norms, SwiGLU and RoPE too (CustomOp): chosen here once, re-applied if another runner changed them.
        self.custom_op_dispatch = (self.device.type, custom_ops.use_cpu_kernels(self.device, self.dtype))
        self.model.set_custom_op_dispatch(*self.custom_op_dispatch)
        self.model.remove_packed_weights()  # float32 fast path: the panels alone, as vLLM keeps its packed copy
        self.requests: Dict[str, CachedRequestState] = {}
        self.kv_caches: List[torch.Tensor] = []
        self.graph_runner: Optional[DecodeGraphRunner] = None
        self.shared_generator = torch.Generator(device=self.device).manual_seed(seed)
        self.sampler = self.sampler_cls(self.shared_generator)
        self.connector = connector
        self.keep_logits = False
        self.keep_hidden_states = False
        # The last step's batch, kept as references; ``last_inputs`` builds the StepInputs only when asked.
        self._last_step: Optional[Tuple[ModelInputs, Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]] = None
        self._last_inputs: Optional[StepInputs] = None
        self.execute_model_state: Optional[ExecuteModelState] = None  # between execute_model and sample_tokens
        if num_gpu_blocks is not None:
            self.initialize_kv_cache(num_gpu_blocks)
            self.capture_model()

    def get_kv_cache_spec(self) -> FullAttentionSpec:
        """What one block of this runner's cache holds (vLLM ``GPUModelRunner.get_kv_cache_spec``)."""
        cfg = self.model.config
        return FullAttentionSpec(self.block_size, self.num_kv_heads, cfg.head_dim,
                                 torch.finfo(self.dtype).bits // 8, cfg.num_hidden_layers)

    def initialize_kv_cache(self, num_gpu_blocks: int) -> None:
        """Allocate every layer's cache of ``num_gpu_blocks`` blocks, plus the scratch block, and the block table
        (vLLM ``GPUModelRunner.initialize_kv_cache``).

        Raises:
            RuntimeError: when called twice.
        """
        if self.kv_caches:
            raise RuntimeError("the KV cache is already allocated")
        cfg = self.model.config
        self.num_gpu_blocks = num_gpu_blocks
        self.scratch_block_id = num_gpu_blocks
        self.max_num_blocks_per_req = min(num_gpu_blocks, -(-cfg.max_position_embeddings // self.block_size))
        self.input_batch = InputBatch(self.block_size, self.max_num_blocks_per_req, self.scratch_block_id)
        shape = (2, num_gpu_blocks + 1, self.block_size, self.num_kv_heads, cfg.head_dim)
        # One tensor per layer: [K|V, block, offset in block, kv head, head dim]. Under tensor parallelism each
        # rank's cache holds its own KV heads only, under the same block ids (the scheduler's block tables).
        # Zeroed; on the CPU paged in as blocks are first written, not at start-up (kv_cache_alloc).
        self.kv_caches = allocate_kv_cache(shape, self.dtype, self.device, cfg.num_hidden_layers)

    def capture_model(self, max_num_seqs: int = 256) -> None:
        """Set up CUDA-graph replay of pure-decode steps of up to ``max_num_seqs`` requests, when this runner
        replays graphs (CUDA, not ``enforce_eager``, a backend that supports them); else nothing.

        Where minivllm differs from vLLM: vLLM's ``capture_model`` captures every batch size at start-up. A
        minivllm graph also fixes the block-table width, a power of two of blocks, so it is captured the first
        time a decode step of that (batch, width) bucket runs (``DecodeGraphRunner``), and replayed after.
        """
        if self.device.type == "cuda" and not self.enforce_eager and self.attn_backend.supports_cudagraph:
            self.enable_decode_graphs(max_batch=max_num_seqs)

    @property
    def last_inputs(self) -> Optional[StepInputs]:
        """The flattened batch of the last step that ran the model, for inspection (``StepInputs``), or ``None``.
        Built from the step's own tensors when read, so that a step no one inspects pays nothing for it."""
        if self._last_inputs is None and self._last_step is not None:
            inputs, logits, sampled, hidden = self._last_step
            cm = inputs.common_attn_metadata
            self._last_inputs = StepInputs(
                req_ids=inputs.req_ids, input_ids=inputs.input_ids, positions=cm.positions,
                query_start_loc=cm.query_start_loc, seq_lens=cm.seq_lens,
                num_computed_tokens=cm.seq_lens - (cm.query_start_loc[1:] - cm.query_start_loc[:-1]),
                block_table=cm.block_table_tensor, slot_mapping=cm.slot_mapping,
                logits_indices=inputs.logits_indices, discard_mask=torch.tensor(inputs.discard),
                logits=logits, sampled=sampled, hidden_states=hidden,
            )
        return self._last_inputs

    @last_inputs.setter
    def last_inputs(self, value: Optional[StepInputs]) -> None:
        self._last_step, self._last_inputs = None, value

    def enable_decode_graphs(self, max_batch: int = 256, emulate: bool = False) -> None:
        """Replay pure-decode steps from CUDA graphs (``minivllm.worker.cuda_graphs``); on by default on CUDA
        unless ``enforce_eager``. Graphs are set up at start-up, as vLLM captures them, so call it before any
        request runs. ``emulate=True`` runs the padded graph inputs eagerly (CPU tests of the padding logic).

        Raises:
            ValueError: if requests are running, the backend cannot be captured, or (without ``emulate``) the
                device is not CUDA.
        """
        if self.requests:
            raise ValueError("enable_decode_graphs must be called before any request runs")
        if self.device.type != "cuda" and not emulate:
            raise ValueError(f"CUDA graphs need a CUDA device, this runner is on {self.device}")
        if not self.attn_backend.supports_cudagraph:
            raise ValueError(f"the {self.attn_backend.get_name()} attention backend does not support CUDA graphs")
        self.graph_runner = DecodeGraphRunner(self.model, self.kv_caches, self.attn_metadata_builder,
                                              self.scratch_block_id, max_batch, self.max_num_blocks_per_req,
                                              emulate=emulate)

    # ---------------------------------------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        """Forget finished requests, add new ones, apply block updates (each runner its own way)."""
        raise NotImplementedError

    def _sample(self, inputs: ModelInputs, logits: torch.Tensor) -> Tuple[torch.Tensor, List[List[int]], List[bool]]:
        """``(sampled int64 [R], out_ids, discarded)``: ``out_ids[i]`` is ``[token]``, or ``[]`` where the row was
        a partial prefill; kept tokens are appended to the runner's own request state."""
        raise NotImplementedError

    def _apply_block_updates(self, so: SchedulerOutput) -> None:
        """The step's new blocks and computed-token counts, into the request states and the block table."""
        for rid, blocks, replace, ncomp in block_updates(so):
            st = self.requests[rid]
            if replace:
                st.block_ids = list(blocks)  # a new request, or a resumed one with a whole new block table
                self.input_batch.add_request(rid, blocks)
            else:
                st.block_ids.extend(blocks)
                self.input_batch.append_blocks(rid, blocks)
            st.num_computed_tokens = ncomp

    @staticmethod
    def _sampling_metadata(states: List[CachedRequestState], **per_row) -> SamplingMetadata:
        """The rows' ``SamplingMetadata``; ``per_row``: ``generators`` (default: each request's own),
        ``seeds``/``positions`` (Model Runner V2).

        Prompt and output token ids (``token_ids[:num_prompt_tokens]`` and the rest, for both runners: a V2
        request resumed with its outputs in its prefill keeps ``num_prompt_tokens`` the prompt's) are passed only
        when a row has a penalty; ``all_greedy`` (the fast path) also needs no row with penalties, a bias or
        logprobs.
        """
        if any(s.sampling_params.needs_penalties for s in states):
            per_row["prompt_token_ids"] = [s.token_ids[:s.num_prompt_tokens] for s in states]
            per_row["output_token_ids"] = [s.token_ids[s.num_prompt_tokens:] for s in states]
        return SamplingMetadata(
            params=[s.sampling_params for s in states],
            generators=per_row.pop("generators", [s.generator for s in states]),
            num_output_tokens=[s.num_output_tokens for s in states],
            eos_token_ids=[s.eos_token_id for s in states],
            all_greedy=all(s.sampling_params.greedy and s.num_output_tokens >= s.sampling_params.min_tokens
                           and not s.sampling_params.needs_processing for s in states),
            **per_row,
        )

    def _prepare_inputs(self, so: SchedulerOutput) -> ModelInputs:
        """The step's flattened batch (vLLM ``GPUModelRunner._prepare_inputs``)."""
        req_ids = list(so.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        qlens = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        computed = np.array([s.num_computed_tokens for s in states], dtype=np.int64)
        qsl = np.zeros(len(req_ids) + 1, dtype=np.int64)
        np.cumsum(qlens, out=qsl[1:])
        # Token j of the batch belongs to request req_indices[j] and sits at its position computed + offset.
        req_indices = np.repeat(np.arange(len(req_ids)), qlens)
        positions = computed[req_indices] + np.arange(qsl[-1]) - qsl[req_indices]
        rows = np.array([self.input_batch.req_id_to_index[r] for r in req_ids], dtype=np.int64)
        block_table = self.input_batch.block_table
        slot_mapping = block_table.compute_slot_mapping(rows, req_indices, positions)
        seq_lens = computed + qlens
        t = lambda a: torch.as_tensor(a).to(self.device)  # noqa: E731
        cm = CommonAttentionMetadata(
            query_start_loc=t(qsl), seq_lens=t(seq_lens), block_table_tensor=t(block_table.gather(rows)),
            slot_mapping=t(slot_mapping), positions=t(positions), query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu_upper_bound=seq_lens.tolist(), num_reqs=len(req_ids),
            num_actual_tokens=int(qsl[-1]), max_query_len=int(qlens.max()), max_seq_len=int(seq_lens.max()),
        )
        ids = [s.token_ids[c : c + q] for s, c, q in zip(states, computed.tolist(), qlens.tolist())]
        return ModelInputs(
            req_ids=req_ids,
            states=states,
            input_ids=t(np.concatenate([np.asarray(x, dtype=np.int64) for x in ids])),
            common_attn_metadata=cm,
            attn_metadata=None,
            logits_indices=cm.query_start_loc[1:] - 1,
            discard=[is_partial_prefill(n, len(s.token_ids)) for n, s in zip(cm.seq_lens_cpu_upper_bound, states)],
        )

    # ---------------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> Optional[ModelRunnerOutput]:
        """The forward pass of one step (vLLM 0.32 ``GPUModelRunner.execute_model``): update the request states,
        build the inputs, run the model and compute the logits of the rows to sample, which wait in
        ``execute_model_state`` for ``sample_tokens``. Returns ``None``, or, for a step that schedules no token, the
        step's whole output (the connector's finished transfers only), as vLLM's does.

        Raises:
            RuntimeError: when the previous step's ``sample_tokens`` has not run.
        """
        if self.execute_model_state is not None:
            raise RuntimeError("execute_model() called again before sample_tokens() took the previous step's logits")
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

        inputs = self._prepare_inputs(so)
        input_ids = inputs.input_ids
        cm = inputs.common_attn_metadata
        if self.model.attn_backend is not self.attn_backend:
            self.model.set_attention_backend(self.attn_backend)  # another engine shares this model
        if self.model.custom_op_dispatch != self.custom_op_dispatch:
            self.model.set_custom_op_dispatch(*self.custom_op_dispatch)
        hidden = None
        if self.graph_runner is not None and self.connector is None and cm.max_query_len == 1:
            hidden = self.graph_runner.run(input_ids, cm)  # None when the batch is too large to replay
            if hidden is not None and self.keep_hidden_states:
                hidden = hidden.clone()  # the graph's output buffer is overwritten by the next replay
        if hidden is None:
            # The backend's metadata, built only for an eager step: a replayed graph has its own.
            md = inputs.attn_metadata = self.attn_metadata_builder.build(cm)
            if self.connector is not None:
                conn = self.connector
                self.model.layer_hooks = [lambda layer, kv_cache: conn.save_kv_layer(layer, kv_cache, md)]
            try:
                hidden = self.model(input_ids, cm.positions, self.kv_caches, md)
            finally:
                self.model.layer_hooks = []
        if self.connector is not None:
            self.connector.wait_for_save()
            finished_sending, finished_recving = self.connector.get_finished(so.finished_req_ids)
            self.connector.clear_connector_metadata()
        prompt_logprobs_dict = self._prompt_logprobs(inputs, hidden)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        self.execute_model_state = ExecuteModelState(so, inputs, logits, hidden, prompt_logprobs_dict,
                                                     finished_sending, finished_recving)
        return None

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: None = None) -> ModelRunnerOutput:
        """Sample the step that ``execute_model`` ran (vLLM 0.32 ``GPUModelRunner.sample_tokens``). Returns
        ``sampled_token_ids[i] == [tok]``, or ``[]`` for a partial prefill.

        Args:
            grammar_output: vLLM's structured-output bitmask, applied to the logits before sampling; minivllm has
                no structured output, so it is always ``None``.

        Raises:
            ValueError: for a ``grammar_output`` other than ``None``.
            RuntimeError: when no ``execute_model`` is waiting for it.
        """
        if grammar_output is not None:
            raise ValueError("grammar_output must be None: minivllm has no structured output")
        state = self.execute_model_state
        if state is None:
            raise RuntimeError("sample_tokens() needs a step run by execute_model() first")
        self.execute_model_state = None
        inputs, logits, hidden = state.inputs, state.logits, state.hidden_states
        req_ids = inputs.req_ids
        sampled, out_ids, discarded = self._sample(inputs, logits)
        row_logprobs = self.sampler.last_logprobs
        logprobs = None
        if any(e is not None for e in row_logprobs):
            logprobs = [None if d else e for e, d in zip(row_logprobs, discarded)]

        self._last_inputs = None
        self._last_step = (inputs, logits if self.keep_logits else None, sampled,
                           hidden if self.keep_hidden_states else None)
        return ModelRunnerOutput(
            req_ids, {r: i for i, r in enumerate(req_ids)}, out_ids, state.finished_recving, state.finished_sending,
            logprobs, state.prompt_logprobs_dict,
        )

    def _prompt_logprobs(self, inputs: ModelInputs, hidden: torch.Tensor) -> Dict[str, List[Optional[LogprobsEntry]]]:
        """Prompt logprobs of this step's prompt chunks (vLLM ``GPUModelRunner._get_prompt_logprobs_dict``).

        For a request with ``prompt_logprobs`` whose chunk covers positions ``[c, c + q)``, the logits at those
        positions give the logprobs of prompt tokens ``c + 1 .. min(c + q, P) - 1`` (``P`` prompt tokens); they
        are appended to ``in_progress_prompt_logprobs`` (which starts with ``None`` for token 0), and the list is
        returned, keyed by request id, by the step whose chunk reaches the end of the prompt. Computed from the
        raw logits (``log_softmax``), as vLLM's sampled logprobs are.

        Such a request never reads the prefix cache (``SamplingParams.skip_reading_prefix_cache``, as in vLLM
        0.32), not even when it resumes after preemption, so every prompt position runs through the model; a
        Model Runner V2 request re-prefilled after preemption computes the list again, and the output side keeps
        the first complete list it got.
        """
        out: Dict[str, List[Optional[LogprobsEntry]]] = {}
        qsl = inputs.common_attn_metadata.query_start_loc_cpu
        seq_lens = inputs.common_attn_metadata.seq_lens_cpu_upper_bound
        for i, (rid, st) in enumerate(zip(inputs.req_ids, inputs.states)):
            k = st.sampling_params.prompt_logprobs
            if k is None or st.prompt_logprobs_done:
                continue
            q = qsl[i + 1] - qsl[i]
            c, P = seq_lens[i] - q, st.num_prompt_tokens
            acc = st.in_progress_prompt_logprobs
            if not acc:
                acc.append(None)  # the first prompt token has no logprob
            acc.extend([None] * (c + 1 - len(acc)))  # positions a prefix-cache hit skipped
            n = min(q, P - 1 - c)
            if n > 0:
                lp = self.model.compute_logits(hidden[qsl[i]:qsl[i] + n]).float().log_softmax(-1)
                targets = torch.tensor(st.token_ids[c + 1:c + 1 + n], dtype=torch.long, device=lp.device)
                acc.extend(gather_logprobs(lp, k, targets))
            if c + q >= P:
                st.prompt_logprobs_done = True
                out[rid] = acc
        return out

