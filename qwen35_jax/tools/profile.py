"""XLA-profiler workflows: profile a prefill and N decode steps, and start/stop traces on demand (the server).

Command line (prints the table; `python bench/profile.py` takes the same arguments and also records it under
bench/runs/ with command, commit and machine):

    python -m qwen35_jax.tools.profile --config bench/configs/qwen3.5-9b.json --batch 16 --decode-steps 8 --out DIR
    python -m qwen35_jax.tools.profile --model DIR [--random-weights] --batch 4 --out DIR      # a checkpoint
    python -m qwen35_jax.tools.profile --batch 4 --out DIR                                     # the embedded tiny model

It builds an engine sized for the run (`batch` slots, one prefill bucket of `batch` rows x `prompt_len` tokens,
the engine's decode bucket for `batch` rows: padding rows on the null slot past them, as the engine pads up to
KernelConfig.decode_min_rows), runs every step once to compile and warm up, then under `jax.profiler`: one
prefill, `decode_steps` decode steps of one token per row (the engine's compiled executables: model + on-device
sampler, exactly what serving runs), and 5 runs of a large array copy that measure the device copy bandwidth in
the same trace. Each step is a `StepTraceAnnotation` ("prefill", "decode", "copy_bandwidth") that blocks until
the device is done, so every device event belongs to one step. The table is parsed from the trace just written
(`qwen35_jax.tools.profile_trace`; each step's events are resolved to named scopes against the HLO of the executable
that step ran): device time per step, per block type (embed, gdn, attention, mlp, norm+residual, lm_head,
sampling), per scope and per layer, on the mesh's first device, and the decode step's roofline ratio:

    floor = bytes a decode step must move per device (weights read once + GDN recurrent/conv state read and
            written + K/V read for the live context and written for the new token) / copy bandwidth
    copy bandwidth = (bytes read + written) of a donated `x * 2` over a large fp32 array / its median device
                     time in this trace (--copy-mib, default 1024 MiB on GPU, 64 MiB on CPU)
    roofline ratio = floor / decode step time (1.0 = moving only the bytes it must, at copy speed)

Beside the trace, the session dir gets `<step>.hlo.txt` (the optimised HLO of each step) and `profile.json`, so
`load_report(session)` rebuilds the same report anywhere (e.g. on a trace copied back from the GPU machine).

While a profiler session is active, XLA:GPU runs its command buffers (CUDA graphs) op by op (CommandBufferThunk
does so unless --xla_enable_command_buffers_during_profiling), so every kernel is traced as its own event (without
its own `hlo_op` annotation on the H200: profile_trace attributes those by kernel name and launch order), but a
traced step also pays one launch per kernel. The decode step is therefore timed twice: in the trace (device
span) and untraced right after it (back-to-back dispatches, as serving runs them, command buffers on: the slope
of wall time from N to 2N steps); the roofline ratio uses the untraced time and, for reference,
the traced one.

Trace files: `<out>/plugins/profile/<session>/<host>.xplane.pb` (xprof / TensorBoard: `xprof --port 8791 <out>`),
`<host>.trace.json.gz` and `perfetto_trace.json.gz` (https://ui.perfetto.dev, "Open trace file").

On-demand traces, the contract the server (`qwen35_jax.serve`) wires to `POST /start_profile`, `POST
/stop_profile` and `--profiler-port`:

- `start_profile(out_dir, perfetto=True) -> str`: start `jax.profiler.start_trace(out_dir)`; returns out_dir.
  Raises `ProfilerStateError` if a trace started here is running, or if jax refuses to start one (e.g. another
  trace or a remote capture is active); nothing is started then. Thread-safe.
- `stop_profile() -> str`: stop the running trace; returns the session directory written
  (`<out_dir>/plugins/profile/<timestamp>`, holding `*.xplane.pb`, `*.trace.json.gz` and, with perfetto,
  `perfetto_trace.json.gz`). Raises `ProfilerStateError` if no trace was started with `start_profile`.
  `profile_active() -> str | None` says which out_dir is being written.
- `start_profiler_server(port) -> int`: `jax.profiler.start_server(port)`, so xprof / TensorBoard can capture a
  running process on demand ("Capture profile" -> `localhost:<port>`); raises `ProfilerStateError` if a server is
  already running. `stop_profiler_server()` stops it.
- `summarize(trace_dir, hlo_texts=())`: per-block device time of any trace dir (scopes resolved from the given
  `compiled.as_text()` HLO, else from the events' own annotations where the platform provides them).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import threading
import time

from qwen35_jax import env
from qwen35_jax.tools import profile_trace as pt

# ---------------------------------------------------------------------------------------------------------------
# On-demand traces (used by the server and by run_profile)


class ProfilerStateError(RuntimeError):
    """A profiler call that does not fit the current state (already running / not running)."""


_lock = threading.Lock()
_active: dict | None = None          # {"out_dir": ..., "before": set of session dirs}
_server_port: int | None = None


def _sessions(out_dir: str) -> set[str]:
    root = os.path.join(out_dir, "plugins", "profile")
    return {os.path.join(root, d) for d in os.listdir(root)} if os.path.isdir(root) else set()


def profile_active() -> str | None:
    """The out_dir of the trace started with start_profile, or None."""
    return None if _active is None else _active["out_dir"]


def start_profile(out_dir: str, perfetto: bool = True) -> str:
    """Start writing a trace into out_dir. Raises ProfilerStateError if one is already running."""
    import jax
    global _active
    with _lock:
        if _active is not None:
            raise ProfilerStateError(f"a trace is already running (into {_active['out_dir']!r}); stop it first")
        out_dir = os.path.abspath(out_dir)
        os.makedirs(out_dir, exist_ok=True)
        before = _sessions(out_dir)
        try:
            jax.profiler.start_trace(out_dir, create_perfetto_trace=perfetto)
        except RuntimeError as e:       # e.g. a jax.profiler.trace() or a remote capture is running
            raise ProfilerStateError(f"jax.profiler could not start a trace: {e}") from e
        _active = {"out_dir": out_dir, "before": before}
        return out_dir


def stop_profile() -> str:
    """Stop the trace started with start_profile; returns its session dir (<out_dir>/plugins/profile/<ts>)."""
    import jax
    global _active
    with _lock:
        if _active is None:
            raise ProfilerStateError("no trace is running; call start_profile first")
        active, _active = _active, None
        try:
            jax.profiler.stop_trace()
        except RuntimeError as e:       # stopped behind our back (jax.profiler.stop_trace called elsewhere)
            raise ProfilerStateError(f"jax.profiler could not stop the trace: {e}") from e
        new = sorted(_sessions(active["out_dir"]) - active["before"], key=os.path.getmtime)
        if not new:
            raise ProfilerStateError(f"the trace was stopped but no session was written under {active['out_dir']!r}")
        return new[-1]


def start_profiler_server(port: int) -> int:
    """Expose this process to xprof / TensorBoard on-demand capture (`localhost:<port>`)."""
    import jax
    global _server_port
    with _lock:
        if _server_port is not None:
            raise ProfilerStateError(f"the profiler server is already running on port {_server_port}")
        jax.profiler.start_server(port)
        _server_port = port
        return port


def stop_profiler_server():
    import jax
    global _server_port
    with _lock:
        if _server_port is None:
            raise ProfilerStateError("no profiler server is running")
        jax.profiler.stop_server()
        _server_port = None


def summarize(trace_dir: str, hlo_texts=()) -> dict[str, float]:
    """ms of device time per block type over a whole trace (e.g. one taken through the server). hlo_texts: the
    `compiled.as_text()` of the executables that may have run (the server: those of `executor.compiled`)."""
    trace = pt.load_trace(trace_dir)
    return pt.by_block(pt.resolve(trace.events, pt.HloIndex(hlo_texts)))


# ---------------------------------------------------------------------------------------------------------------
# The profile run


@dataclasses.dataclass
class ProfileReport:
    """A profile run read back from its trace: step windows with their (scope-resolved) device events."""
    meta: dict                    # what was run (see run_profile); saved as profile.json beside the trace
    session: str                  # trace session dir
    files: dict                   # xplane / trace_json / perfetto paths
    platform: str                 # "gpu" or "cpu": where the device events came from
    prefill: pt.Window
    decode: list                  # pt.Window per decode step
    copies: list                  # pt.Window per copy run
    outside_ms: float             # device time that fell outside every step (should be ~0)

    @property
    def title(self) -> str:
        return self.meta["title"]

    @property
    def layer_types(self) -> tuple:
        return tuple(self.meta["layer_types"])

    @property
    def floor_bytes(self) -> dict:
        return self.meta["floor_bytes"]

    @property
    def copy_bandwidth(self) -> float:
        """bytes/s: bytes read + written by one copy over the median device span of the copy runs."""
        spans = sorted(w.device_span_ms for w in self.copies)
        return self.meta["copy_bytes"] / (spans[len(spans) // 2] / 1e3)

    @property
    def decode_ms(self) -> float:
        """Median device span of the traced decode steps (includes per-kernel launches: no CUDA graphs)."""
        spans = sorted(w.device_span_ms for w in self.decode)
        return spans[len(spans) // 2]

    @property
    def decode_wall_ms(self) -> float:
        """Untraced decode step: the steady-state time per step of back-to-back dispatches, as the engine runs
        them (slope of wall time from N to 2N steps)."""
        return self.meta["decode_wall_ms"]

    @property
    def floor_ms(self) -> float:
        return sum(self.floor_bytes.values()) / self.copy_bandwidth * 1e3

    @property
    def roofline_ratio(self) -> float:
        """floor / untraced decode step time."""
        return self.floor_ms / self.decode_wall_ms

    @property
    def traced_roofline_ratio(self) -> float:
        return self.floor_ms / self.decode_ms

    def phase_events(self, phase: str) -> list:
        return self.prefill.events if phase == "prefill" else [e for w in self.decode for e in w.events]

    def _per_step(self, phase: str, table: dict) -> dict:
        n = 1 if phase == "prefill" else len(self.decode)
        return {k: v / n for k, v in table.items()}

    def by_block(self, phase: str) -> dict[str, float]:
        """ms per block type (decode: per step)."""
        return self._per_step(phase, pt.by_block(self.phase_events(phase)))

    def by_scope(self, phase: str) -> dict[str, float]:
        """ms per block/sub-scope summed over layers (decode: per step)."""
        return self._per_step(phase, pt.by_scope(self.phase_events(phase)))

    def by_layer(self, phase: str) -> dict[int, dict[str, float]]:
        """{layer: {scope: ms}} (decode: per step)."""
        return {i: self._per_step(phase, d) for i, d in pt.by_layer(self.phase_events(phase)).items()}


STEPS = ("prefill", "decode", "copy_bandwidth")      # the step annotations of a profile run
COPY_RUNS = 5


def load_report(session: str) -> ProfileReport:
    """Read a profile run back from its session dir: the trace, the HLO of each step (`<step>.hlo.txt`) and
    profile.json. Works on any machine, e.g. on a trace copied back from the GPU."""
    session = pt.find_session(session)
    with open(os.path.join(session, "profile.json")) as f:
        meta = json.load(f)
    trace = pt.load_trace(session, STEPS, device=meta["device_id"])
    texts = {}
    for name in STEPS:
        with open(os.path.join(session, f"{name}.hlo.txt")) as f:
            texts[name] = f.read()
    outside = pt.resolve(pt.assign(trace.events, trace.annotations), pt.HloIndex(texts.values()))
    for w in trace.annotations:         # a step ran one executable: resolve its events against that one only
        w.events = pt.resolve(w.events, pt.HloIndex([texts[w.name]]))
    pre, dec, copies = ([w for w in trace.annotations if w.name == n] for n in STEPS)
    if len(pre) != 1 or len(dec) != meta["decode_steps"] or len(copies) != COPY_RUNS:
        raise RuntimeError(f"trace {session} holds {len(pre)} prefill / {len(dec)} decode / {len(copies)} copy "
                           f"step annotations; expected 1 / {meta['decode_steps']} / {COPY_RUNS}")
    empty = [f"{w.name} {w.step_num}" for w in pre + dec + copies if not w.events]
    if empty:
        raise RuntimeError(f"no device op events were found inside steps {empty} of {session}")
    return ProfileReport(meta=meta, session=session, files=pt.trace_files(session), platform=trace.platform,
                         prefill=pre[0], decode=dec, copies=copies, outside_ms=sum(e.self_ns for e in outside) / 1e6)


def _sampling_batch(rows: int, greedy: bool, step: int):
    """Per-row sampling parameters: greedy, or Qwen3.5's recommended temperature 0.7 / top_p 0.8 / top_k 20."""
    import numpy as np

    from qwen35_jax.engine.sampler import SamplingBatch
    full = lambda v, dt: np.full(rows, v, dt)
    return SamplingBatch(temperature=full(0.0 if greedy else 0.7, np.float32),
                         top_k=full(0 if greedy else 20, np.int32),
                         top_p=full(1.0 if greedy else 0.8, np.float32), min_p=full(0.0, np.float32),
                         presence=full(0.0, np.float32), frequency=full(0.0, np.float32),
                         repetition=full(1.0, np.float32), seed=np.arange(rows, dtype=np.uint32),
                         step=full(step, np.int32), logprobs=full(False, np.bool_))


