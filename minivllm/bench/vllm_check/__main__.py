import sys

from minivllm.bench.vllm_check.cli import main

sys.exit(main())
