"""The serving engine: one thread that owns the decode slots and runs the model.

    engine = Engine(slots, tokenizer, max_queue=64)
    engine.start()
    engine.submit([job])      # from any thread; QueueFullError past --max_queue
    engine.cancel(job)        # a client that went away: its slot is free at the next turn

Each turn of the loop:
  1. drops cancelled jobs (their slots free at once);
  2. admits waiting jobs into free slots and prefills them (in groups of `slots.rows`, the
     batch the mesh's data axis needs), each one's first token sent straight away: a new
     request's time to first token is its prefill plus those admitted before it in the same
     turn, not the running requests' remaining tokens;
  3. runs one decode step for every slot, and sends each running job its next token.
A job that finishes (EOS, a stop string, its max_tokens) gives its slot back in the turn it
finishes, before the next admission. A job that asked for log-probabilities records each
token's (`Job.token_logprobs`), and with echo its prompt's (`Job.prompt_logprobs`, from the
prefill's `score` variant, run for a group when any of its jobs asks); an echo job with
max_tokens 0 finishes at its prefill. The thread sleeps while there is nothing to do.

Events go to each job's `on_event` from this thread; the HTTP layer forwards them to its
event loop. Failures:
  - a device call that fails loses the KV cache (both programs donate it): the slots put an
    empty one in its place (`slots.CacheLostError`), every request that was in it fails (an
    "error" event naming the cause), and the requests waiting, or admitted but not prefilled
    yet, are served on the new cache;
  - an error turning one request's tokens into text (its tokenizer's decode) fails that
    request alone;
  - anything else that escapes the loop ends the thread: every request waiting or running
    fails with the error, `submit` refuses new ones (`EngineStoppedError`), and `failure` says
    why (the HTTP layer answers 500, `/health` 503).
Every counter `status` reports is written and read under the engine's lock.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Sequence

from nnx_zoo.errors import UsageError
from nnx_zoo.serving.scheduler import Event, Job, Sampling, Scheduler, TokenLogprob
from nnx_zoo.serving.slots import MAX_LOGPROBS, CacheLostError, Drawn, PromptScores, Slots
from nnx_zoo.serving.text import TextStream

_log = logging.getLogger(__name__)
GREEDY = Sampling()


class EngineStoppedError(RuntimeError):
    """The engine thread is not running (it failed, or was stopped): nothing is served."""


class Engine:
    def __init__(self, slots: Slots, tokenizer, *, max_queue: int):
        self.slots = slots
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(slots.max_batch, max_queue)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.steps = 0  # decode steps run
        self.prefills = 0  # prefill calls run
        self.peak_running = 0  # most slots busy in one decode step
        self.cancelled = 0  # jobs dropped from a slot (their client went away)
        self.failed = 0  # jobs failed by an error (a device call's, or their own text's)
        self.cache_resets = 0  # KV caches rebuilt after a failed device call
        self.failure: str | None = None  # why the engine thread ended, once it has

    # -- the public side (any thread) ----------------------------------------------------

    def job(
        self,
        prompt: list[int],
        *,
        max_tokens: int,
        sampling: Sampling,
        stop=(),
        ignore_eos: bool = False,
        logprobs: int | None = None,
        echo: bool = False,
        on_event,
    ) -> Job:
        """A job for `submit` (checked: a prompt that fits, with room for max_tokens).
        `logprobs` k: record each token's log-probability and its k most likely alternatives
        (`Job.token_logprobs`); `echo`: the prompt's too (`Job.prompt_logprobs`), and then
        max_tokens may be 0 (the prompt scored, nothing generated)."""
        if not prompt:
            raise UsageError("the prompt is empty")
        if max_tokens < (0 if echo else 1):
            raise UsageError(f"max_tokens={max_tokens} must be >= {0 if echo else 1}")
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise UsageError(f"logprobs={logprobs} must be in [0, {MAX_LOGPROBS}]")
        limit = self.slots.max_seq_len
        if len(prompt) + max_tokens > limit:
            raise UsageError(
                f"this model's maximum context length is {limit} tokens; the prompt has "
                f"{len(prompt)} and max_tokens asks for {max_tokens} more"
            )
        vocab = self.slots.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise UsageError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        eos = None if ignore_eos else self.tokenizer.eos_id
        stream = TextStream(self.tokenizer, max_tokens=max_tokens, stop=stop, eos_id=eos)
        job = Job(list(prompt), sampling, stream, on_event)
        job.logprobs, job.echo = (0 if logprobs is None and echo else logprobs), echo
        return job

    def submit(self, jobs: Sequence[Job]) -> None:
        """Queue `jobs` (one request: all or none). QueueFullError when they do not fit now;
        EngineStoppedError when the engine thread is not running."""
        with self._cond:
            if (stopped := self._stopped()) is not None:
                raise EngineStoppedError(stopped)
            self.scheduler.submit(jobs)
            self._cond.notify()

    def stopped(self) -> str | None:
        """Why nothing is served (the engine thread failed, was stopped or never started),
        or None while it runs."""
        with self._cond:
            return self._stopped()

    def _stopped(self) -> str | None:
        if self.failure is not None:
            return self.failure
        if self._stopping:
            return "the engine is shutting down"
        if self._thread is None or not self._thread.is_alive():
            return "the engine thread is not running"
        return None

    def cancel(self, job: Job) -> None:
        with self._cond:
            job.cancelled = True
            self._cond.notify()

    def status(self) -> dict:
        with self._cond:
            status = dict(
                running=len(self.scheduler.running()),
                waiting=len(self.scheduler.waiting),
                max_batch=self.slots.max_batch,
                max_queue=self.scheduler.max_queue,
                max_seq_len=self.slots.max_seq_len,
                decode_steps=self.steps,
                prefills=self.prefills,
                peak_running=self.peak_running,
                cancelled=self.cancelled,
                failed=self.failed,
                cache_resets=self.cache_resets,
                stopped=self._stopped(),
            )
            traces = dict(self.slots.traces)  # (one C-level copy: the engine may be tracing)
        status["traces"] = {
            " ".join(map(str, k)) if isinstance(k, tuple) else k: v for k, v in traces.items()
        }
        return status

    def start(self) -> Engine:
        self._thread = threading.Thread(target=self._run, name="serving-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()

    def generate(self, prompts: Sequence[list[int]], **options) -> list[TextStream]:
        """Run `prompts` concurrently and wait for them all (tests, scripts); `options` as
        `run_jobs`' (max_tokens, sampling, stop, ignore_eos)."""
        return [job.stream for job in self.run_jobs(prompts, **options)]

    def run_jobs(
        self,
        prompts: Sequence[list[int]],
        *,
        max_tokens: int,
        sampling: Sequence[Sampling] | Sampling = GREEDY,
        stop=(),
        ignore_eos: bool = False,
        logprobs: int | None = None,
        echo: bool = False,
    ) -> list[Job]:
        """`generate`, returning the finished jobs (their log-probabilities, when asked)."""
        if isinstance(sampling, Sampling):
            sampling = [sampling] * len(prompts)
        done: queue.SimpleQueue = queue.SimpleQueue()
        jobs = []
        for prompt, settings in zip(prompts, sampling, strict=True):
            job = self.job(
                prompt,
                max_tokens=max_tokens,
                sampling=settings,
                stop=stop,
                ignore_eos=ignore_eos,
                logprobs=logprobs,
                echo=echo,
                on_event=None,
            )
            job.on_event = functools.partial(_put_last, done, job)
            jobs.append(job)
        self.submit(jobs)
        for _ in jobs:
            job, event = done.get()
            if event.error:
                raise RuntimeError(event.error)
        return jobs

    # -- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 -- the thread's last act: fail everyone
            _log.critical("serving engine: the engine thread failed; nothing is served", exc_info=e)
            with self._cond:
                self.failure = f"the engine stopped: {_one_line(e)}"
        self._fail_everyone()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self.scheduler.has_work():
                    self._cond.wait()
                if self._stopping:
                    return
                self.cancelled += len(self.scheduler.drop_cancelled())
                admitted = self.scheduler.admit()
            rows = self.slots.rows
            for at in range(0, len(admitted), rows):
                self._prefill(admitted[at : at + rows])
            self._decode()

    def _prefill(self, jobs: list[Job]) -> None:
        columns = _sampling_columns([job.sampling for job in jobs])
        try:
            first, scores = self.slots.prefill(
                [j.prompt for j in jobs],
                [j.slot for j in jobs],
                columns,
                score=any(j.echo for j in jobs),
            )
        except Exception as e:  # noqa: BLE001 -- fail these jobs, keep serving the rest
            self._device_failed(jobs, e)
            return
        with self._cond:
            self.prefills += 1
        now = time.perf_counter()
        for row, job in enumerate(jobs):
            job.first_token = now
            if job.echo:
                job.prompt_logprobs = _prompt_logprobs(job, scores, row)
            if job.stream.max_tokens == 0:  # the prompt scored, nothing to generate
                self._finish_empty(job)
            else:
                self._deliver(job, first, row)

    def _decode(self) -> None:
        with self._cond:
            running = self.scheduler.running()
        if not running:
            return
        B = self.slots.max_batch
        tokens, active, sampling = [0] * B, [False] * B, [Sampling()] * B
        for job in running:
            tokens[job.slot], active[job.slot], sampling[job.slot] = (
                job.last_token,
                True,
                job.sampling,
            )
        try:
            out = self.slots.decode(tokens, active, _sampling_columns(sampling))
        except Exception as e:  # noqa: BLE001
            self._device_failed(running, e)
            return
        with self._cond:
            self.steps += 1
            self.peak_running = max(self.peak_running, len(running))
        for job in running:
            if not job.cancelled:
                self._deliver(job, out, job.slot)

    def _deliver(self, job: Job, drawn: Drawn, row: int) -> None:
        """Row `row` of `drawn` is `job`'s next token."""
        token = int(drawn.token[row])
        job.last_token = token
        logprobs = ()
        if job.logprobs is not None:
            top = _pairs(drawn.top_ids[row], drawn.top_logprobs[row], job.logprobs)
            entry = TokenLogprob(token, float(drawn.logprob[row]), top)
            job.token_logprobs.append(entry)
            logprobs = (entry,)
        try:
            delta = job.stream.add(token)
        except Exception as e:  # noqa: BLE001 -- this request's text (its decode): it alone fails
            self._fail([job], e, "turning a request's tokens into text")
            return
        if delta.finish_reason is not None:
            with self._cond:
                self.scheduler.release(job)
        # One event per token, its text possibly empty (held back, or a token with no text):
        # a streaming client sees every token arrive, which is what latency is measured by.
        _send(job, Event(delta.text, delta.finish_reason, job.stream.num_tokens, None, logprobs))

    def _finish_empty(self, job: Job) -> None:
        """A job that asked for no tokens (echo with max_tokens 0): done at its prefill."""
        delta = job.stream.close("length")
        with self._cond:
            self.scheduler.release(job)
        _send(job, Event(delta.text, delta.finish_reason, 0))

    def _device_failed(self, jobs: list[Job], error: Exception) -> None:
        """A prefill or decode call of `jobs` failed. When it took the cache with it, every
        request in the cache fails too: those prefilled before (their first token sent),
        not those admitted this turn whose prefill is still to come."""
        if isinstance(error, CacheLostError):
            with self._cond:
                self.cache_resets += 1
                in_cache = [j for j in self.scheduler.running() if j.first_token is not None]
            jobs = [*jobs, *(j for j in in_cache if j not in jobs)]
        self._fail(jobs, error, "a device call")

    def _fail(self, jobs: list[Job], error: Exception, what: str) -> None:
        _log.error("serving engine: %s failed", what, exc_info=error)
        message = f"the engine failed: {_one_line(error)}"
        with self._cond:
            self.failed += len(jobs)
            for job in jobs:
                self.scheduler.release(job)
        for job in jobs:
            job.stream.finish_reason = "error"
            _send(job, Event("", "error", job.stream.num_tokens, error=message))

    def _fail_everyone(self) -> None:
        """The thread ends (failed, or stopped): no request is left waiting for it."""
        with self._cond:
            message = self._stopped() or "the engine stopped"
            jobs = [*self.scheduler.waiting, *self.scheduler.running()]
            self.scheduler.waiting.clear()
            for job in jobs:
                self.scheduler.release(job)
            self.failed += len(jobs)
        for job in jobs:
            job.stream.finish_reason = "error"
            _send(job, Event("", "error", job.stream.num_tokens, error=message))


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"[:500]


