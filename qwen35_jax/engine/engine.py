"""The serving engine: a background loop that schedules, dispatches compiled steps, and streams tokens.

Loop, once per step: take new requests and aborts from the inbox, ask the scheduler for a plan, dispatch the prefill
and decode executables (asynchronously: the device queues them), then read back the *previous* step's tokens,
detokenize, check stop conditions and stream. The host work of step i therefore overlaps the device work of step
i+1; a request that stops is simply left out of the next dispatch (its one extra in-flight token is dropped).
"""
from __future__ import annotations

import array
import asyncio
import atexit
import dataclasses
import logging
import os
import queue
import threading
import time
import uuid
import weakref
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from qwen35_jax import env
from qwen35_jax.engine import executor as ex
from qwen35_jax.engine.outputs import CompletionOutput, Logprob, RequestOutput
from qwen35_jax.engine.sampler import init_sampler_state
from qwen35_jax.engine.sampling_params import SamplingParams
from qwen35_jax.engine.scheduler import Request, Scheduler, Status
from qwen35_jax.engine.tokenizer import Tokenizer, eos_token_ids
from qwen35_jax.model.backends import KernelConfig, make_kernels
from qwen35_jax.model.config import ModelConfig, load_config, resolve_dtype
from qwen35_jax.model.hub import resolve_model
from qwen35_jax.model.sharding import DP, Layout, make_mesh
from qwen35_jax.model.state import abstract_snapshots, abstract_state, bytes_per_slot, init_state, nbytes, state_specs
from qwen35_jax.model.weights import abstract_weights, load_or_restore, random_weights, weight_specs

log = logging.getLogger(__name__)
RELEASE_WAIT_S = 0.001      # an idle engine's wait before returning finished requests' resources (_loop)


def token_ids(ids, vocab_size: int) -> list[int]:
    """A prompt's token ids as a list of ints; ValueError unless they are integers in [0, vocab_size). Checked as
    one array, not id by id: a long prompt's ids are on its time to first token."""
    if isinstance(ids, np.ndarray):
        a = ids
        if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
            raise ValueError("prompt token ids must be a flat sequence of integers")
    else:
        try:                      # array.array takes only integers, and copies a list of them in C
            a = np.frombuffer(array.array("q", ids), np.int64)
        except (TypeError, OverflowError) as e:
            raise ValueError(f"prompt token ids must be a flat sequence of integers ({e})") from None
    bad = a[(a < 0) | (a >= vocab_size)]
    if bad.size:
        raise ValueError(f"token ids {bad[:5].tolist()} are outside the vocabulary [0, {vocab_size})")
    return a.tolist()


