"""Who holds which decode slot, and who waits: the host-side bookkeeping of continuous
batching, with no device work in it (the engine runs it; the tests drive it directly).

Jobs wait in arrival order in a bounded queue (`max_queue` beyond the free slots; a
submission -- one request's jobs, prompts x n of them -- that would overflow it is refused
whole, so a request is all in or all out); `admit` moves
the head of the queue into free slots; a finished or cancelled sequence gives its slot back
at once, for the next `admit`. Cancelling only marks a sequence: the engine thread, which
owns the slots, drops it at its next turn (`drop_cancelled`).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from nnx_zoo.errors import UsageError
from nnx_zoo.serving.text import TextStream


class QueueFullError(Exception):
    """The waiting queue cannot take the submission now (HTTP 503)."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: every token
    top_p: float = 1.0
    seed: int = 0  # uint32


class TokenLogprob(NamedTuple):
    """One token's log-probability and its most likely alternatives (as many as asked)."""

    token: int
    logprob: float | None  # None: a prompt's first token (nothing predicts it)
    top: tuple[tuple[int, float], ...]  # (token id, log-probability), most likely first


@dataclasses.dataclass(frozen=True)
class Event:
    """What a sequence's consumer receives, from the engine thread."""

    text: str
    finish_reason: str | None  # None: more to come
    num_tokens: int  # generated so far
    error: str | None = None  # the engine failed this sequence (finish_reason is "error")
    # The tokens this event adds, with their log-probabilities (a job that asked for them).
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclasses.dataclass(eq=False)
class Job:
    """One choice of one request: a prompt, its budget and settings, and its progress."""

    prompt: list[int]
    sampling: Sampling
    stream: TextStream
    on_event: Callable[[Event], None]
    slot: int | None = None
    last_token: int = 0
    cancelled: bool = False
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    first_token: float | None = None  # when its prefill returned (it is in the KV cache)
    request: int = 0  # the submission it came in (the jobs of one request share it)
    # Log-probabilities: None records none; k records each generated token's and its k most
    # likely alternatives'.
    logprobs: int | None = None
    echo: bool = False  # score the prompt too (`prompt_logprobs`, with `logprobs` alternatives)
    prompt_logprobs: list[TokenLogprob] | None = None  # echo: one per prompt token
    token_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.stream.finish_reason is not None


class Scheduler:
    def __init__(self, max_batch: int, max_queue: int):
        if max_queue < 0:  # the one check of --max_queue (--max_batch: Slots)
            raise UsageError(f"--max_queue={max_queue} must be >= 0")
        self.max_queue = max_queue
        self.waiting: collections.deque[Job] = collections.deque()
        self.slots: list[Job | None] = [None] * max_batch
        self._submissions = 0

    @property
    def capacity(self) -> int:
        """The most jobs that can be running or waiting at once: a request of more can never
        be admitted."""
        return len(self.slots) + self.max_queue

    def submit(self, jobs: Sequence[Job]) -> None:
        # Jobs a free slot will take at the engine's next turn are not waiting for one.
        running = self.running()
        free = len(self.slots) - len(running)
        if len(self.waiting) + len(jobs) > self.max_queue + free:
            requests = len({job.request for job in (*running, *self.waiting)})
            raise QueueFullError(
                f"the server is at capacity: {len(running)} of {len(self.slots)} slots busy and "
                f"{len(self.waiting)} sequences waiting (--max_queue={self.max_queue}), from "
                f"{requests} requests; this request needs room for {len(jobs)} sequences "
                "(prompts x n); retry later"
            )
        self._submissions += 1
        for job in jobs:
            job.request = self._submissions
        self.waiting.extend(jobs)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    def drop_cancelled(self) -> list[Job]:
        """Forget cancelled jobs; returns those that held a slot (now free)."""
        self.waiting = collections.deque(s for s in self.waiting if not s.cancelled)
        dropped = [job for job in self.running() if job.cancelled]
        for job in dropped:
            self.release(job)
        return dropped

    def admit(self) -> list[Job]:
        """Move waiting sequences into free slots, first come first served."""
        admitted = []
        for slot, holder in enumerate(self.slots):
            if holder is not None:
                continue
            while self.waiting and self.waiting[0].cancelled:
                self.waiting.popleft()
            if not self.waiting:
                break
            seq = self.waiting.popleft()
            seq.slot, self.slots[slot] = slot, seq
            admitted.append(seq)
        return admitted

    def release(self, seq: Job) -> None:
        if seq.slot is not None and self.slots[seq.slot] is seq:
            self.slots[seq.slot] = None

    def running(self) -> list[Job]:
        return [s for s in self.slots if s is not None]