def _send(job: Job, event: Event) -> None:
    try:
        job.on_event(event)
    except Exception:  # noqa: BLE001 -- a consumer gone (its event loop closed): drop it
        _log.debug("serving engine: an event could not be delivered", exc_info=True)


def _put_last(done: queue.SimpleQueue, job: Job, event: Event) -> None:
    if event.finish_reason is not None:
        done.put((job, event))


def _pairs(ids, logprobs, k: int) -> tuple[tuple[int, float], ...]:
    """The first k (id, log-probability) pairs, as Python numbers."""
    return tuple((int(i), float(lp)) for i, lp in zip(ids[:k], logprobs[:k], strict=True))


def _prompt_logprobs(job: Job, scores: PromptScores, row: int) -> list[TokenLogprob]:
    """One entry per prompt token: the first has no log-probability (nothing predicts it);
    token t's is read at column t - 1, which predicts it."""
    k, prompt = job.logprobs, job.prompt
    out = [TokenLogprob(prompt[0], None, ())]
    for t in range(1, len(prompt)):
        top = _pairs(scores.top_ids[row, t - 1], scores.top_logprobs[row, t - 1], k)
        out.append(TokenLogprob(prompt[t], float(scores.logprob[row, t - 1]), top))
    return out


def _sampling_columns(settings: Sequence[Sampling]):
    return (
        [s.temperature for s in settings],
        [s.top_k for s in settings],
        [s.top_p for s in settings],
        [s.seed for s in settings],
    )
