"""Tests of ``minivllm/course`` and the course's files: exercises, viz, figures, diagrams, slides, notebooks,
READMEs."""
