"""The engine: requests in, continuously batched steps, deltas and completions out.

The step loop is an asyncio task; the model runs on one worker thread. With pipelining on, step
N+1 is scheduled and its inputs prepared while step N executes — just before N ends, so that what
arrived during N is in it — and step N's tokens are processed (detokenized, stop-checked,
delivered) while step N+1 executes, so the model thread is not left waiting on Python
bookkeeping between steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.executor.engine.block_manager import BlockManager, KvPools
from services.executor.engine.cpu_share import CpuShare
from shared.preprocess import admitted, check_model, prompt_token_ids
from services.executor.engine.request_state import RequestState
from services.executor.engine.scheduler import Scheduler
from services.executor.engine.sequence import SamplingParams, Sequence
from shared.tokenizer import IncrementalDetokenizer, Tokenizer
from services.executor.engine.sim import SimRunner
from shared.sim_profiles import load_profile
from shared.model_files import load_model_config, tokenizer_dir
from shared.config import EngineConfig
from shared.protocol import Completion, Delta, Error, GenerateRequest, ProtocolError

if TYPE_CHECKING:
    import torch

# torch and the model's modules are imported by an engine that runs a model, not by a simulated
# one (services/executor/engine/sim.py): a simulated executor starts in half a second, not two.

log = logging.getLogger(__name__)

Output = Delta | Completion | Error
JIT_ALPHA = 0.2  # weight of the latest step in the moving average of scheduling times
JIT_STEPS = 8  # the next step is ready by the end of the shortest of this many recent steps
JIT_LEAD_S = 0.0005  # and a margin: the next step is ready this long before the running one ends
OutputSink = Callable[[Output], None]


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0  # tokens run as prefill (recomputation after preemption included)
    decode_tokens: int = 0  # tokens run as decode (one a step per sequence past its prompt)
    generated_tokens: int = 0  # tokens sampled: each decode's, and the last prefill chunk's
    model_busy_s: float = 0.0  # model thread executing steps
    model_idle_s: float = 0.0  # model thread waiting between consecutive steps while work remained
    loop_cpu_s: float = 0.0  # scheduling, input preparation and output processing
    _last_step_end: float | None = field(default=None, repr=False)


@dataclass
class _Step:
    sampling_seqs: list[Sequence]  # in row order of the sampled tokens
    pace_target: float | None  # the step time deadline pacing aimed at (None: unpaced)
    at_floor: bool = False  # paced at the smallest budget
    future: asyncio.Future | None = None
    started: float | None = None  # perf_counter when the model thread began it
    seconds: float = 0.0  # how long the model took (set on the model thread)


def _pick_device(config: EngineConfig) -> torch.device:
    import torch

    if config.model.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.model.device)


def _pick_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    import torch

    if config.model.dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if _native_bf16(config) else torch.float32
    return getattr(torch, config.model.dtype)


def _native_bf16(config: EngineConfig) -> bool:
    """Whether `model.dtype: auto` on a CPU is bf16: where the CPU kernels run with AVX512-BF16
    dot products (Zen 4, Sapphire Rapids and later), with `model.quantization: none`.
    Elsewhere fp32: without the dot products bf16 weights would be widened for every row."""
    if config.model.quantization != "none" or config.model.attention_backend == "triton":
        return False
    from jetserve_kernels.cpu_ops import native_bf16

    return native_bf16()


def _pick_backend(config: EngineConfig, device: torch.device, dtype: torch.dtype):
    """triton on CUDA, torch on a CPU, unless the config names one."""
    name = config.model.attention_backend
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from services.executor.engine.triton_backend import TritonBackend

        block = config.kv_cache.block_size
        if block < 16 or block & (block - 1):  # (the kernels' tiles: else an assert mid-step)
            raise ValueError(f"kv_cache.block_size {block}: the triton attention backend needs "
                             f"a power of two of at least 16")
        return TritonBackend(block, device, dtype)
    from services.executor.engine.attention import TorchBackend

    return TorchBackend(config.kv_cache.block_size, device, dtype)


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        # The one thread that runs torch's parallel work: loading, the KV pool, every step. An
        # OpenMP thread team per calling thread would leave two teams on the cores, and each
        # parallel op then waits ~40 us for its workers to wake instead of ~3 us.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        # Fewer torch threads while other processes keep the cores busy (cpu_share.py): set
        # on a CPU engine below.
        self.cpu_share: CpuShare | None = None
        self._threads_set: int | None = None  # the model thread's count, as it last set it
        simulated = config.model.name.startswith("sim:")
        if simulated:  # no weights, no tensors: the host's clock stands in for the device
            self.device, self.dtype = None, None
            model_config, model_dir = load_model_config(config.model.name)
        else:
            from services.executor.engine.weights import load_model_files

            self.device = _pick_device(config)
            self.dtype = _pick_dtype(config, self.device)
            model_config, weights, model_dir = self.on_model_thread(
                load_model_files, config.model.name, self.device, self.dtype,
                config.model.weights_cache_dir, config.model.quantization)
        self.tokenizer = Tokenizer(tokenizer_dir(model_dir, config.model.weights_cache_dir,
                                                 config.model.tokenizer))
        self.model_config = model_config
        # The KV cache's dtype, by name ("float32" for a simulated engine's accounting).
        self.kv_dtype_name = config.kv_cache.dtype if config.kv_cache.dtype != "auto" else (
            "float32" if self.dtype is None else str(self.dtype).removeprefix("torch."))
        self.model_name = config.model.name
        self.max_model_len = min(config.model.max_model_len or model_config.max_position,
                                 model_config.max_position)
        self.eos_token_id = (self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None
                             else model_config.eos_token_id)
        if simulated:
            profile = load_profile(config.model.name.removeprefix("sim:"))
            num_blocks = config.kv_cache.num_blocks or (
                profile.kv_blocks * 16 // config.kv_cache.block_size if profile.kv_blocks
                else self._blocks_that_fit())
            self.pool_sizes = self._split_pools(num_blocks)
            self.runner = SimRunner(profile, model_config.vocab_size, self.eos_token_id)
            self.matmuls = "simulated"
        else:
            import torch

            from services.executor.engine.model import LlamaModel
            from services.executor.engine.model_runner import ModelRunner

            from services.executor.engine.attention import TorchBackend

            backend = _pick_backend(config, self.device, self.dtype)
            if (self.kv_dtype_name == "bfloat16" and self.dtype != torch.bfloat16
                    and not isinstance(backend, TorchBackend)):
                raise ValueError("kv_cache.dtype bfloat16 under an fp32 or fp16 model runs on the "
                                 "torch backend; with triton, set model.dtype: bfloat16 instead")
            model = self.on_model_thread(LlamaModel, model_config, weights, backend,
                                          self.max_model_len, config.model.quantized_activations,
                                          config.model.amx, config.model.huge_pages)
            self.pool_sizes = self._split_pools(config.kv_cache.num_blocks
                                                or self._blocks_that_fit())
            self.runner = self.on_model_thread(ModelRunner, model, backend, self.pool_sizes[0],
                                                config.kv_cache.block_size,
                                                getattr(torch, self.kv_dtype_name),
                                                self.device, sum(self.pool_sizes[1:]),
                                                config.kv_cache.huge_pages)
            self.on_model_thread(self.runner.warm_up)
            self.matmuls = model.matmuls()
            if self.device.type == "cpu" and config.model.adaptive_threads:
                share = CpuShare(self.on_model_thread(torch.get_num_threads))
                self.cpu_share = share if share.enabled else None  # (no /proc/stat: as set)
        self.kv_pool_dtypes = [self.kv_dtype_name, "int8"][
            :len(self.pool_sizes)]
        if len(self.pool_sizes) == 1:
            self.block_manager = BlockManager(self.pool_sizes[0], config.kv_cache.block_size,
                                              config.kv_cache.enable_prefix_caching)
        else:
            self.block_manager = KvPools(self.pool_sizes, config.kv_cache.block_size,
                                         config.kv_cache.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.batch.max_num_seqs,
                                   config.batch.max_num_batched_tokens,
                                   preemption_margin=config.token_level.preemption_margin,
                                   deadline_pacing=config.token_level.deadline_pacing,
                                   pause_decodes=config.token_level.pause_decodes)
        self.stats = EngineStats()
        self._requests: dict[Hashable, RequestState] = {}
        self._arrivals = itertools.count()
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self.after_step: Callable[[], None] | None = None  # called once each step is scheduled
        self._recent_steps: deque[float] = deque(maxlen=JIT_STEPS)  # the latest steps' times
        self._submit_s = 0.0  # moving average of what scheduling a step takes (s)

    def on_model_thread(self, fn, *args):
        """fn(*args) on the model thread: start-up work, and anything else (a benchmark's direct
        forward passes) that runs torch's parallel ops."""
        def call():
            if self.config.model.num_threads:  # OpenMP's thread count is the calling thread's
                import torch

                torch.set_num_threads(self.config.model.num_threads)
                self._threads_set = None  # (the next step sets cpu_share's again)
            return fn(*args)
        return self._worker.submit(call).result()

    def _kv_bytes_per_block(self, dtype_name: str) -> int:
        import torch

        from services.executor.engine.model_runner import kv_cache_bytes_per_block

        return kv_cache_bytes_per_block(self.model_config, self.config.kv_cache.block_size,
                                        getattr(torch, dtype_name))

    def _blocks_that_fit(self) -> int:
        per_block = self._kv_bytes_per_block(self.kv_dtype_name)
        if self.device is not None and self.device.type == "cuda":
            import torch

            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1 - self.config.kv_cache.gpu_memory_utilization) * total
        else:
            budget = self.config.kv_cache.cpu_cache_gib * 2**30
        # More than every sequence at full length can use is memory for nothing (prefix caching
        # aside): a tiny model would otherwise take the whole budget.
        blocks_per_seq = -(-self.max_model_len // self.config.kv_cache.block_size)
        most_useful = 2 * self.config.batch.max_num_seqs * blocks_per_seq
        return max(2, min(int(budget // per_block), most_useful))

    def _split_pools(self, num_blocks: int) -> list[int]:
        """[blocks] for one pool; with kv_compress_below_priority the memory of `num_blocks`
        blocks in the model's dtype as [its blocks, int8 blocks], split by the compressed
        fraction."""
        fraction = self.config.kv_cache.compressed_fraction
        if self.config.kv_cache.compress_below_priority is None:
            return [num_blocks]
        full = self._kv_bytes_per_block(self.kv_dtype_name)
        budget = num_blocks * full
        compressed = self._kv_bytes_per_block("int8")
        return [max(2, int(budget * (1 - fraction) // full)),
                max(2, int(budget * fraction // compressed))]

    def kv_pool_of(self, priority: int) -> int:
        """0: the model's dtype; 1: the int8 pool, for priorities under the configured bound."""
        below = self.config.kv_cache.compress_below_priority
        return 1 if below is not None and priority < below else 0

    # ------------------------------------------------------------------------------- requests

    def tokenize(self, request: GenerateRequest) -> list[int]:
        return prompt_token_ids(self.tokenizer, request, self.model_config.vocab_size)

    def admit(self, request: GenerateRequest) -> GenerateRequest:
        """What admission does, for a caller with no admission in front of it (run-local,
        tests, `generate`): the request validated, tokenized, within this model's limits, with
        an id and a seed. Raises ProtocolError naming the field or limit."""
        request.check()
        check_model(request, self.model_name)
        return admitted(request, self.tokenize(request), self.model_name, self.max_model_len,
                        self.model_config.vocab_size)

    def add_request(self, request: GenerateRequest, sink: OutputSink, *, key: Hashable = None,
                    arrival_time: float | None = None, score: float | None = None,
                    aging_start: float | None = None,
                    resume_token_ids: list[int] | None = None) -> Hashable:
        """Queue an admitted request (`admit`'s or admission's, trusted as such) under `key`
        (default: its request_id), which `abort` and `output_token_ids` take; its outputs go to
        `sink`, naming its request_id. Raises ProtocolError for what this engine alone can tell:
        the key is running already, the request is not one this engine can run (not admitted,
        another model, token ids past its vocabulary, longer than its context: an executor
        configured unlike admission, or an assignment that never went through admission), or it
        needs more KV blocks than its pool has.

        `resume_token_ids`: the outputs an earlier run of this request had generated (a
        checkpoint from an executor that died). They are taken as this run's first outputs,
        computed as part of the prompt, and generation continues after them; per-token seeds
        make every later token the one an undisturbed run draws. The first delta restates
        them from index 0 (docs/protocol.md: a client keeps only what it does not have).

        `score` orders it against the others (default: its base priority); with `max_wait_s`
        configured, it goes ahead of all others once it has waited that long since
        `aging_start` (monotonic; default: its arrival). With `deadline_ms`
        it ends at arrival + deadline_ms: a `deadline` Completion with what it has generated,
        or a `deadline_exceeded` Error when that is nothing yet."""
        key = request.request_id if key is None else key
        if key in self._requests:
            raise ProtocolError("invalid_request",
                                f"`request_id` {request.request_id!r} is already running")
        prompt = request.prompt_token_ids
        if not prompt or request.seed is None or request.request_id is None:
            raise ProtocolError("invalid_request", "not an admitted request (tokenized, with an "
                                "id and a seed): pass it through Engine.admit")
        if request.model != self.model_name:
            raise ProtocolError("unknown_model", f"admitted for `model` {request.model!r}; this "
                                f"engine serves {self.model_name!r}")
        if max(prompt) >= self.model_config.vocab_size:
            raise ProtocolError("invalid_request", f"`prompt_token_ids` reach past this "
                                f"engine's vocabulary ({self.model_config.vocab_size})")
        if resume_token_ids and not self.valid_checkpoint(resume_token_ids):
            # A checkpoint no run of this model made (a bug, or a forged report): run from the
            # prompt instead (per-token seeds give the same tokens), never embed its ids.
            log.warning("a checkpoint of %s outside the vocabulary dropped (%d tokens)",
                        request.request_id, len(resume_token_ids))
            resume_token_ids = None
        total = len(prompt) + request.max_tokens
        if total > self.max_model_len:
            raise ProtocolError("prompt_too_long", f"prompt + `max_tokens` is {total} tokens, "
                                f"over this engine's max_model_len {self.max_model_len}")
        blocks = -(-total // self.config.kv_cache.block_size)
        pool = self.kv_pool_of(request.priority)
        usable = self.block_manager.pool_size(pool) - self.scheduler.pool_watermarks[pool]
        if blocks > usable:
            raise ProtocolError("prompt_too_long", f"prompt + `max_tokens` needs {blocks} KV blocks;"
                                f" the {'int8 ' if pool else ''}pool has {usable} usable")
        sampling = SamplingParams(
            max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p,
            top_k=request.top_k, min_p=request.min_p,
            seed=request.seed,
            stop=tuple(request.stop), stop_token_ids=frozenset(request.stop_token_ids),
            ignore_eos=request.ignore_eos)
        seq = Sequence(key, list(prompt), sampling, priority=request.priority,
                       score=score, pool=pool,
                       arrival_index=next(self._arrivals),
                       arrival_time=arrival_time if arrival_time is not None else time.monotonic())
        state = self._requests[key] = RequestState(
            seq=seq, request_id=request.request_id, model=self.model_name,
            executor=self.config.executor_name,
            detokenizer=IncrementalDetokenizer(self.tokenizer), eos_token_id=self.eos_token_id,
            max_model_len=self.max_model_len, stream=request.stream, sink=sink)
        # Timers, not checks in the step loop: they cost nothing per step.
        if request.deadline_ms is not None:
            seq.deadline = seq.arrival_time + request.deadline_ms / 1e3
            left = seq.deadline - time.monotonic()
            state.timers.append(asyncio.get_running_loop().call_later(
                max(0.0, left), self._deadline_passed, state, request.deadline_ms))
        if self.config.max_wait_s is not None:
            start = seq.arrival_time if aging_start is None else aging_start
            left = start + self.config.max_wait_s - time.monotonic()
            if left <= 0:
                seq.aged = True
            else:
                state.timers.append(asyncio.get_running_loop().call_later(
                    left, self._aged, state))
        for token in resume_token_ids or ():
            seq.num_pending += 1
            state.append_token(token)
            if state.finish_reason is not None:
                break
        state.first_token_time = None  # this run's first token is the next one it samples
        self.scheduler.add(seq)
        if state.finish_reason is not None:  # the checkpoint had ended it: nothing to run
            self._finish(state)
            return key
        self._wakeup.set()
        return key

    def _aged(self, state: RequestState) -> None:
        if self._requests.get(state.seq.key) is state:
            self.scheduler.age(state.seq)
            self._wakeup.set()

    def _deadline_passed(self, state: RequestState, deadline_ms: float) -> None:
        if self._requests.get(state.seq.key) is not state:
            return
        if state.seq.output_token_ids:
            state.finish_reason = "deadline"
            self._finish(state)
        else:
            self._retire(state)
            state.sink(Error(request_id=state.request_id, code="deadline_exceeded",
                             message=f"`deadline_ms` {deadline_ms:g} passed before the first "
                                     f"token was generated"))
        self._wakeup.set()

    def abort(self, key: Hashable) -> bool:
        """End a request now with finish_reason `cancelled`; False if it is not running here."""
        state = self._requests.get(key)
        if state is None:
            return False
        self._finish(state)
        self._wakeup.set()
        return True

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Output]:
        """Queue a request and yield its deltas (when streaming) and then its Completion."""
        queue: asyncio.Queue[Output] = asyncio.Queue()
        key = self.add_request(self.admit(request), queue.put_nowait)
        try:
            while True:
                output = await queue.get()
                yield output
                if not isinstance(output, Delta):
                    return
        finally:
            if key in self._requests:  # the consumer went away early
                self.abort(key)

    def output_token_ids(self, key: Hashable) -> list[int] | None:
        """The outputs a running request has generated so far (None: not running here)."""
        state = self._requests.get(key)
        return None if state is None else state.seq.output_token_ids

    def valid_checkpoint(self, token_ids: list[int]) -> bool:
        """Whether a checkpoint's outputs are this model's tokens (ids within its vocabulary)."""
        vocab = self.model_config.vocab_size
        return all(0 <= t < vocab for t in token_ids)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------------------ step loop

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")
            self._loop_task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task) -> None:
        """The step loop ended other than by stop(): a bug outside the parts that catch their
        own. Every request here is answered (none left held, reported as running, forever)
        and the loop starts again."""
        if task.cancelled() or task is not self._loop_task:
            return
        exc = task.exception()
        log.error("the step loop failed", exc_info=exc)
        try:
            self._fail_all(f"the step loop failed: {exc!r}")
        except Exception:
            log.exception("failing the requests failed")
        finally:
            self._loop_task = None
            self.start()

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            self._loop_task = None
        self._worker.shutdown(wait=True)

    async def __aenter__(self) -> Engine:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def _run(self) -> None:
        in_flight: _Step | None = None
        while True:
            if in_flight is not None:
                await self._until_nearly_done(in_flight)
            started = time.perf_counter()
            try:
                step = self._submit_step()
            except Exception as exc:  # a bug: fail what runs, keep serving (as for a model step)
                log.exception("scheduling a step failed")
                if in_flight is not None:
                    await asyncio.wait([in_flight.future])
                    in_flight.future.exception()  # (retrieved: its requests fail below)
                self._fail_all(f"scheduling a step failed: {exc!r}")
                in_flight = None
                continue
            submit_s = time.perf_counter() - started
            self.stats.loop_cpu_s += submit_s
            self._submit_s += JIT_ALPHA * (submit_s - self._submit_s)
            if step is not None and not self.config.token_level.pipeline:
                in_flight, step = step, None
            processed = in_flight is not None
            if in_flight is not None:
                try:
                    sampled = await in_flight.future
                except Exception as exc:  # a bug, not bad input: fail loudly, keep serving
                    log.exception("model step failed")
                    if step is not None:  # it read the failed step's state: drop it too
                        await asyncio.wait([step.future])
                        step.future.exception()
                    self._fail_all(f"model step failed: {exc!r}")
                    in_flight = None
                    continue
                try:
                    self.scheduler.step_done(in_flight.seconds, in_flight.pace_target,
                                             in_flight.at_floor)
                    self._recent_steps.append(in_flight.seconds)
                    started = time.perf_counter()
                    self._process(in_flight, sampled)
                    self.stats.loop_cpu_s += time.perf_counter() - started
                except Exception as exc:  # a bug: as for a failed model step
                    log.exception("processing a step's outputs failed")
                    if step is not None:
                        await asyncio.wait([step.future])
                        step.future.exception()
                    self._fail_all(f"processing a step's outputs failed: {exc!r}")
                    in_flight = None
                    continue
                # Awaiting a future that is already done does not yield: let other tasks run.
                await asyncio.sleep(0)
            in_flight = step
            if step is None and not processed:
                # Nothing ran and nothing can: wait for a new request or an abort.
                self.stats._last_step_end = None  # idle by choice is not a pipeline bubble
                self._wakeup.clear()
                await self._wakeup.wait()

    async def _until_nearly_done(self, step: _Step) -> None:
        """Pipelining, just in time: schedule the next step shortly before the running one
        ends (by the shortest of the last few steps, less twice what scheduling takes), not as
        it starts. The model thread still finds the next step ready, and a request that arrives
        meanwhile is in it: it waits for one step fewer (on a simulated H100 at full batch,
        ~18 ms less TTFT)."""
        if step.future.done() or not self._recent_steps:
            return
        begun = step.started if step.started is not None else time.perf_counter()
        shortest = min(self._recent_steps)
        wait = begun + shortest - 2 * self._submit_s - JIT_LEAD_S - time.perf_counter()
        if wait > 0:
            await asyncio.wait([step.future], timeout=wait)

    def _submit_step(self) -> _Step | None:
        if not self.scheduler.has_work():
            return None
        now = time.monotonic()
        target = self.scheduler.pace_target(now) if self.scheduler.deadline_pacing else None
        batch = self.scheduler.schedule(target)
        if not batch:
            return None
        for item in batch:
            state = self._requests[item.seq.key]
            if state.first_scheduled_time is None:
                state.first_scheduled_time = now
            if item.samples and item.num_new_tokens == 1:
                self.stats.decode_tokens += 1
            else:
                self.stats.prompt_tokens += item.num_new_tokens
        inputs = self.runner.prepare(batch)
        sampling = [item.seq for item in batch if item.samples]
        step = _Step(sampling, target, self.scheduler.at_floor)
        step.future = asyncio.wrap_future(self._worker.submit(self._execute, inputs, step))
        if self.after_step is not None:
            self.after_step()
        self.stats.generated_tokens += len(sampling)
        return step

    def _execute(self, inputs, step: _Step) -> list[int]:
        """Model thread."""
        if self.cpu_share is not None:
            self._follow_cpu_share()
        start = step.started = time.perf_counter()
        sampled = self.runner.execute(inputs)
        end = time.perf_counter()
        step.seconds = end - start
        stats = self.stats
        if stats._last_step_end is not None:
            stats.model_idle_s += max(0.0, start - stats._last_step_end)
        stats._last_step_end = end
        stats.model_busy_s += end - start
        stats.steps += 1
        return sampled

    def _follow_cpu_share(self) -> None:
        """Model thread: torch's thread count as `cpu_share` picks it."""
        threads = self.cpu_share.threads()
        if threads != self._threads_set:
            import torch

            if self._threads_set is not None:
                log.info("torch threads: %d of %d (other processes kept %.2f cores busy)",
                         threads, self.cpu_share.most, self.cpu_share.others)
            torch.set_num_threads(threads)
            self._threads_set = threads

    @property
    def torch_threads(self) -> int | None:
        """A CPU engine's thread count for its steps as `cpu_share` picks it (None: no
        cpu_share: model.adaptive_threads off, or not a CPU engine)."""
        return None if self.cpu_share is None else self.cpu_share.current

    def _process(self, step: _Step, sampled: list[int]) -> None:
        for seq, token in zip(step.sampling_seqs, sampled):
            state = self._requests.get(seq.key)
            if state is None or state.seq is not seq:
                continue  # finished earlier (a step past its end, or aborted)
            state.append_token(token)
            self.block_manager.commit_full_blocks(seq)
            if state.finish_reason is not None:
                self._finish(state)
            elif state.stream:
                delta = state.take_delta()
                if delta is not None:
                    state.sink(delta)

    def _fail_all(self, message: str) -> None:
        """End every request with an `internal` Error and start from a clean state."""
        for state in list(self._requests.values()):
            try:
                self._retire(state)
            except Exception:  # (a state a bug left half-made: dropped, still answered)
                log.exception("retiring %s failed", state.request_id)
                self._requests.pop(state.seq.key, None)
                self._forget_seq(state.seq)
            state.sink(Error(request_id=state.request_id, code="internal", message=message))
        self.runner.reset()
        # Blocks are registered when their step is scheduled: the failed steps never wrote them.
        self.block_manager.reset_prefix_cache()

    def _finish(self, state: RequestState) -> None:
        # Its outputs made before it is retired: should making them fail (a bug), it is still
        # here for _fail_all to answer.
        delta = state.take_delta(final=True) if state.stream else None
        completion = state.completion()
        self._retire(state)
        if delta is not None:
            state.sink(delta)
        state.sink(completion)

    def _forget_seq(self, seq) -> None:
        """Out of the scheduler's lists and its blocks back, whatever state a bug left it in."""
        for queue in (self.scheduler.waiting, self.scheduler.running):
            if seq in queue:
                queue.remove(seq)
        if seq.block_table:
            with contextlib.suppress(Exception):
                self.block_manager.free_seq(seq)

    def _retire(self, state: RequestState) -> None:
        """Free everything the engine holds for a request that is ending."""
        self.scheduler.finish(state.seq)
        del self._requests[state.seq.key]
        for timer in state.timers:
            timer.cancel()
