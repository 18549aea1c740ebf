"""`python -m qwen35_jax.serve`: an OpenAI-compatible HTTP server (chat, completions, models, health, metrics).

    python -m qwen35_jax.serve --model Qwen/Qwen3.5-9B --max-model-len 8192 --port 8000

Flags are named as vLLM's. --model is a model directory or a Hugging Face repo id, fetched into the HF cache at
--revision (HF_HOME, HF_HUB_OFFLINE=1 respected) and served under that name. Without --model it serves the embedded
tiny random model (built on first use) with a small bucket set, so it starts on a laptop CPU. It binds 127.0.0.1
unless --host says otherwise; --api-key (or $QWEN35_API_KEY) makes /v1/* require `Authorization: Bearer <key>`.
--load-format dummy serves random weights at the shapes of DIR/config.json (benchmarks); with --skip-tokenizer-init
the server takes and returns token ids only.
See docs/server.md.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import sys

from qwen35_jax import env
from qwen35_jax.engine.engine import EngineArgs, build_engine
from qwen35_jax.model.backends import BACKENDS, KernelConfig

log = logging.getLogger("qwen35_jax.serve")

TINY_DEFAULTS = dict(max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=256, max_prefill_rows=1)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m qwen35_jax.serve", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = ap.add_argument_group("model")
    m.add_argument("--model", default=None, help="HF model directory or Hugging Face repo id (default: the embedded "
                   f"tiny random model, with {TINY_DEFAULTS} unless given)")
    m.add_argument("--revision", default=None,
                   help="of a repo id --model: branch, tag or commit to download (default: main)")
    m.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients pass as `model`; the first is reported (default: --model as given; "
                        "tiny-qwen3.5-pydoc for the default model)")
    m.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: random weights at the config's shapes (only config.json is read)")
    m.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    m.add_argument("--skip-tokenizer-init", action="store_true",
                   help="no tokenizer: prompts must be token ids, outputs carry no text (use return_token_ids)")
    m.add_argument("--converted-weights-dir", default=None,
                   help="save the re-laid-out sharded weights here after the first load, restore them later")
    m.add_argument("--generation-config", choices=["auto", "vllm"], default="auto",
                   help="auto: sampling fields a request omits default to the model's generation_config.json; "
                   "vllm: to OpenAI's defaults (temperature 1, top_p 1)")
    m.add_argument("--reasoning-parser", choices=["qwen3", "none"], default="qwen3",
                   help="qwen3: chat output inside <think>...</think> is returned as reasoning_content")
    e = ap.add_argument_group("engine")
    e.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    e.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas over tp x dp devices, each with --max-num-seqs slots")
    e.add_argument("--max-model-len", type=int, default=None, help="default: min(max_position_embeddings, 8192)")
    e.add_argument("--max-num-seqs", type=int, default=None, help="concurrent sequences (default 16)")
    e.add_argument("--max-num-batched-tokens", type=int, default=None, help="prefill token budget per step "
                   "(default 2048)")
    e.add_argument("--decode-prefill-budget", type=int, default=None, help="the most prompt tokens a step that "
                   "also decodes may prefill (default: the whole budget): bounds TPOT while long prompts prefill")
    e.add_argument("--mixed-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="with --decode-prefill-budget: a step's prefill chunk and decode rows in one forward")
    e.add_argument("--max-prefill-rows", type=int, default=None, help="prompts prefilled in one step (default 4)")
    e.add_argument("--decode-steps", type=int, default=1, help="model steps per decode dispatch")
    e.add_argument("--block-size", type=int, default=16, help="KV page size in tokens")
    e.add_argument("--num-gpu-blocks-override", type=int, default=None, help="KV pages (default: as many as fit)")
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse cached prompt prefixes: K/V pages and GDN state snapshots (docs/architecture.md)")
    e.add_argument("--num-state-snapshots", type=int, default=None,
                   help="GDN state snapshots the prefix cache keeps (default: two per sequence, within a tenth of "
                        "the free device memory)")
    e.add_argument("--speculative-config", type=_speculative_config, default=None,
                   help='speculative decoding as vLLM spells it, e.g. \'{"method": "mtp", "num_speculative_tokens": '
                        '3}\': the checkpoint\'s MTP head drafts k = 1..4 tokens per step (docs/speculative.md)')
    e.add_argument("--kernel-backend", default=None, choices=BACKENDS,
                   help="default: pallas on GPU, reference elsewhere")
    e.add_argument("--kernel-config", default=None,
                   help="KernelConfig fields to change, e.g. 'decode_split_k=1 gdn_decode.bv=16' (docs/kernels.md)")
    e.add_argument("--compilation-cache-dir", default=None,
                   help="persistent XLA cache (default: <cache root>/xla; '' disables it)")
    e.add_argument("--no-precompile", action="store_true", help="compile each bucket on first use")
    e.add_argument("--seed", type=int, default=0, help="engine seed for requests without one")
    s = ap.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="0: any free port (printed at start-up)")
    s.add_argument("--api-key", default=env.read().api_key,
                   help="require Authorization: Bearer KEY on /v1/* (default: $QWEN35_API_KEY; none: open)")
    s.add_argument("--max-request-body-bytes", type=int, default=8 * 2**20, help="larger bodies get a 413")
    s.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT: stop accepting requests, let running ones finish for up to this long, "
                        "then end the rest with an error response")
    s.add_argument("--profile-dir", default=None,
                   help="where POST /start_profile writes XLA traces (default: <cache root>/profiles)")
    s.add_argument("--profiler-port", type=int, default=None,
                   help="also run jax.profiler's server on this port, for xprof/TensorBoard on-demand capture")
    d = ap.add_argument_group("multi-process (jax.distributed; one command per host, same flags but --process-id)")
    d.add_argument("--coordinator-address", default=None, help="host:port of process 0 (or $JAX_COORDINATOR_ADDRESS)")
    d.add_argument("--num-processes", type=int, default=None, help="processes in the job (or $JAX_NUM_PROCESSES)")
    d.add_argument("--process-id", type=int, default=None, help="this process (or $JAX_PROCESS_ID); 0 serves HTTP")
    s.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    s.add_argument("--disable-uvicorn-access-log", action="store_true")
    return ap


def _speculative_config(text: str) -> dict:
    """--speculative-config: a JSON object (EngineArgs.validate checks its fields)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def engine_args(args) -> EngineArgs:
    """EngineArgs from the CLI (the tiny default model fills the unset ones with a small bucket set)."""
    kernel_config = KernelConfig.parse(args.kernel_config or "", KernelConfig(backend=args.kernel_backend))
    kw = dict(tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
              dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              decode_prefill_budget=args.decode_prefill_budget, mixed_prefill=args.mixed_prefill,
              max_prefill_rows=args.max_prefill_rows,
              decode_steps=args.decode_steps, page_size=args.block_size,
              num_kv_pages=args.num_gpu_blocks_override, gpu_memory_utilization=args.gpu_memory_utilization,
              enable_prefix_caching=args.enable_prefix_caching, num_state_snapshots=args.num_state_snapshots,
              kernel_config=kernel_config, compilation_cache_dir=args.compilation_cache_dir,
              precompile=not args.no_precompile, seed=args.seed, load_format=args.load_format,
              skip_tokenizer_init=args.skip_tokenizer_init, converted_weights_dir=args.converted_weights_dir,
              revision=args.revision, speculative_config=args.speculative_config)
    if args.model is None:
        kw = {k: (TINY_DEFAULTS[k] if v is None and k in TINY_DEFAULTS else v) for k, v in kw.items()}
    return EngineArgs(**{k: v for k, v in kw.items() if v is not None})      # unset: EngineArgs' default


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def _graceful_server(uvicorn):
    """uvicorn.Server whose shutdown (SIGTERM, SIGINT) first drains the app (server.app.Lifecycle): new
    connections are refused and idle ones closed at once, running requests get `shutdown_timeout` seconds, the
    rest end with an error response; uvicorn's own shutdown then has responses to flush, not requests to cut.
    The signal is not re-raised afterwards (uvicorn would), so a drained server exits 0."""
    class GracefulServer(uvicorn.Server):
        shutdown_timeout = 30.0

        async def shutdown(self, sockets=None):
            for server in self.servers:
                server.close()
            for sock in sockets or []:
                sock.close()
            for connection in list(self.server_state.connections):
                connection.shutdown()        # idle keep-alive: closed now; busy: closed after its response
            await asyncio.sleep(0.1)
            await self.config.app.state.lifecycle.drain(     # a second Ctrl-C (force_exit) cuts the wait short
                self.shutdown_timeout, lambda: bool(self.server_state.tasks) and not self.force_exit)
            await super().shutdown(sockets)
            self._captured_signals.clear()
    return GracefulServer


