"""AsyncEngine: the continuous-batching loop of an LLMEngine, driven from asyncio.

One background task owns the engine. Each iteration it applies the queued admissions and
aborts (so they take effect between two steps, never during one), then runs `engine.step()` in
a worker thread, so the event loop keeps serving while the model computes; then, on the event
loop and before the next step, the engine's output processor turns what the step computed into
text (stop strings included: a sequence one ends is finished before the next step), and each
request's outputs go to that request's own stream. The step's thread does no text work. LLMEngine is not thread-safe: nothing but this
loop touches it once it is running.

A request's outputs reach its caller through a RequestStream (server/request_stream.py), as
deltas merged while unread. A reader that leaves an output unread for longer than
stream_stall_timeout seconds has its request aborted (its KV blocks freed) and its backlog dropped.
Each request's metrics and access-log counts are a RequestTracker's (server/request_tracker.py).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from ember_cupy.engine_client import ModelInfo, SchedulerStats, model_info_of
from ember_cupy.engine.pooling import PoolingParams
from ember_cupy.outputs import OutputKind, RequestOutput
from ember_cupy.sampling_params import SamplingParams
from ember_cupy.server.access_log import RequestUsage, current_usage
from ember_cupy.server.errors import one_line
from ember_cupy.server.metrics import EngineMetrics
from ember_cupy.server.prepare_workers import (  # noqa: F401 (PrepareTimeoutError: re-exported)
    DEFAULT_PREPARE_TIMEOUT,
    PrepareTimeoutError,
    PrepareWorkers,
)
from ember_cupy.server.request_stream import RequestStream
from ember_cupy.server.request_tracker import RequestTracker

log = logging.getLogger("ember_cupy.server")

# Seconds a stream reader may leave an output unread before its request is aborted: long enough
# for any live client (a reader that keeps up never waits), short enough that a client that
# stops reading but keeps its connection open frees its KV blocks within a minute.
DEFAULT_STREAM_STALL_TIMEOUT = 60.0
# Texts up to this many characters are tokenized (and templated) by their own worker threads, so
# a cheap request never queues behind multi-megabyte ones.
SMALL_TEXT_CHARS = 64 << 10
# Seconds the engine stays idle after start before llguidance's tokenizer is built (see
# _prepare_grammar_tokenizer).
GRAMMAR_TOKENIZER_IDLE_S = 0.5


class EngineState(enum.Enum):
    NEW = "new"
    LOADING = "loading"
    READY = "ready"
    STOPPING = "stopping"
    STOPPED = "stopped"
    DEAD = "dead"


class EngineNotReadyError(RuntimeError):
    """The engine is loading, stopping or stopped: the request cannot be admitted now."""


class EngineDeadError(RuntimeError):
    """The engine loop died; every pending request fails with this."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (max_waiting)."""


# What the event loop asks of the engine loop, applied between two steps.
@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    prompt_token_ids: list[int] | None   # a string prompt's tokens (tokenized off the loop)
    params: SamplingParams | PoolingParams
    priority: int
    cache_salt: str | None
    prompt_index: int
    arrival: float
    stream: RequestStream
    admitted: asyncio.Future              # the add's result for the caller of add_request
    usage: RequestUsage | None = None     # the calling HTTP request's counts (access log)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Stop:
    pass


