"""Lesson 06's parts (see ``minivllm.course.learner.parts``); filled in by issue 26's lesson work."""
