"""Integer helpers (vLLM: ``vllm/utils/math_utils.py``)."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division ``ceil(a / b)`` for integers, e.g. the blocks needed for ``a`` tokens at ``b`` per block.

    Raises ``ZeroDivisionError`` when ``b == 0``.
    """
    return -(-a // b)