def run_profile(model: str | None = None, config: str | None = None, *, random_weights: bool = False,
                batch: int = 4, prompt_len: int = 64, decode_steps: int = 4, tp: int = 1, dtype: str = "bfloat16",
                kernel_config=None, page_size: int = 16, greedy: bool = False,
                copy_mib: int | None = None, out_dir: str = "profile", devices=None, weights=None,
                compilation_cache_dir: str | None = None, log=print) -> ProfileReport:
    """Profile one prefill and `decode_steps` decode steps of `batch` rows through the engine's executor; see the
    module docstring. model: a HF model dir (default: the embedded tiny model); config: a config.json file or a
    dir holding one (random weights). weights: already-loaded weights for (model, tp, dtype)."""
    import tempfile

    import jax
    import jax.numpy as jnp
    import numpy as np

    from qwen35_jax.engine.engine import EngineArgs, build_engine
    from qwen35_jax.engine.sampler import sampler_mode
    from qwen35_jax.model.backends import KernelConfig
    from qwen35_jax.model.hub import default_model_dir

    if batch < 1 or prompt_len < 1 or decode_steps < 1:
        raise ValueError("batch, prompt_len and decode_steps must be >= 1")
    if model is None and config is None:
        model = default_model_dir()
    tmp = None
    if config is not None and not os.path.isdir(config):     # the engine reads <dir>/config.json
        tmp = tempfile.TemporaryDirectory(prefix="qwen35-profile-")
        with open(config) as f, open(os.path.join(tmp.name, "config.json"), "w") as g:
            g.write(f.read())
    model_dir = tmp.name if tmp else (config or model)
    use_random = config is not None or random_weights
    # An engine sized for exactly this run: `batch` slots, pages for prompt + decode steps, one prefill bucket
    # (batch x prompt_len) and the decode buckets, compiled on first use (the warm-up).
    max_len = prompt_len + decode_steps + 1
    pages_per_seq = -(-max_len // page_size)
    t0 = time.perf_counter()
    engine = build_engine(model_dir, EngineArgs(
        tensor_parallel_size=tp, dtype=dtype, max_model_len=max_len, max_num_seqs=batch,
        max_num_batched_tokens=batch * prompt_len, max_prefill_rows=batch, min_prefill_tokens=prompt_len,
        page_size=page_size, num_kv_pages=1 + batch * pages_per_seq, decode_steps=1,
        kernel_config=kernel_config or KernelConfig(), compilation_cache_dir=compilation_cache_dir, precompile=False,
        load_format="dummy" if use_random else "auto", skip_tokenizer_init=True), weights=weights, devices=devices)
    jax.block_until_ready(engine.weights)
    log(f"engine ready in {time.perf_counter() - t0:.1f}s ({'random weights' if use_random else model_dir})")
    dt = engine.dtype
    ex, cfg = engine.executor, engine.cfg
    if tmp:
        tmp.cleanup()
    if engine.pages_per_seq != pages_per_seq:
        raise RuntimeError(f"engine made {engine.pages_per_seq} pages per sequence, expected {pages_per_seq}")

    # decode in the bucket the engine runs `batch` rows in: its padding rows on the null slot 0
    rows, dec_slots, dec_pages = decode_rows(ex, batch, pages_per_seq)
    slots, pages = dec_slots[:batch], dec_pages[:batch]

    def decode(k):
        positions = np.where(dec_slots > 0, prompt_len + k, 0).astype(np.int32)
        return ex.decode(rows, dec_slots, positions, dec_pages, _sampling_batch(rows, greedy, k + 1))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, prompt_len), dtype=np.int32)
    zeros = np.zeros(batch, np.int32)

    # The copy that measures bandwidth: one device, fp32, read once and written once; donated, so the result
    # reuses the input buffer (no fresh allocation, i.e. no page faults on CPU, inside the timing).
    dev0 = engine.mesh.devices.flat[0]
    copy_bytes = (copy_mib or (1024 if dev0.platform == "gpu" else 64)) << 20
    x = jax.jit(lambda: jnp.ones(copy_bytes // 4, jnp.float32), out_shardings=jax.sharding.SingleDeviceSharding(dev0))()

    def copy_bandwidth(a):
        return a * 2

    copy = jax.jit(copy_bandwidth, donate_argnums=0).lower(x).compile()

    def run(traced: bool):
        nonlocal x
        ann = jax.profiler.StepTraceAnnotation if traced else (lambda *a, **k: contextlib.nullcontext())
        with ann("prefill", step_num=0):
            jax.block_until_ready(ex.prefill((batch, prompt_len), tokens, zeros, np.full(batch, prompt_len, np.int32),
                                             slots, pages, np.ones(batch, np.bool_),
                                             _sampling_batch(batch, greedy, 0)))
        for k in range(decode_steps if traced else 1):
            with ann("decode", step_num=k):
                jax.block_until_ready(decode(k))
        for k in range(COPY_RUNS if traced else 1):
            with ann("copy_bandwidth", step_num=k):
                x = jax.block_until_ready(copy(x))

    t0 = time.perf_counter()
    run(traced=False)                 # compiles, and keeps first-execution costs out of the trace
    log(f"compiled and warmed up in {time.perf_counter() - t0:.1f}s")
    texts = {"prefill": ex.compiled[("prefill", batch, prompt_len)].as_text(),
             "decode": ex.compiled[("decode", rows, sampler_mode(_sampling_batch(rows, greedy, 1)))].as_text(),
             "copy_bandwidth": copy.as_text()}
    start_profile(out_dir, perfetto=True)
    try:
        run(traced=True)
    finally:
        session = stop_profile()

    # The same decode steps untraced, dispatched back to back (the device queues them, as in serving); they
    # re-decode the profiled positions, which costs the same.
    def passes(rounds):
        t0 = time.perf_counter()
        for _ in range(rounds):
            for k in range(decode_steps):
                out = decode(k)
        jax.block_until_ready(out)
        return time.perf_counter() - t0
    r1 = -(-8 // decode_steps)          # at least 8 steps in the shorter burst
    step_s, pass_s = steady_step_seconds(passes, r1)

    name = os.path.basename(os.path.normpath(config or model)).removesuffix(".json")
    meta = dict(
        title=(f"{name}: batch {batch}" + (f" (decode bucket {rows})" if rows != batch else "")
               + f", prompt {prompt_len}, {decode_steps} decode steps, tp {tp}, "
               f"{jnp.dtype(dt).name}, kernels {engine.kernel_config.backend}, "
               f"{'greedy' if greedy else 'T=0.7 top_p=0.8 top_k=20'}"
               + "".join(f", {c}" for c in engine.kernel_config.changes().split())     # variants in force
               + (f", XLA_FLAGS={env.read().xla_flags}" if env.read().xla_flags else "")),
        device=f"{dev0.device_kind} ({dev0.platform})", device_id=dev0.local_hardware_id,
        layer_types=list(cfg.layer_types), batch=batch, decode_rows=rows, prompt_len=prompt_len,
        decode_steps=decode_steps, tp=tp, dtype=jnp.dtype(dt).name,
        kernel_backend=engine.kernel_config.backend, page_size=page_size, greedy=greedy, copy_bytes=2 * copy_bytes,
        decode_wall_ms=step_s / decode_steps * 1e3, decode_pass_ms=pass_s / decode_steps * 1e3,
        floor_bytes=decode_floor_bytes(cfg, engine.weights, ex.state, batch,    # mean tokens cached over the steps
                                       prompt_len + (decode_steps + 1) / 2))
    for step, text in texts.items():             # beside the trace, so load_report can read it back anywhere
        with open(os.path.join(session, f"{step}.hlo.txt"), "w") as f:
            f.write(text)
    with open(os.path.join(session, "profile.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return load_report(session)


def _shard_bytes(x) -> int:
    import numpy as np
    return int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize


def decode_rows(executor, batch: int, pages_per_row: int):
    """(bucket, slots, pages) of a synthetic decode step as the engine lays one out: `batch` live rows on slots 1 ..
    batch, each owning `pages_per_row` consecutive pages from page 1, in the smallest decode bucket that holds them
    (KernelConfig.decode_min_rows: a lone row runs beside a padding row), padding rows on the null slot 0 and page 0.
    Positions are the caller's (zero on padding rows: np.where(slots > 0, position, 0))."""
    import numpy as np

    from qwen35_jax.engine.scheduler import next_bucket
    b = next_bucket(batch, executor.decode_buckets)
    slots = np.zeros(b, np.int32)
    slots[:batch] = np.arange(1, batch + 1)
    pages = np.zeros((b, executor.pages_per_seq), np.int32)
    pages[:batch, :pages_per_row] = 1 + np.arange(batch * pages_per_row, dtype=np.int32).reshape(batch, pages_per_row)
    return b, slots, pages


def steady_step_seconds(burst, n: int, reps: int = 3, tries: int = 4) -> tuple[float, float]:
    """(steady-state seconds per unit, one burst's seconds per unit) of back-to-back dispatches. burst(k) dispatches
    k units back to back, waits for the device and returns its wall seconds. The steady state is the slope from
    bursts of n to 2n units (the fastest of reps each: interference only adds time): the first dispatch's host time,
    through which the device idles, and the final wait are in both and cancel; a burst's own wall time per unit
    carries them (about dispatch time / n more). A slope that noise drove to zero or below is measured again with
    bursts twice as long; after `tries` such rounds it is an error rather than a made-up figure."""
    for _ in range(tries):
        one, two = (min(burst(k) for _ in range(reps)) for k in (n, 2 * n))
        if two > one:
            return (two - one) / n, one / n
        n *= 2
    raise RuntimeError(f"timing too noisy: bursts of {n} units took no longer than bursts of {n // 2}")


def decode_floor_bytes(cfg, weights, state, batch, context: float, experts_touched: float | None = None
                       ) -> dict[str, int]:
    """Bytes one decode step of `batch` rows must move on one device (rank 0): weights once (an untied embedding
    table contributes only the looked-up rows; a MoE layer only the experts the step routes to: experts_touched per
    layer, by default the expectation under uniform routing, E (1 - (1 - k/E)^batch)), every GDN layer's recurrent
    and conv state for `batch` slots read and written, and each attention layer's K/V read over `context` cached
    tokens plus the new token's K/V written. Also used by bench/throughput.py, bench/tp.py and bench/moe.py."""
    import jax
    import jax.numpy as jnp

    from qwen35_jax.model.weights import MoE
    leaves = jax.tree.leaves(weights)
    w = sum(_shard_bytes(x) for x in leaves)
    if weights.lm_head is not None:
        item = jnp.dtype(weights.embed.dtype).itemsize
        w += batch * cfg.hidden_size * item - _shard_bytes(weights.embed)
    for m in jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, MoE)):
        if isinstance(m, MoE):                                    # the share of experts the step does not read
            e, k = m.gate_up.shape[0], cfg.num_experts_per_tok
            touched = e * (1 - (1 - k / e) ** batch) if experts_touched is None else experts_touched
            w -= int((1 - touched / e) * (_shard_bytes(m.gate_up) + _shard_bytes(m.down)))
    per_slot = lambda x: _shard_bytes(x) // x.sharding.shard_shape(x.shape)[0]     # pools are [slots+1, ...]
    gdn = sum(2 * batch * per_slot(x) for x in state.recurrent + state.conv)
    kv = 0
    for k_pages in state.k_pages:                                 # [kv_heads, pages, page, D], sharded on heads
        heads, _, _, d = k_pages.sharding.shard_shape(k_pages.shape)
        per_token = 2 * heads * d * k_pages.dtype.itemsize        # K and V
        kv += int(batch * per_token * (context + 1))              # read the context, write the new token
    return {"weights": w, "gdn_state": gdn, "kv": kv}


# ---------------------------------------------------------------------------------------------------------------
# The table


def _blocks_order(keys):
    order = ["embed", "gdn", "attention", "mlp", pt.LAYER_OTHER, "lm_head", "sampling", pt.UNSCOPED, pt.UNATTRIBUTED]
    return [k for k in order if k in keys] + sorted(k for k in keys if k not in order)


# Display order of the sub-scopes (the order model.py runs them); scopes not listed follow alphabetically.
SCOPE_ORDER = [pt.LAYER_OTHER, "gdn/in_proj", "gdn/conv1d", "gdn/gated_delta_rule", "gdn/gated_norm", "gdn/out_proj",
               "gdn/(other)", "attention/qkv_proj", "attention/qk_norm_rope", "attention/kv_write",
               "attention/attention", "attention/o_proj", "attention/(other)", "mlp/gate_up", "mlp/down_proj",
               "mlp/(other)"]


def _scope_key(k: str):
    return (SCOPE_ORDER.index(k), "") if k in SCOPE_ORDER else (len(SCOPE_ORDER), k)


def _layer_table(r: ProfileReport, phase: str) -> list[str]:
    """One row per layer, one column per scope; GDN and attention layers in separate tables."""
    layers = r.by_layer(phase)
    lines = []
    for kind, block in (("linear_attention", "gdn"), ("full_attention", "attention")):
        idx = [i for i, t in enumerate(r.layer_types) if t == kind]
        if not idx:
            continue
        cols = sorted({k for i in idx for k in layers.get(i, {})}, key=_scope_key)
        heads = [c.split("/", 1)[1] if c.startswith(block + "/") else c for c in cols] + ["total"]
        rows = [[layers.get(i, {}).get(c, 0.0) for c in cols] + [sum(layers.get(i, {}).values())] for i in idx]
        cells = [[f"{v:.4f}" for v in row] for row in rows]
        widths = [1 + max(len(h), *(len(row[j]) for row in cells)) for j, h in enumerate(heads)]
        lines.append(f"{block + ' layer':<16}" + "".join(f"{h:>{w}}" for h, w in zip(heads, widths)))
        lines += [f"{i:<16}" + "".join(f"{c:>{w}}" for c, w in zip(row, widths)) for i, row in zip(idx, cells)]
    open_layer = sum(e.self_ns for e in r.phase_events(phase) if e.scope[:1] == (pt.AMBIGUOUS_LAYER,)) / 1e6
    if open_layer:
        per = r._per_step(phase, {"ms": open_layer})["ms"]
        lines.append(f"(layer not determined: {per:.4f} ms of shared kernels whose launches could not be told "
                     "apart; counted in the block tables above)")
    return lines


def format_report(r: ProfileReport, top_unattributed: int = 8) -> str:
    """The profile as plain-text tables (ms of device op time; decode columns are per step). Unattributed event
    names: the top_unattributed of prefill and of decode each."""
    gb = 1e9
    lines = [f"# {r.title}", f"device: {r.meta['device']} (the first device of the mesh; times are its own)",
             f"trace: {r.session}"]
    for key, label in (("xplane", "xprof/TensorBoard"), ("perfetto", "ui.perfetto.dev")):
        if key in r.files:
            lines.append(f"  {label}: {r.files[key]}")
    lines += ["", f"{'step':<18}{'host ms':>10}{'device ms':>11}{'op ms':>10}{'ops':>7}"]
    for w in [r.prefill] + r.decode:
        label = f"{w.name} {w.step_num}"
        lines.append(f"{label:<18}{w.host_ms:>10.3f}{w.device_span_ms:>11.3f}{w.op_ms:>10.3f}{len(w.events):>7}")
    lines.append("(device ms: first op start to last op end; op ms: sum of op times"
                 + (", over all CPU threads)" if r.platform == "cpu" else ")"))
    if r.outside_ms > 0.001:
        lines.append(f"device time outside every step: {r.outside_ms:.3f} ms")

    pre_b, dec_b = r.by_block("prefill"), r.by_block("decode")
    tot_p, tot_d = sum(pre_b.values()), sum(dec_b.values())
    lines += ["", f"{'block':<26}{'prefill ms':>12}{'%':>6}{'decode/step ms':>16}{'%':>6}"]
    for k in _blocks_order(set(pre_b) | set(dec_b)):
        p, d = pre_b.get(k, 0.0), dec_b.get(k, 0.0)
        lines.append(f"{k:<26}{p:>12.3f}{100 * p / tot_p:>6.1f}{d:>16.3f}{100 * d / tot_d:>6.1f}")
    lines.append(f"{'total':<26}{tot_p:>12.3f}{100.0:>6.1f}{tot_d:>16.3f}{100.0:>6.1f}")

    pre_s, dec_s = r.by_scope("prefill"), r.by_scope("decode")
    lines += ["", f"{'scope (all layers)':<34}{'prefill ms':>12}{'decode/step ms':>16}"]
    scoped = sorted((k for k in set(pre_s) | set(dec_s) if not k.startswith(pt.UNATTRIBUTED)),
                    key=lambda k: (k.split("/")[0] not in ("gdn", "attention", "mlp"), _scope_key(k)))
    unattr = [k for k in set(pre_s) | set(dec_s) if k.startswith(pt.UNATTRIBUTED)]
    top = lambda table: sorted(unattr, key=lambda k: -table.get(k, 0.0))[:top_unattributed]
    shown = sorted(set(top(pre_s)) | set(top(dec_s)), key=lambda k: (-dec_s.get(k, 0.0), -pre_s.get(k, 0.0)))
    for k in scoped + shown:
        lines.append(f"{k:<34}{pre_s.get(k, 0.0):>12.3f}{dec_s.get(k, 0.0):>16.3f}")
    if len(unattr) > len(shown):
        lines.append(f"... {len(unattr) - len(shown)} more unattributed event names")

    for phase in ("decode", "prefill"):
        lines += ["", f"per layer, {phase}" + (" (per step)" if phase == "decode" else "") + ", ms"]
        lines += _layer_table(r, phase)

    fb = r.floor_bytes
    lines += ["", "decode roofline (per device):",
              f"  bytes that must move per step: weights {fb['weights'] / gb:.3f} GB + GDN state "
              f"{fb['gdn_state'] / gb:.3f} GB + KV {fb['kv'] / gb:.4f} GB = {sum(fb.values()) / gb:.3f} GB",
              f"  copy bandwidth {r.copy_bandwidth / gb:.1f} GB/s (x*2 over {r.meta['copy_bytes'] // 2 >> 20} MiB "
              f"fp32: read+write bytes / median device time of {len(r.copies)} runs in this trace)",
              f"  floor {r.floor_ms:.3f} ms",
              f"  decode step untraced {r.decode_wall_ms:.3f} ms (back-to-back dispatches: the slope of wall time "
              f"from N to 2N steps, median of 3 each; N steps' wall time per step "
              f"{r.meta.get('decode_pass_ms', float('nan')):.3f} ms): "
              f"roofline ratio {r.roofline_ratio:.3f}, {sum(fb.values()) / r.decode_wall_ms / 1e6:.1f} GB/s",
              f"  decode step traced {r.decode_ms:.3f} ms (median device span; op by op under the profiler): "
              f"roofline ratio {r.traced_roofline_ratio:.3f}"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m qwen35_jax.tools.profile", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="HF model directory (default: the embedded tiny model)")
    src.add_argument("--config", help="a HF config.json (file or dir) profiled with random weights, "
                                      "e.g. bench/configs/qwen3.5-9b.json")
    ap.add_argument("--random-weights", action="store_true", help="random weights even with --model")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--decode-steps", type=int, default=4)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kernel-backend", default=None, help="reference | pallas | pallas_interpret (default: "
                                                           "pallas on GPU, reference elsewhere)")
    ap.add_argument("--kernel-config", default="", help="KernelConfig fields to change, e.g. 'decode_split_k=1'")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--greedy", action="store_true", help="greedy sampling (default: T=0.7, top_p 0.8, top_k 20)")
    ap.add_argument("--copy-mib", type=int, default=None, help="size of the bandwidth copy (default 1024 GPU, 64 CPU)")
    ap.add_argument("--out", default="profile", help="trace directory (default ./profile)")
    ap.add_argument("--compilation-cache-dir", default=None)
    ap.add_argument("--top-unattributed", type=int, default=8,
                    help="list this many unattributed kernel names of prefill and of decode each (default 8)")
    args = ap.parse_args(argv)
    from qwen35_jax.model.backends import KernelConfig
    report = run_profile(args.model, args.config, random_weights=args.random_weights, batch=args.batch,
                         prompt_len=args.prompt_len, decode_steps=args.decode_steps, tp=args.tp, dtype=args.dtype,
                         kernel_config=KernelConfig.parse(args.kernel_config,
                                                          KernelConfig(backend=args.kernel_backend)),
                         page_size=args.page_size, greedy=args.greedy,
                         copy_mib=args.copy_mib, out_dir=args.out, compilation_cache_dir=args.compilation_cache_dir,
                         log=lambda m: print(m, file=sys.stderr, flush=True))
    print(format_report(report, args.top_unattributed))
    return report


if __name__ == "__main__":
    main()