@dataclasses.dataclass
class EngineArgs:
    """Everything that shapes an engine besides the model directory (named as vLLM's where vLLM has the setting)."""
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1              # replicas, each with its own slots and pages (max_num_seqs each)
    dtype: str = "bfloat16"
    max_model_len: int | None = None         # None: min(max_position_embeddings, 8192)
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    # the most prompt tokens a step that also decodes may prefill (None: the budget the decode rows leave): bounds
    # the time per output token of running requests while a long prompt prefills, at the cost of its TTFT
    decode_prefill_budget: int | None = None
    # with decode_prefill_budget: a step that decodes runs its prefill chunk (one row per replica, in the smallest
    # prefill bucket up to the budget that holds it) and its decode rows as one forward, which reads the weights
    # once for both (docs/long_context.md); not with speculative decoding or decode_steps > 1, whose steps run
    # apart. False: two executables per such step
    mixed_prefill: bool = True
    max_prefill_rows: int = 4
    min_prefill_tokens: int | None = None    # smallest prefill bucket; None: prefill_floor()
    page_size: int = 16
    num_kv_pages: int | None = None          # None: enough for every slot at max_model_len, within memory
    enable_prefix_caching: bool = True       # reuse cached prefixes: K/V pages + GDN state snapshots
    num_state_snapshots: int | None = None   # the prefix cache's GDN snapshots per replica (None: auto_snapshots)
    gpu_memory_utilization: float = 0.9
    decode_steps: int = 1                    # model steps per decode dispatch
    kernel_config: KernelConfig = dataclasses.field(default_factory=KernelConfig)
    compilation_cache_dir: str | None = None  # None: <cache root>/xla ("" disables the persistent cache)
    precompile_threads: int | None = None
    precompile: bool = True                  # False: compile each bucket on first use instead of at start-up
    seed: int = 0
    load_format: str = "auto"                # "dummy": random weights at the config's shapes (benchmarks)
    skip_tokenizer_init: bool = False        # no tokenizer: prompts are token ids, outputs carry no text
    converted_weights_dir: str | None = None  # orbax copy of the re-laid-out weights, saved once, then restored
    revision: str | None = None              # of a Hugging Face repo id model: branch, tag or commit (None: main)
    # {"method": "mtp", "num_speculative_tokens": k}: k drafts per step from the checkpoint's MTP head (vLLM's
    # spelling; docs/speculative.md), k in 1..4; None: one token per step
    speculative_config: dict | None = None

    @property
    def num_speculative_tokens(self) -> int:
        return int(self.speculative_config["num_speculative_tokens"]) if self.speculative_config else 0

    def validate(self):
        checks = [(self.tensor_parallel_size in (1, 2, 4, 8),
                   f"tensor_parallel_size must be 1, 2, 4 or 8, got {self.tensor_parallel_size}"),
                  (self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
                  (self.max_num_batched_tokens >= (self.min_prefill_tokens or 1),
                   f"max_num_batched_tokens must be >= min_prefill_tokens ({self.min_prefill_tokens})"),
                  (self.decode_prefill_budget is None or self.prefill_floor() <= self.decode_prefill_budget
                   <= self.max_num_batched_tokens, f"decode_prefill_budget must be None or within "
                   f"[{self.prefill_floor()} (the smallest prefill bucket), max_num_batched_tokens], got "
                   f"{self.decode_prefill_budget}"),
                  (self.page_size >= 1, "page_size must be >= 1"),
                  (self.num_state_snapshots is None or self.num_state_snapshots >= 0,
                   "num_state_snapshots must be >= 0"),
                  (self.decode_steps >= 1, "decode_steps must be >= 1"),
                  (0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization must be in (0, 1]"),
                  (self.load_format in ("auto", "dummy"), f"load_format must be 'auto' or 'dummy', not "
                   f"{self.load_format!r}"),
                  (isinstance(self.kernel_config, KernelConfig), "kernel_config must be a KernelConfig")]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
        spec = self.speculative_config
        if spec is not None:
            if not isinstance(spec, dict) or spec.get("method") != "mtp" or set(spec) - {"method",
                                                                                       "num_speculative_tokens"}:
                raise ValueError(f"speculative_config must be {{\"method\": \"mtp\", \"num_speculative_tokens\": "
                                 f"k}} (the checkpoint's MTP head drafts), got {spec!r}")
            k = spec.get("num_speculative_tokens")
            if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 4:
                raise ValueError(f"num_speculative_tokens must be an integer in 1..4, got {k!r}")
            if self.decode_steps != 1:
                raise ValueError("speculative decoding runs one verify step per dispatch (decode_steps=1)")

    def prefill_floor(self, platform: str | None = None) -> int:
        """The smallest prefill bucket (tokens per row). Default: 128 on GPU, where a forward of that few tokens
        is bound by reading the weights (on the H200 the weights take as long as ~180 tokens of compute), so
        smaller buckets would only add executables to compile; 32 elsewhere, where compute follows the tokens."""
        if self.min_prefill_tokens is not None:
            return self.min_prefill_tokens
        return min(128 if (platform or jax.default_backend()) == "gpu" else 32, self.max_num_batched_tokens)


def setup_compilation_cache(path: str | None) -> str | None:
    """Turn on JAX's persistent compilation cache at `path` (None: <cache root>/xla, "": off); returns the
    directory in use (the engine keeps its serialized executables under it, in executables/)."""
    if path == "":
        return None
    path = path or os.path.join(env.cache_root(), "xla")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path


def build_engine(model: str, args: EngineArgs | None = None, *, devices=None, weights=None,
                 observer: Observer | None = None) -> Engine:
    """The one way to build an engine: config, checks, mesh, tokenizer, weights, then the engine itself.

    model: a model directory or a Hugging Face repo id (fetched into the HF cache at args.revision; the engine's
    `model_dir` is the directory read). Shapes that tp or the kernels cannot run fail here, before any weight is
    read or anything compiled.
    devices: the devices of the mesh (default: all); weights: already-loaded weights for (model, mesh, dtype)."""
    args = args or EngineArgs()
    args.validate()
    model = resolve_model(model, args.revision)
    cfg = load_config(model)
    layout = Layout.build(cfg, args.tensor_parallel_size)
    kernel_config = args.kernel_config.resolved()
    kernel_config.check(cfg, layout, args.page_size)
    mesh = make_mesh(args.tensor_parallel_size, devices, args.data_parallel_size)
    tokenizer = None if args.skip_tokenizer_init else Tokenizer(model)
    if args.load_format == "dummy" and tokenizer is not None and tokenizer.vocab_size < cfg.vocab_size:
        raise ValueError(f"load_format 'dummy': random weights can sample any of {cfg.vocab_size} ids but the "
                         f"tokenizer in {model} knows {tokenizer.vocab_size}; skip the tokenizer "
                         "(skip_tokenizer_init, --skip-tokenizer-init)")
    dtype = resolve_dtype(args.dtype)
    mtp = args.num_speculative_tokens > 0
    if mtp and cfg.mtp_layers != 1:
        raise ValueError(f"speculative_config method 'mtp' needs the checkpoint's MTP head (mtp_num_hidden_layers "
                         f"= 1 in config.json); this model declares {cfg.mtp_layers}")
    if mtp and jax.process_count() > 1:
        raise ValueError("speculative decoding is not supported in multi-process engines yet")
    if weights is None and args.load_format == "dummy":
        weights = random_weights(cfg, mesh, dtype, seed=args.seed, mtp=mtp)
    elif weights is None:
        weights = load_or_restore(model, cfg, mesh, dtype, args.converted_weights_dir, mtp=mtp)
    leader = None
    if jax.process_count() > 1 and jax.process_index() == 0:
        from qwen35_jax.engine.multihost import Leader
        leader = Leader()
    return Engine(cfg, mesh, layout, weights, dataclasses.replace(args, kernel_config=kernel_config),
                  tokenizer=tokenizer, eos_token_ids=eos_token_ids(model, cfg, tokenizer), observer=observer,
                  leader=leader, model_dir=model)


# Engines whose loop thread was started. One atexit hook stops them all before the interpreter finalizes: a daemon
# thread still running at finalization is killed by pthread_exit the next time it takes the GIL, and when that
# happens inside jaxlib's C++ (a TraceMe's exit, a device-to-host read) the forced unwind hits a noexcept frame and
# aborts the process ("terminate called after throwing an instance of ''", "FATAL: exception not rethrown").
# A WeakSet: the hook keeps no engine alive.
_live_engines: weakref.WeakSet = weakref.WeakSet()
_atexit_lock = threading.Lock()
_atexit_registered = False


def _shutdown_live_engines():
    for engine in list(_live_engines):
        try:
            engine.shutdown()
        except Exception:
            log.exception("engine shutdown at exit failed")


def shutdown_at_exit(engine: Engine):
    """Have `engine` shut down at interpreter exit (called when it starts a thread: its loop, a multi-host
    watchdog). The hook is registered once, on the first call: after jax's own atexit hooks (jax is imported and
    its backend initialized by then), so it runs before them (atexit is LIFO) while the backends still exist."""
    global _atexit_registered
    with _atexit_lock:
        if not _atexit_registered:
            atexit.register(_shutdown_live_engines)
            _atexit_registered = True
        _live_engines.add(engine)


@dataclasses.dataclass(eq=False)
class RequestGroup:
    """A user request: n sequences sharing a prompt; the callback receives cumulative RequestOutputs."""
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    seqs: list[Request]
    callback: Callable[[RequestOutput], None]
    stream: bool = True        # False: the callback gets only the final output (no per-step RequestOutputs)
    detok: list = dataclasses.field(default_factory=list)
    texts: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    cum_logprob: list = dataclasses.field(default_factory=list)
    prompt_logprobs: list | None = None     # filled chunk by chunk from the first sequence's prefill

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


@dataclasses.dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    host_seconds: float = 0.0        # host work per step not hidden behind device work (schedule/build/detok)
    sample_seconds: float = 0.0      # constrained decode: filling the masks and dispatching the sampler
    wait_seconds: float = 0.0        # time blocked reading back tokens (device busy)
    finished: dict = dataclasses.field(default_factory=dict)
    spec_steps: int = 0              # speculative decoding: row-steps verified (each with k drafts)
    mixed_steps: int = 0             # steps whose prefill chunk ran in the decode rows' forward (mixed_prefill)
    spec_accepted: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))   # per position


