"""``python -m minivllm.course.grade [NN ...]``: grade the learner's notebooks (see
``minivllm.course.learner.grade``)."""

import sys

from minivllm.course.learner.grade import main

if __name__ == "__main__":
    sys.exit(main())
