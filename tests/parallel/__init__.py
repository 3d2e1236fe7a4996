"""Tests of tensor parallelism: ``minivllm/distributed/parallel_state.py``, the multiprocess executor and its worker
ranks (spawned processes: about 2.5 minutes on two cores, so kept out of the engine lane)."""
