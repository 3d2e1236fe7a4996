"""The waiting queue: FCFS or priority (vLLM: ``vllm/v1/core/sched/request_queue.py``)."""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from typing import Iterable, Iterator, List

from minivllm.request import Request


class RequestQueue(ABC):
    """Interface shared by both policies. ``prepend_request`` is how preempted requests come back."""

    @abstractmethod
    def add_request(self, request: Request) -> None: ...
    @abstractmethod
    def pop_request(self) -> Request: ...
    @abstractmethod
    def peek_request(self) -> Request: ...
    @abstractmethod
    def prepend_request(self, request: Request) -> None: ...
    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None: ...
    @abstractmethod
    def __len__(self) -> int: ...
    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...

    def __bool__(self) -> bool:
        return len(self) > 0

    def prepend_requests(self, requests: List[Request]) -> None:
        """Put ``requests`` back at the front, keeping their order."""
        for r in reversed(requests):
            self.prepend_request(r)


class FCFSRequestQueue(RequestQueue):
    """First come, first served. A preempted request is put back at the *front* (vLLM ``FCFSRequestQueue``)."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._q.append(request)

    def pop_request(self) -> Request:
        return self._q.popleft()

    def peek_request(self) -> Request:
        if not self._q:
            raise IndexError("peek from an empty queue")
        return self._q[0]

    def prepend_request(self, request: Request) -> None:
        self._q.appendleft(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._q = deque(r for r in self._q if id(r) not in drop)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityRequestQueue(RequestQueue):
    """A heap ordered by ``(priority, arrival_time, request_id)``: lower priority value first.

    ``prepend_request`` is an ordinary push: under priority scheduling a preempted request goes back to its
    place in priority order, not to the front (vLLM ``PriorityRequestQueue``).
    """

    def __init__(self) -> None:
        self._heap: List[Request] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def prepend_requests(self, requests: List[Request]) -> None:
        for r in requests:
            self.add_request(r)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._heap = [r for r in self._heap if id(r) not in drop]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap))


def create_request_queue(policy: str) -> RequestQueue:
    """``"fcfs"`` or ``"priority"``; raises ``ValueError`` otherwise."""
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {policy!r}")
