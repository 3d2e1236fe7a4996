"""``python -m minivllm bench serve``: an open-loop load generator against OpenAI-compatible servers
(vLLM 0.32: ``vllm bench serve``, ``vllm/benchmarks/serve.py``).

* ``arrivals.py``: when each request is sent (Poisson or gamma inter-arrival times, seeded);
* ``request_func.py``: one streaming ``/v1/completions`` request, timed token by token on the client;
* ``metrics.py``: TTFT, TPOT, ITL and end-to-end latency percentiles, throughput and goodput of one run;
* ``servers.py``: starting ``python -m minivllm serve`` or ``vllm serve`` as a child process, and stopping it;
* ``plot.py``: latency against request rate, one line per server;
* ``cli.py``: the command line, the sweep over rates and servers, the JSON record.

Open loop means the arrival times are fixed before the run: a slow server does not slow the senders down, so
queueing shows up as latency, as it does for real users.
"""