class Observer:
    """Hooks for metrics (the server exports them to Prometheus); the defaults do nothing."""
    def on_first_token(self, req: Request): ...
    def on_token(self, req: Request, seconds_since_last: float): ...
    def on_finish(self, req: Request): ...


class Engine:
    """The continuous-batching engine over one model on one mesh; build it with `build_engine`."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh, layout: Layout, weights, args: EngineArgs, *, tokenizer=None,
                 eos_token_ids=(), observer: Observer | None = None, leader=None, model_dir: str | None = None):
        """args.kernel_config must be resolved (KernelConfig.resolved). leader: the multi-host leader
        (multihost.Leader) on process 0 of a multi-process job, which publishes every step to the followers.
        model_dir: the directory the model was read from (the server reads generation_config.json there)."""
        self.cfg, self.mesh, self.layout, self.weights, self.args = cfg, mesh, layout, weights, args
        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.observer = observer or Observer()
        self.leader = leader
        self.dtype = resolve_dtype(args.dtype)
        self.dp = args.data_parallel_size
        self.max_model_len = int(args.max_model_len or min(cfg.max_position_embeddings, 8192))
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's context window "
                             f"(max_position_embeddings={cfg.max_position_embeddings})")
        self.kernel_config = args.kernel_config
        self._host_copy_ahead = mesh.devices.flat[0].platform != "cpu"      # see _copy_ahead
        self.kernels = make_kernels(self.kernel_config)
        log.info("kernels %s, tp=%d, dp=%d, platform %s", self.kernel_config, layout.tp, self.dp,
                 jax.default_backend())
        cache_dir = setup_compilation_cache(args.compilation_cache_dir)

        ps = args.page_size
        k = self.spec_tokens = args.num_speculative_tokens
        # a speculative step writes K/V up to 2k - 1 positions past a row's last committed token (verify up to
        # p + k, the chained drafts up to p + m + k - 1): its page table covers them
        self.lookahead = 2 * k
        self.pages_per_seq = -(-(self.max_model_len + self.lookahead) // ps)
        num_slots = args.max_num_seqs
        self.num_snapshots = self._auto_snapshots(num_slots) if args.enable_prefix_caching else 0
        num_pages = args.num_kv_pages or self._auto_pages(num_slots)
        if jax.process_count() > 1:      # every process must build identical shapes: take the smallest pool
            from jax.experimental import multihost_utils
            num_pages = int(np.min(multihost_utils.process_allgather(np.array([num_pages]))))
        self.abstract_state = abstract_state(cfg, layout, num_slots, num_pages, ps, self.dtype, self.dp, mtp=k > 0)
        state = init_state(self.abstract_state, mesh)
        snapshots = (init_state(abstract_snapshots(cfg, self.num_snapshots, self.dtype, self.dp), mesh)
                     if self.num_snapshots else None)
        sstate = init_sampler_state(num_slots, layout.vocab_padded, NamedSharding(mesh, PartitionSpec(DP)), self.dp,
                                    drafts=k)
        low = self.kernel_config.decode_min_rows
        decode_buckets = ex.pow2_buckets(low, max(low, 1 << (num_slots - 1).bit_length()))
        prefill_buckets = [(n, t) for t in ex.pow2_buckets(args.prefill_floor(), args.max_num_batched_tokens)
                           for n in ex.pow2_buckets(1, args.max_prefill_rows) if n * t <= args.max_num_batched_tokens]
        budget = args.decode_prefill_budget
        mixing = bool(budget) and args.mixed_prefill
        if mixing and (k or args.decode_steps != 1):
            log.info("mixed steps are off: speculative decoding and decode_steps > 1 run decode and prefill apart")
            mixing = False
        # one chunk row per replica, of each prefill bucket length up to the budget (a step that cannot mix runs
        # its chunk alone: those buckets must exist)
        self.mixed_shapes = [(1, t) for t in ex.pow2_buckets(args.prefill_floor(), budget)] if mixing else []
        prefill_buckets += [s for s in self.mixed_shapes if s not in prefill_buckets]
        self.executor = ex.Executor(
            cfg, mesh, layout, weights, state, sstate, self.kernels, self.kernel_config,
            weight_specs(abstract_weights(cfg, layout, self.dtype, mtp=k > 0)), state_specs(self.abstract_state),
            pages_per_seq=self.pages_per_seq, decode_buckets=decode_buckets, prefill_buckets=prefill_buckets,
            decode_steps=args.decode_steps, spec_tokens=k, lazy=not args.precompile,
            exe_cache=ex.ExecutableCache(os.path.join(cache_dir, "executables")) if cache_dir else None,
            on_dispatch=leader.publish if leader is not None else None, snapshots=snapshots, mixed=self.mixed_shapes)
        self.scheduler = Scheduler(num_slots=num_slots, num_pages=num_pages, page_size=ps,
                                   max_model_len=self.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                                   decode_buckets=decode_buckets, prefill_buckets=prefill_buckets, dp=self.dp,
                                   num_snapshots=self.num_snapshots, lookahead=self.lookahead,
                                   decode_prefill_budget=budget, mixed=self.mixed_shapes)
        self.precompile_seconds = self.executor.precompile(args.precompile_threads) if args.precompile else None
        self.stats = EngineStats(spec_accepted=np.zeros(k, np.int64))
        self._rng = np.random.default_rng(args.seed)
        self._inbox: queue.Queue = queue.Queue()
        self._groups: dict[str, RequestGroup] = {}
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.error: BaseException | None = None
        self._grammars = None             # structured.Grammars, made for the first constrained request
        self._grammars_lock = threading.Lock()
        if leader is not None:
            leader.watch(self.fail)
            shutdown_at_exit(self)       # engine.shutdown() -> leader.shutdown() stops the watchdog before exit

    def _auto_pages(self, num_slots: int) -> int:
        want = 1 + num_slots * self.pages_per_seq
        dev = next(d for d in self.mesh.devices.flat if d.process_index == jax.process_index())
        stats = dev.memory_stats()
        if not stats or "bytes_limit" not in stats:
            return want
        free = stats["bytes_limit"] * self.args.gpu_memory_utilization - stats.get("bytes_in_use", 0)
        probe = abstract_state(self.cfg, self.layout, num_slots, 1, self.args.page_size, self.dtype)
        fixed = (nbytes(probe) + self.num_snapshots * bytes_per_slot(self.cfg, self.dtype)) / self.layout.tp
        # ^ one replica's state and snapshot pool, split over its tp ranks
        pools = len(self.cfg.attn_layers) + (1 if self.spec_tokens else 0)        # + the MTP layer's
        per_page = 2 * pools * self.layout.kv_heads * self.args.page_size * self.cfg.head_dim * \
            jnp.dtype(self.dtype).itemsize
        sampler = 5 * (num_slots + 1) * self.layout.vocab_padded
        fit = int((free - fixed - sampler) // max(per_page, 1))
        if fit < 2:
            raise ValueError(f"no device memory left for the KV cache ({free / 2**30:.1f} GiB free before state)")
        return min(want, fit)

    def _auto_snapshots(self, num_slots: int) -> int:
        """The prefix cache's snapshot pool: num_state_snapshots, else two per slot (a conversation's last turn and
        one branch point per running request), within a tenth of the device memory left after the weights."""
        if self.args.num_state_snapshots is not None:
            return self.args.num_state_snapshots
        want = 2 * num_slots
        dev = next(d for d in self.mesh.devices.flat if d.process_index == jax.process_index())
        stats = dev.memory_stats()
        if not stats or "bytes_limit" not in stats:
            return want
        free = stats["bytes_limit"] * self.args.gpu_memory_utilization - stats.get("bytes_in_use", 0)
        per = bytes_per_slot(self.cfg, self.dtype) / self.layout.tp
        return max(1, min(want, int(0.1 * free // per)))

    # -- public API ----------------------------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix (vLLM's reset_prefix_cache); False if some were still being restored into a
        request (those stay). Runs on the engine thread when it is running."""
        try:
            return bool(self._on_engine_thread(self.scheduler.reset_prefix_cache))
        except TimeoutError:
            return False

    def state(self):
        """The decoding state (model.state.State: GDN conv / recurrent pools, K / V pages) once the engine has no
        requests, after the finished ones' bookkeeping, whose prefix snapshots are copies that replace these arrays
        (read engine.executor.state just after a generate, and an idle engine may still be replacing it). The arrays
        stay valid until the next request's first step (each step donates the state it replaces): read what you need
        of them before sending more work. Refused while requests are in flight. Runs on the engine thread when it is
        running."""
        return self._on_engine_thread(self._idle_state)

    def _on_engine_thread(self, fn):
        """fn() between the engine thread's steps (here when the thread is not running): its result, or its
        exception raised here."""
        if self._thread is None or not self._thread.is_alive():
            return fn()
        done, result = threading.Event(), []
        self._inbox.put(("call", fn, done, result))
        if not done.wait(timeout=30):
            raise TimeoutError("the engine thread did not answer within 30 s")
        if isinstance(result[0], BaseException):
            raise result[0]
        return result[0]

    def _idle_state(self):
        if self._has_work():
            raise RuntimeError(f"{len(self.scheduler.running) + len(self.scheduler.waiting)} requests are in flight: "
                               "the state is replaced at every step; read it once they have finished")
        self._retire()
        return self.executor.state

    def _retire(self):
        """Give the finished requests' slots, pages and snapshots back, and run their snapshots' copies now rather
        than on the next request's time to first token."""
        self.scheduler.release()
        saves = self.scheduler.take_finished_saves()
        if saves:
            self.executor.run_copies("save", saves)

    def start(self):
        if self._thread is None and not self._stopped:
            shutdown_at_exit(self)
            self._thread = threading.Thread(target=self._run, name="qwen35-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 30.0):
        """Stop the loop thread and wait for it to end (after the step it is reading back, if any), then the
        multi-host leader. Idempotent; also run at interpreter exit for every started engine."""
        if not self._stopped:
            self._stopped = True
            self._inbox.put(None)           # wakes a loop blocked on an empty inbox
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=timeout)
            if thread.is_alive():
                log.warning("engine loop thread did not stop within %.0fs", timeout)
        leader, self.leader = self.leader, None
        if leader is not None:
            leader.shutdown()
        _live_engines.discard(self)

    def fail(self, error: BaseException):
        """End every request with an error, then mark the engine dead (health fails, new requests are refused). In
        that order: a caller waiting on its requests (Engine.generate) sees their "error" outputs before the engine's
        error, instead of racing the callbacks."""
        log.error("engine failed: %s", error)
        for group in list(self._groups.values()):
            for s in group.seqs:
                if not s.finished:
                    s.finish_reason, s.status = "error", Status.FINISHED
            self._groups.pop(group.request_id, None)
            try:
                group.callback(self._output(group, error=True))
            except Exception:
                log.exception("callback failed while reporting the engine error")
        if self.error is None:
            self.error = error

    @property
    def healthy(self) -> bool:
        return self.error is None and not self._stopped and (self._thread is None or self._thread.is_alive())

    def encode_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt: a string (tokenized), token ids, or a {"prompt",
        "prompt_token_ids"} dict; ids are checked against the vocabulary."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer; pass token ids")
            return prompt, token_ids(self.tokenizer.encode(prompt), self.cfg.vocab_size)
        if isinstance(prompt, dict):
            if prompt.get("prompt_token_ids") is not None:
                return prompt.get("prompt"), token_ids(prompt["prompt_token_ids"], self.cfg.vocab_size)
            return self.encode_prompt(prompt["prompt"])
        return None, token_ids(prompt, self.cfg.vocab_size)

    def add_request(self, prompt, params: SamplingParams, callback: Callable[[RequestOutput], None],
                    request_id: str | None = None, stream: bool = True, matchers: list | None = None) -> str:
        """Validate and enqueue; raises ValueError (nothing is enqueued) for a request that can never run.
        stream: the callback gets a cumulative RequestOutput after every step that adds tokens; False: only the
        final one (as vLLM's FINAL_ONLY outputs: no per-step output objects for a caller that waits for the end).
        matchers: with structured outputs, one compiled grammar per sequence (`grammar`), from a caller that
        compiles them on another thread (a server's event loop must not); by default they are compiled here."""
        if not self.healthy:
            raise RuntimeError(f"engine is not running: {self.error!r}")
        text, ids = self.encode_prompt(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len={self.max_model_len} leaves no room "
                             f"to generate")
        budget = self.max_model_len - len(ids)
        max_tokens = min(params.max_tokens or budget, budget)
        self.scheduler.check_fits(len(ids), max_tokens)
        spec = params.structured_outputs
        if spec is None:
            matchers = [None] * params.n
        elif matchers is None:
            matchers = [self.grammar(spec) for _ in range(params.n)]
        elif len(matchers) != params.n:
            raise ValueError(f"{len(matchers)} compiled grammars for n={params.n} sequences")
        request_id = request_id or uuid.uuid4().hex
        seqs = []
        for i, matcher in enumerate(matchers):
            seed = (params.seed + i) % 2**32 if params.seed is not None else int(self._rng.integers(2**32))
            seqs.append(Request(request_id=request_id, prompt_ids=ids, params=params, seed=seed,
                                max_tokens=max_tokens, index=i,
                                matcher=matcher))
        group = RequestGroup(request_id, text, ids, seqs, callback, stream)
        self._inbox.put(("add", group))
        self.start()
        return request_id

    def grammar(self, constraint):
        """A new matcher at the start of a constraint's grammar (StructuredOutputsParams, or llguidance grammar
        text), compiled for one sequence (add_request compiles one per sequence); ValueError where the grammar is
        invalid or the engine cannot constrain. Compiling a large grammar takes a while: a server validates it and
        submits constrained requests off its event loop."""
        if self.tokenizer is None:
            raise ValueError("structured outputs need the tokenizer (this engine skipped it)")
        if self.args.decode_steps != 1:
            raise ValueError(f"structured outputs need decode_steps=1 (each token's mask depends on the one "
                             f"before), this engine runs {self.args.decode_steps}")
        if jax.process_count() > 1:
            raise ValueError("structured outputs are not supported in multi-process engines")
        if self.spec_tokens:
            raise ValueError("structured outputs are not supported with speculative decoding (speculative_config)")
        with self._grammars_lock:
            if self._grammars is None:
                from qwen35_jax.engine.structured import Grammars
                self._grammars = Grammars(self.tokenizer, self.layout.vocab_padded, self.eos_token_ids)
                self.executor.prepare_split()
        return self._grammars.matcher(constraint)

    def abort(self, request_id: str, wait: bool = True):
        """Abort a request; its slot and pages are free when this returns (wait=True, off the engine thread)."""
        done = threading.Event()
        self._inbox.put(("abort", request_id, done))
        if wait and threading.current_thread() is not self._thread and self._thread is not None:
            done.wait(timeout=30)

    def generate(self, prompts, params: list[SamplingParams], use_tqdm: bool = False) -> list[RequestOutput]:
        """Submit all prompts, wait for all (batched by the engine), return outputs in order."""
        results: dict[int, RequestOutput] = {}
        done = threading.Event()
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(prompts), desc="generating", unit="req")

        def make_cb(i):
            def cb(out: RequestOutput):
                if out.finished:
                    results[i] = out
                    if bar is not None:
                        bar.update(1)
                    if len(results) == len(prompts):
                        done.set()
            return cb

        ids = [self.add_request(p, sp, make_cb(i), stream=False) for i, (p, sp) in enumerate(zip(prompts, params))]
        try:
            while not done.wait(0.1):
                # fail() reports every request before it sets the error: once the error is set, done is too
                # unless some request never reached the engine loop (a wait that timed out just before the
                # reports must not raise over them)
                if self.error is not None and not done.is_set():
                    raise RuntimeError("engine loop failed") from self.error
        except KeyboardInterrupt:
            for rid in ids:
                self.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in range(len(prompts))]

    async def generate_async(self, prompt, params: SamplingParams, request_id: str | None = None):
        """Yield cumulative RequestOutputs as tokens arrive; cancelling the iterator aborts the request.
        Works inside any running event loop (a server, Jupyter)."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def deliver(out):
            if not loop.is_closed():
                loop.call_soon_threadsafe(q.put_nowait, out)

        rid = self.add_request(prompt, params, deliver, request_id)
        finished = False
        try:
            while True:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(rid, wait=False)

    # -- the loop ------------------------------------------------------------------------------------------------
    def _run(self):
        try:
            self._loop()
            if self._groups:      # shut down with requests in flight: end them (with an error) instead of hanging
                self.fail(RuntimeError("the engine was shut down"))
        except BaseException as e:   # the loop is dead: fail every request loudly, keep /health honest
            log.exception("engine loop failed")
            if self.leader is not None:          # a collective that lost its peer: say which peer
                from qwen35_jax.engine.multihost import PEER_POLL_SECONDS, PeerLost
                time.sleep(2 * PEER_POLL_SECONDS)        # let the coordination service notice the departure
                try:
                    dead = self.leader.dead_peers()
                except Exception:
                    dead = []
                if dead:
                    e = PeerLost(f"peer process(es) {dead} stopped responding; this multi-process engine cannot "
                                 f"continue ({e})")
            self.fail(e)

    def _has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def _drain_inbox(self, block: bool, timeout: float | None = None):
        while True:
            try:
                msg = self._inbox.get(block=block, timeout=timeout if block else 0)
            except queue.Empty:
                return
            block = False
            if msg is None:
                return
            if msg[0] == "add":
                group = msg[1]
                if group.request_id in self._groups:
                    group.request_id = f"{group.request_id}-{uuid.uuid4().hex[:8]}"
                    for s in group.seqs:
                        s.request_id = group.request_id
                self._groups[group.request_id] = group
                group.texts = [""] * len(group.seqs)
                group.logprobs = [[] if group.seqs[0].params.logprobs is not None else None for _ in group.seqs]
                # as vLLM: a cumulative logprob only for requests that ask for logprobs (others run the lean
                # sampler, which computes none)
                group.cum_logprob = [0.0] * len(group.seqs) if group.seqs[0].params.logprobs is not None else []
                if group.seqs[0].params.prompt_logprobs is not None:
                    group.prompt_logprobs = [None]       # nothing precedes the first prompt token
                group.detok = [self._decoder(s.params) for s in group.seqs]
                for s in group.seqs:
                    self.scheduler.add(s)
            elif msg[0] == "call":                 # _on_engine_thread
                _, fn, done, result = msg
                try:
                    result.append(fn())
                except Exception as e:          # the caller raises it
                    result.append(e)
                done.set()
            elif msg[0] == "abort":
                group = self._groups.get(msg[1])
                if group is not None:
                    for s in group.seqs:
                        if not s.finished:
                            self._finish(s, "abort")
                    self._emit(group)
                    self.scheduler.release()      # an abort frees at once
                msg[2].set()

    def _loop(self):
        pending = None
        while not self._stopped and self.error is None:
            idle = pending is None and not self._has_work()
            if idle and self.scheduler.retired:
                # finished requests' slots, pages and snapshots go back after their last outputs (with other work,
                # schedule() does it first thing): a short wait first lets the callers those outputs woke take the
                # GIL, which this bookkeeping would otherwise hold for up to the 5 ms switch interval
                self._drain_inbox(block=True, timeout=RELEASE_WAIT_S)
                self._retire()
                continue
            self._drain_inbox(block=idle)
            if self._stopped:
                break
            with jax.profiler.StepTraceAnnotation("engine_step", step_num=self.stats.steps):
                t0 = time.perf_counter()
                records = []
                if pending and self._sync_needed(pending):
                    with jax.profiler.TraceAnnotation("process_outputs"):
                        self._process(pending)
                    pending = None      # (never with a multi-host leader: engine.grammar refuses constraints)
                mark = self.leader.stepped if self.leader is not None else 0   # the steps in flight's keys
                if self._has_work():
                    with jax.profiler.TraceAnnotation("schedule"):
                        plan = self.scheduler.schedule()
                    records = self._dispatch(plan)
                self.stats.host_seconds += time.perf_counter() - t0
                if pending:
                    with jax.profiler.TraceAnnotation("process_outputs"):
                        self._process(pending)
                    if self.leader is not None:
                        self.leader.consumed_before(mark)
                records = [(kind, rows, self._sampled(out)) for kind, rows, out in records]
            pending = records or None
        # Stopped with a step in flight (as after every request's last token): read it back, tokens dropped. Waiting
        # for the step alone is not enough where its host copy started at dispatch (_copy_ahead): that copy completes
        # in a callback on an XLA worker thread that takes the GIL, after block_until_ready's waiter may already have
        # returned; run during interpreter finalization, it aborts the process (std::terminate in tstate_ensure).
        for _, _, out in pending or ():
            np.asarray(out)

    def _sync_needed(self, records) -> bool:
        """Must the steps in flight be read back before the next is dispatched? While the split decode steps are
        not compiled and one of them samples a token for a constrained request: its next bitmask is then filled at
        dispatch. With them, the bitmask of a constrained row (which always decodes next: the scheduler never
        preempts) is filled after its model step is dispatched (_sampled). (A speculative step need not be read:
        each row's position and budget are on the device, spec_step.)"""
        if self._grammars is None or self.executor.split_ready:
            return False
        for kind, rows, _ in records:
            for row in rows:
                req = row if kind == "decode" else row[0] if row is not None and row[1] else None
                if req is not None and req.matcher is not None and not req.finished:
                    return True
        return False

    def _stop_ids(self, req) -> list[int]:
        """The token ids that end this request (the engine's EOS unless ignore_eos first, then its stop_token_ids),
        as _append decides."""
        eos = [] if req.params.ignore_eos else sorted(self.eos_token_ids)
        return eos + [t for t in req.params.stop_token_ids if t not in eos]

    def _bitmask(self, rows):
        """The token bitmask of a step's sampling rows (requests or None), or None if none is constrained."""
        return self._grammars.bitmask([None if r is None or r.finished else r.matcher for r in rows])

    def _sampled(self, out):
        """A dispatched step's output; a constrained decode's sampler (a function: executor.run_decode) is
        dispatched here, after the steps before it were read back and its rows' grammars advanced."""
        if callable(out):
            t0 = time.perf_counter()
            with jax.profiler.TraceAnnotation("sample_constrained"):
                out = out()
            self._copy_ahead(out)
            self.stats.sample_seconds += time.perf_counter() - t0
        return out

    def _copy_ahead(self, out):
        """Start the host copy of a step's output behind the step, so reading it in _process costs no round trip.
        Not on the CPU: there is no transfer to hide, and the copy's completion callback takes the GIL on an XLA
        worker thread, which may run while the interpreter finalizes and abort the process."""
        if self._host_copy_ahead:
            out.copy_to_host_async()

    def _dispatch(self, plan) -> list:
        """Dispatch the plan's compiled steps (asynchronously); returns (kind, rows, packed output) records. First
        the snapshots of requests finished since the last dispatch (before their slots are reused), then the
        restores of requests resuming from the prefix cache, the prefill, the chunk-end snapshots, the decode. A
        plan whose prefill has a mixed step's shape runs it and the decode as one mixed step, unless a row needs
        what only the separate steps do (prompt logprobs, a grammar's bitmask)."""
        records = []
        if plan.finished_saves:
            self.executor.run_copies("save", plan.finished_saves)
        if plan.restores:
            with jax.profiler.TraceAnnotation("prefix_restore", rows=len(plan.restores)):
                self.executor.run_copies("restore", plan.restores)
        # the prompt logprobs of a request with n > 1 come from its first sequence's prefill
        lp = any(c.request.params.prompt_logprobs is not None and c.request.index == 0 for c in plan.prefill)
        constrained = self._grammars is not None and any(r.matcher is not None for r in plan.decode)
        if (plan.decode and plan.prefill and plan.prefill_shape in self.mixed_shapes and not lp and not constrained
                and not any(c.request.matcher is not None and c.completes_prompt for c in plan.prefill)):
            with jax.profiler.TraceAnnotation("mixed", rows=len(plan.decode), tokens=plan.prefill_shape[1]):
                (prows, pout), (drows, dout) = self.executor.run_mixed(plan.decode, plan.prefill, plan.prefill_shape)
            records += [self._prefilled(plan, "prefill", prows, pout), self._decoded(plan, drows, dout)]
            if plan.saves:
                self.executor.run_copies("save", plan.saves)
            self.stats.mixed_steps += 1
            self.stats.steps += 1
            return records
        if plan.prefill:
            n, t = plan.prefill_shape
            with jax.profiler.TraceAnnotation("prefill", rows=n, tokens=t):
                rows, out = self.executor.run_prefill(plan.prefill, plan.prefill_shape, prompt_logprobs=lp,
                                                      bitmask=self._bitmask if self._grammars else None)
            records.append(self._prefilled(plan, "prompt_logprobs" if lp else "prefill", rows, out))
        if plan.saves:
            self.executor.run_copies("save", plan.saves)
        if plan.decode:
            with jax.profiler.TraceAnnotation("decode", rows=len(plan.decode)):
                rows, out = self.executor.run_decode(plan.decode, bitmask=self._bitmask if constrained else None,
                                                     stops=self._stop_ids)
            records.append(self._decoded(plan, rows, out))
        self.stats.steps += 1
        return records

    def _prefilled(self, plan, kind: str, rows, out) -> tuple:
        """The plan's prefill is dispatched: its requests' progress, and its record."""
        self._copy_ahead(out)
        for c in plan.prefill:
            c.request.num_computed += c.length
            if c.completes_prompt:
                c.request.num_sampled += 1
            self.stats.prompt_tokens += c.length
        return kind, rows, out

    def _decoded(self, plan, rows, out) -> tuple:
        """The plan's decode is dispatched: its requests' progress (speculative rows advance as read, _process),
        and its record."""
        if not callable(out):
            self._copy_ahead(out)
        k = self.args.decode_steps
        for r in plan.decode:
            if self.spec_tokens:
                r.steps_in_flight += 1
            else:
                r.num_computed += k
                r.num_sampled += k
        return "decode", rows, out

    def _process(self, records):
        """Read back a step's records in dispatch order and stream each one's tokens before waiting for the next: a
        prefill's first tokens go out as soon as the prefill is done, not after the decode dispatched behind it.
        Finished requests' slots and pages (and their prefix-cache snapshots) are returned after every output."""
        for kind, rows, out in records:
            t0 = time.perf_counter()
            out = ex.fetch(out)
            t1 = time.perf_counter()
            self.stats.wait_seconds += t1 - t0
            touched = set()
            if kind == "prompt_logprobs":
                for i, row in enumerate(rows):
                    if row is not None:
                        self._add_prompt_logprobs(row[2], out, i)
            if kind in ("prefill", "prompt_logprobs"):
                for i, row in enumerate(rows):
                    if row is not None and row[1] and not row[0].finished:
                        self._append(row[0], out, (i,) if kind == "prefill" else (i, 0))
                        touched.add(row[0].request_id)
            else:
                for i, req in enumerate(rows):
                    if req is None:
                        continue
                    if self.spec_tokens:        # the tokens this row gained (-1 past them), in the state now
                        req.steps_in_flight -= 1
                        gained = int(np.sum(out.tokens[:, i] >= 0))
                        if req.finished or not gained:
                            continue
                        req.num_computed += gained
                        req.num_sampled += gained
                        self.stats.spec_steps += 1
                        self.stats.spec_accepted[:gained - 1] += 1
                    for k in range(out.tokens.shape[0]):
                        if req.finished or out.tokens[k, i] < 0:
                            break
                        self._append(req, out, (k, i))
                        touched.add(req.request_id)
            for rid in touched:
                group = self._groups.get(rid)
                if group is not None and (group.stream or group.finished):
                    self._emit(group)
            self.stats.host_seconds += time.perf_counter() - t1

    # -- per token -----------------------------------------------------------------------------------------------
    def _decoder(self, params: SamplingParams):
        if self.tokenizer is None:
            return None
        from tokenizers.decoders import DecodeStream
        return DecodeStream(skip_special_tokens=params.skip_special_tokens)

    def _append(self, req: Request, out, idx):
        group = self._groups[req.request_id]
        token = int(out.tokens[idx])
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
            self.observer.on_first_token(req)
        else:
            self.observer.on_token(req, now - req.last_token_time)
        req.last_token_time = now
        req.output_ids.append(token)
        self.stats.generation_tokens += 1
        p = req.params
        i = req.index
        if req.matcher is not None and not req.matcher.consume_token(token):     # the mask allowed it: a bug
            log.error("request %s: token %d breaks its grammar (%s)", req.request_id, token, req.matcher.get_error())
            self._finish(req, "abort")
            return
        if group.logprobs[i] is not None:
            group.logprobs[i].append(self._logprob_entry(out, idx, p.logprobs))
        if group.cum_logprob:
            group.cum_logprob[i] += float(out.logprob[idx])
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
        is_stop_token = token in stop_ids and len(req.output_ids) > p.min_tokens
        if group.detok[i] is not None and not is_stop_token:     # a stop token's text is not part of the output
            piece = group.detok[i].step(self.tokenizer.hf.backend_tokenizer, token)
            if piece:
                group.texts[i] += piece
        if is_stop_token:
            self._finish(req, "stop", token if token in p.stop_token_ids else None)
            return
        if p.stop and len(req.output_ids) > p.min_tokens:
            text = group.texts[i]
            hits = [(text.find(s), s) for s in p.stop if s in text]
            if hits:
                pos, s = min(hits)
                group.texts[i] = text[:pos]
                self._finish(req, "stop", s)
                return
        if req.matcher is not None and req.matcher.is_stopped():     # the grammar is complete: nothing may follow
            self._finish(req, "stop")
        elif len(req.output_ids) >= req.max_tokens:
            self._finish(req, "length")

    def _logprob_entry(self, out, idx, k: int) -> dict[int, Logprob]:
        """The token at out's index idx with its logprob and rank, then the top k alternatives (vLLM's layout)."""
        token = int(out.tokens[idx])
        entry = {token: Logprob(float(out.logprob[idx]), int(out.rank[idx]), self._token_text(token))}
        for rank in range(k):
            t = int(out.top_ids[idx][rank])
            if t not in entry:
                entry[t] = Logprob(float(out.top_logprobs[idx][rank]), rank + 1, self._token_text(t))
        return entry

    def _add_prompt_logprobs(self, chunk, out, i: int):
        """Row i of a prompt-logprobs prefill (`out`: fetched): the entries of the prompt tokens after this chunk's
        positions, appended to its request's (chunks come back in prompt order)."""
        req = chunk.request
        group = self._groups.get(req.request_id)
        if group is None or group.prompt_logprobs is None or req.index != 0:
            return
        k = req.params.prompt_logprobs
        for pos in range(min(chunk.length, req.prompt_len - 1 - chunk.start)):
            group.prompt_logprobs.append(self._logprob_entry(out, (i, 1 + pos), k))

    def _token_text(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.token_to_text(token)

    def _finish(self, req: Request, reason: str, stop_reason=None):
        req.finish_reason, req.stop_reason = reason, stop_reason
        self.scheduler.finish(req, exact=self._state_final(req))
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        self.observer.on_finish(req)

    def _state_final(self, req: Request) -> bool:
        """Does req's state on the device end for good at the tokens the host has read? Not where a speculative
        step dispatched before this finish is still in flight and the device cannot tell that the row ended (a
        stop string, an abort): that step may feed it more tokens. Where the device can tell (its last token is a
        stop it checks, or max_tokens is reached), spec_step keeps nothing more for it."""
        if req.steps_in_flight == 0:
            return True
        if not req.output_ids:
            return False
        n, last = len(req.output_ids), req.output_ids[-1]
        return n >= req.max_tokens or (last in self._stop_ids(req)[:ex.STOP_IDS] and n > req.params.min_tokens)

    def _output(self, group: RequestGroup, error: bool = False) -> RequestOutput:
        outs = []
        for i, s in enumerate(group.seqs):
            text = group.texts[i] if group.texts else ""
            if not s.finished and s.params.stop:     # hold back a tail that may still become a stop string
                hold = max((k for st in s.params.stop for k in range(1, len(st)) if text.endswith(st[:k])),
                           default=0)
                text = text[:len(text) - hold]
            outs.append(CompletionOutput(index=i, text=text, token_ids=list(s.output_ids),
                                         finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                                         logprobs=list(group.logprobs[i]) if group.logprobs and
                                         group.logprobs[i] is not None else None,
                                         cumulative_logprob=group.cum_logprob[i] if group.cum_logprob else None))
        plp = group.prompt_logprobs
        return RequestOutput(request_id=group.request_id, prompt=group.prompt, prompt_token_ids=group.prompt_ids,
                             outputs=outs, finished=group.finished, metrics=_metrics(group),
                             num_cached_tokens=group.seqs[0].num_cached,
                             prompt_logprobs=list(plp) if plp is not None and len(plp) == len(group.prompt_ids)
                             else None)

    def _emit(self, group: RequestGroup):
        out = self._output(group)
        if group.finished:
            self._groups.pop(group.request_id, None)
        try:
            group.callback(out)
        except Exception:      # e.g. the consumer's event loop is gone: drop that request, keep serving the others
            log.warning("output callback of request %s failed; aborting it", group.request_id, exc_info=True)
            for s in group.seqs:
                if not s.finished:
                    self._finish(s, "abort")
            self._groups.pop(group.request_id, None)


def _metrics(group: RequestGroup) -> dict:
    s = group.seqs[0]
    return {"arrival_time": s.arrival_time, "first_scheduled_time": s.first_scheduled_time,
            "first_token_time": s.first_token_time, "last_token_time": s.last_token_time}