class AsyncEngine:
    def __init__(self, engine=None, *, factory: Callable[[], object] | None = None,
                 metrics: EngineMetrics | None = None, max_waiting: int | None = None,
                 stream_stall_timeout: float = DEFAULT_STREAM_STALL_TIMEOUT,
                 prepare_timeout: float = DEFAULT_PREPARE_TIMEOUT):
        if (engine is None) == (factory is None):
            raise ValueError("AsyncEngine needs exactly one of engine and factory")
        self.engine = engine
        self._factory = factory
        self.metrics = metrics
        self.max_waiting = max_waiting
        if not stream_stall_timeout > 0:
            raise ValueError(f"stream_stall_timeout must be > 0 seconds, got {stream_stall_timeout}")
        self.stream_stall_timeout = stream_stall_timeout
        if not prepare_timeout > 0:
            raise ValueError(f"prepare_timeout must be > 0 seconds, got {prepare_timeout}")
        self.prepare_timeout = prepare_timeout
        self.state = EngineState.NEW
        self.error: str | None = None
        self._model_info: ModelInfo | None = None
        self._ops: deque[_Add | _Abort | _Stop] = deque()
        self._streams: dict[str, RequestStream] = {}
        self._trackers: dict[str, RequestTracker] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ember-step")
        # tokenizing and chat templates (a 4 MB prompt takes a second or more) and grammar compiles:
        # off the event loop, each kind on its own threads
        self._small_text = PrepareWorkers("ember-text", slow=False)
        self._large_text = PrepareWorkers("ember-large-text", slow=True)
        self._grammar = PrepareWorkers("ember-grammar", slow=True)
        self._ids = itertools.count()
        self._grammar_tokenizer_due = False   # set at start (see _prepare_grammar_tokenizer)

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the engine (in a worker thread, if given a factory) and start the loop."""
        self._wake = asyncio.Event()
        if self.engine is None:
            self.state = EngineState.LOADING
            try:
                self.engine = await asyncio.get_running_loop().run_in_executor(self._executor, self._factory)
            except Exception as exc:
                # a ValueError or OSError is the file's fault and its message says what is wrong
                # (cut short, missing, unsupported): a traceback would only bury it
                self._die(exc, "loading the model failed",
                          traceback=not isinstance(exc, (ValueError, OSError)))
                raise
        if self.max_waiting is None:
            self.max_waiting = getattr(self.engine.config, "max_waiting", None)
        self.state = EngineState.READY
        self.engine.process_in_step = False   # the loop runs process_outputs() on the step's result
        if self.metrics:
            self._watch_engine(self.metrics)
        grammars = getattr(self.engine, "grammars", None)
        self._grammar_tokenizer_due = grammars is not None and grammars.prepared_at_start
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="ember-engine-loop")

    def _prepare_grammar_tokenizer(self) -> None:
        """Build llguidance's tokenizer on a grammar worker, once the engine has been idle for
        GRAMMAR_TOKENIZER_IDLE_S after start. It holds the GIL ~0.2-0.3 s (49k vocabulary): inside
        the first constrained request it stalled every running request once, and built as the
        server said ready it held back the first answers to /health by as much (every start of a
        49k-vocabulary model). A constrained request that comes first builds it itself. A large
        vocabulary's waits for the first constrained request (GrammarCompiler.prepared_at_start)."""
        self._grammar_tokenizer_due = False
        grammars = self.engine.grammars
        self._grammar.submit(lambda _abandoned: grammars.ll_tokenizer)

    async def _wait_for_work(self) -> None:
        """Until an op arrives; meanwhile, the first time the engine has been idle long enough,
        llguidance's tokenizer is built (_prepare_grammar_tokenizer)."""
        if not self._grammar_tokenizer_due:
            await self._wake.wait()
            return
        try:
            await asyncio.wait_for(self._wake.wait(), GRAMMAR_TOKENIZER_IDLE_S)
        except asyncio.TimeoutError:
            self._prepare_grammar_tokenizer()

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Stop admitting; let in-flight requests finish for up to drain_timeout seconds,
        abort the rest, stop the loop and the worker thread."""
        if self.state in (EngineState.READY, EngineState.LOADING):
            self.state = EngineState.STOPPING
        if self._task is not None and not self._task.done():
            deadline = time.monotonic() + max(0.0, drain_timeout)
            while self._streams and time.monotonic() < deadline and not self._task.done():
                await asyncio.sleep(0.02)
            for request_id in list(self._streams):
                self.abort(request_id)
            self._ops.append(_Stop())
            self._wake.set()
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout=30)
            except (TimeoutError, asyncio.CancelledError):
                self._task.cancel()
        if self.state is not EngineState.DEAD:
            self.state = EngineState.STOPPED
        self._executor.shutdown(wait=False)
        for workers in (self._small_text, self._large_text, self._grammar):
            workers.shutdown()

    @property
    def is_ready(self) -> bool:
        return self.state is EngineState.READY

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def scheduler_stats(self) -> SchedulerStats:
        """The engine's queues and KV cache as it last published them (engine_client.py): taken
        after scheduling, so a step being computed shows as running."""
        return self.engine.stats if self.engine is not None else SchedulerStats()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def model_info(self) -> ModelInfo:
        """The engine's model and limits (fixed once loaded: computed once)."""
        if self._model_info is None:
            self._model_info = model_info_of(self.engine)
        return self._model_info

    async def off_loop(self, fn, *args, work_chars: int = 0, **kwargs):
        """fn(*args, **kwargs) in a worker thread (tokenizing, chat templates) while the event loop
        keeps serving: texts of more than SMALL_TEXT_CHARS (work_chars) on threads of their own.
        Refused (EngineOverloadedError) when max_waiting requests wait already, the jobs queued
        for these threads included; PrepareTimeoutError after prepare_timeout seconds. Never
        touches the LLMEngine's state."""
        workers = self._large_text if work_chars > SMALL_TEXT_CHARS else self._small_text
        return await self._prepare(workers, lambda _abandoned: fn(*args, **kwargs))

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids, as add_request would tokenize it (off the loop, as off_loop);
        add_special_tokens=False for a rendered chat prompt."""
        return await self.off_loop(self.engine.tokenize, text, add_special_tokens,
                                   work_chars=len(text))

    async def _prepare(self, workers: PrepareWorkers, job: Callable[[threading.Event], object]):
        """job(abandoned) on workers; a caller that gives up (timeout, cancel) abandons it."""
        self._check_admission(workers)
        return await workers.run(job, self.prepare_timeout)

    # --- requests -------------------------------------------------------------------------
    def _check_state(self) -> None:
        if self.state is EngineState.DEAD:
            raise EngineDeadError(f"the engine is dead: {self.error}")
        if self.state is not EngineState.READY:
            raise EngineNotReadyError(f"the engine is {self.state.value}")

    def _check_admission(self, workers: PrepareWorkers | None = None) -> None:
        """Refuse a request the engine cannot take now; `workers`: those it is about to queue work
        for, whose queued jobs wait ahead of it."""
        self._check_state()
        if self.max_waiting is not None:
            waiting = self._num_really_waiting(workers)
            if waiting >= self.max_waiting:
                if self.metrics:
                    self.metrics.requests_rejected.inc()
                raise EngineOverloadedError(f"the server is overloaded: {waiting} requests are waiting "
                                            f"for a free sequence slot or a worker thread "
                                            f"(max_waiting={self.max_waiting})")

    def _num_really_waiting(self, workers: PrepareWorkers | None = None) -> int:
        """Queued requests (in the scheduler or about to be added) beyond the free sequence slots:
        those the next step cannot start (a burst into an idle server waits for nothing); and the
        jobs queued for slow `workers` or abandoned there and still running. (A request whose preparation
        is done is not refused for those queued behind it, nor a small text for large ones.)"""
        stats = self.scheduler_stats
        queued = stats.num_waiting + sum(1 for op in self._ops if isinstance(op, _Add))
        max_num_seqs = self.model_info().max_num_seqs
        free = max(0, max_num_seqs - stats.num_slots_used) if max_num_seqs else 0
        waiting = max(0, queued - free)
        if workers is not None and workers.slow:   # free sequence slots do not make a worker thread free
            waiting += workers.num_waiting
        return waiting

    async def add_request(self, prompt: str | list[int], params: SamplingParams | PoolingParams | None = None, *,
                          request_id: str | None = None, priority: int = 0, cache_salt: str | None = None,
                          prompt_token_ids: list[int] | None = None, prompt_index: int = 0,
                          add_special_tokens: bool = True) -> RequestStream:
        """Queue a request; returns its stream once the engine has admitted it.
        prompt_token_ids: a string prompt's tokens, as tokenize() gave them (not tokenized again);
        without them add_special_tokens says how it is tokenized (False for a rendered chat prompt).
        prompt_index: its place among the prompts of one HTTP request (the scheduler serves every
        request's first prompt before any request's second).

        Raises ValueError (bad input, from the engine), EngineOverloadedError, PrepareTimeoutError,
        EngineNotReadyError or EngineDeadError.
        """
        self._check_admission()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        arrival = time.monotonic()
        token_ids = prompt_token_ids if isinstance(prompt, str) else None
        if isinstance(prompt, str) and token_ids is None:
            token_ids = await self.tokenize(prompt, add_special_tokens)
        if getattr(params, "structured_outputs", None) is not None:   # off the loop: admission finds it cached
            await self._prepare(self._grammar, lambda abandoned: self.engine.compile_constraint(params, abandoned))
        self._check_admission()   # again: it may have died, begun stopping or filled up meanwhile
        stream = RequestStream(request_id, self)
        admitted = asyncio.get_running_loop().create_future()
        self._ops.append(_Add(request_id, prompt, token_ids, params, priority, cache_salt, prompt_index, arrival,
                              stream, admitted, current_usage()))
        self._wake.set()
        try:
            await admitted
        except asyncio.CancelledError:
            stream.close()  # admitted meanwhile? then abort it; else the add is skipped
            raise
        return stream

    async def generate(self, prompt, params: SamplingParams | None = None, **kwargs) -> AsyncIterator[RequestOutput]:
        """`async for output in engine.generate(prompt, params)`: delta outputs (each carries only
        what is new); aborts if the caller stops early."""
        stream = await self.add_request(prompt, params, **kwargs)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request; takes effect before the next step. Safe to call repeatedly."""
        self._ops.append(_Abort(request_id))
        if self._wake is not None:
            self._wake.set()

    # --- the loop -------------------------------------------------------------------------
    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.engine
        try:
            while True:
                if self._apply_ops():
                    break
                if not engine.has_unfinished_requests():
                    self._wake.clear()
                    if not self._ops:
                        await self._wait_for_work()
                    continue
                computed = await loop.run_in_executor(self._executor, engine.step)
                outputs = engine.process_outputs(computed) if computed else []
                if self.metrics:
                    self.metrics.count_engine_totals(engine.stats)
                    self.metrics.step_computed(engine.last_step_num_tokens)
                self._dispatch(outputs)
        except Exception as exc:  # a failing step: fail everything, report it on /health
            self._die(exc, "the engine loop failed")

    def _apply_ops(self) -> bool:
        """Apply queued admissions and aborts; True when asked to stop."""
        stop = False
        while self._ops:
            op = self._ops.popleft()
            if isinstance(op, _Stop):
                stop = True
            elif isinstance(op, _Abort):
                self._apply_abort(op.request_id)
            else:
                self._apply_add(op)
        return stop

    def _apply_add(self, add: _Add) -> None:
        if add.admitted.done() or add.stream.finished:  # the caller left before admission
            return
        try:
            extra = {} if add.prompt_token_ids is None else {"prompt_token_ids": add.prompt_token_ids}
            self.engine.add_request(add.request_id, add.prompt, add.params, priority=add.priority,
                                    cache_salt=add.cache_salt, arrival_time=add.arrival,
                                    output_kind=OutputKind.DELTA, prompt_index=add.prompt_index, **extra)
        except Exception as exc:  # ValueError: bad input; anything else: reported, not fatal
            add.admitted.set_exception(exc)
            return
        self._streams[add.request_id] = add.stream
        self._trackers[add.request_id] = RequestTracker(add.arrival, add.params, add.usage, self.metrics)
        add.admitted.set_result(None)

    def _apply_abort(self, request_id: str) -> None:
        output = self.engine.abort(request_id)
        stream = self._streams.pop(request_id, None)
        tracker = self._trackers.pop(request_id, None)
        if output is None:
            return
        if tracker:
            tracker.aborted()
        if stream is not None and not stream.finished:
            stream._put(output)  # a server-side abort (shutdown): the reader sees finish_reason "abort"

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for output in outputs:
            tracker = self._trackers.get(output.request_id)
            if tracker:
                tracker.observe(output, now)
            stream = self._streams.get(output.request_id)
            if output.finished:
                self._streams.pop(output.request_id, None)
                self._trackers.pop(output.request_id, None)
            if stream is None:
                continue
            stream._put(output)
            if not output.finished and stream.unread_for(now) > self.stream_stall_timeout:
                self._abort_stalled(stream)

    def _abort_stalled(self, stream: RequestStream) -> None:
        """A reader that stopped reading: abort its request, free what it holds."""
        log.warning("aborting %s: its stream reader took nothing for %.0f s (stream_stall_timeout)",
                    stream.request_id, stream.unread_for(time.monotonic()))
        stream._drop_backlog()
        self._apply_abort(stream.request_id)

    def _watch_engine(self, metrics: EngineMetrics) -> None:
        """/metrics' gauges read the engine's published stats when scraped."""
        info = self.model_info()
        metrics.set_cache_config(info.block_size, info.kv_cache_blocks, info.kv_cache_dtype,
                                 info.enable_prefix_caching)
        metrics.watch(lambda: self.scheduler_stats, lambda: self.state is EngineState.READY)

    def _die(self, exc: BaseException, what: str, traceback: bool = True) -> None:
        self.state = EngineState.DEAD
        self.error = one_line(f"{what}: {type(exc).__name__}: {exc}")
        log.error("%s", self.error, exc_info=exc if traceback else None)
        error = EngineDeadError(self.error)
        for stream in self._streams.values():
            stream._put(error)
        self._streams.clear()
        self._trackers.clear()
        while self._ops:
            op = self._ops.popleft()
            if isinstance(op, _Add) and not op.admitted.done():
                op.admitted.set_exception(error)