def main(argv=None):
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from qwen35_jax.engine import multihost
    from qwen35_jax.model.hub import default_model_dir
    if multihost.initialize(args.coordinator_address, args.num_processes, args.process_id):
        import jax
        if jax.process_index() != 0:        # followers: same engine, replaying process 0's steps; no HTTP
            engine = build_engine(args.model or default_model_dir(), engine_args(args))
            try:
                multihost.follow(engine)
            except multihost.PeerLost as e:
                log.error("%s; exiting", e)
                return 3
            finally:
                engine.shutdown()
            return 0
    import uvicorn
    from prometheus_client import CollectorRegistry

    from qwen35_jax.server.app import ServerConfig, create_app
    from qwen35_jax.server.metrics import PrometheusObserver
    from qwen35_jax.server.protocol import load_generation_defaults

    sock = _bind(args.host, args.port)       # fail on a taken port before spending minutes compiling
    if args.profiler_port is not None:
        from qwen35_jax.tools.profile import start_profiler_server
        start_profiler_server(args.profiler_port)
    model = args.model or default_model_dir()
    served_model_names = args.served_model_name or [args.model or os.path.basename(model)]   # the default: its name
    registry = CollectorRegistry()
    engine = build_engine(model, engine_args(args), observer=PrometheusObserver(registry, served_model_names[0]))
    try:                 # the engine (its loop thread) is shut down however the server ends
        defaults = load_generation_defaults(engine.model_dir) if args.generation_config == "auto" else {}
        if defaults:
            log.info("sampling defaults from %s/generation_config.json: %s", engine.model_dir, defaults)
        config = ServerConfig(served_model_names=served_model_names, model_path=model,
                              api_key=args.api_key or None, max_body_bytes=args.max_request_body_bytes,
                              generation_defaults=defaults, reasoning_parser=args.reasoning_parser == "qwen3",
                              profile_dir=args.profile_dir or os.path.join(env.cache_root(), "profiles"))
        app = create_app(engine, config, registry)
        engine.start()
        host, port = sock.getsockname()[:2]
        print(f"qwen35_jax.serve: serving {config.served_model_names[0]!r} on http://{host}:{port}"
              f"{' (API key required)' if config.api_key else ''}", flush=True)
        server = _graceful_server(uvicorn)(uvicorn.Config(app, log_level=args.uvicorn_log_level,
                                                          access_log=not args.disable_uvicorn_access_log,
                                                          timeout_graceful_shutdown=5))
        server.shutdown_timeout = args.shutdown_timeout
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
