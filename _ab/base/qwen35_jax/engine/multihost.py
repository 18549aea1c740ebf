"""Multi-process SPMD serving on JAX's distributed runtime (`jax.distributed`), no home-made RPC.

Every process builds the same engine over one global (dp, tp) mesh and compiles the same executables. Process 0,
the leader, runs the scheduler (and the HTTP server); before each compiled call it publishes the call's host
inputs to the distributed key-value store, and every follower replays them into the same executable, so all
processes run identical SPMD steps. Outputs are replicated and read on the leader only.

Failure is reported, never a silent hang: recoverability is enabled so a dead peer does not take the leader down;
a watchdog on the leader polls the coordination service's live-node list and marks the engine failed (its
/health then fails and every request gets an error) within about `PEER_POLL_SECONDS`; followers exit when the
leader is gone.
"""
from __future__ import annotations

import io
import logging
import threading
import time

import jax
import numpy as np

from qwen35_jax import env

log = logging.getLogger(__name__)
PEER_POLL_SECONDS = 0.5
PREFIX = "qwen35/step/"


class PeerLost(RuntimeError):
    pass


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, heartbeat_timeout_seconds: int = 10) -> bool:
    """Join the distributed runtime before any other JAX use. Arguments default to JAX's environment variables
    (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID). Returns True when running multi-process."""
    e = env.read()
    coordinator_address = coordinator_address or e.coordinator_address
    num_processes = num_processes or e.num_processes
    process_id = e.process_id if process_id is None else process_id
    if not coordinator_address or not num_processes or num_processes == 1:
        return False
    if process_id is None:
        raise ValueError("multi-process serving needs --process-id (or JAX_PROCESS_ID)")
    jax.config.update("jax_enable_recoverability", True)     # a dead peer must be reported, not kill the leader
    if (jax.config.jax_platforms or "").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, heartbeat_timeout_seconds=heartbeat_timeout_seconds)
    log.info("process %d of %d joined %s (%d local / %d global devices)", jax.process_index(), jax.process_count(),
             coordinator_address, jax.local_device_count(), jax.device_count())
    return True


def _client():
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return client


def _encode(kind: str, key: tuple, inputs) -> bytes:
    leaves, treedef = jax.tree.flatten(inputs)
    buf = io.BytesIO()
    np.savez(buf, *[np.asarray(x) for x in leaves])
    header = f"{kind}|{','.join(map(str, key))}|{len(leaves)}\n".encode()
    return header + buf.getvalue()


def _decode(blob: bytes, treedefs: dict):
    header, payload = blob.split(b"\n", 1)
    kind, key, _ = header.decode().split("|")
    if kind == "stop":
        return "stop", None, None
    data = np.load(io.BytesIO(payload))
    leaves = [data[f"arr_{i}"] for i in range(len(data.files))]
    return kind, tuple(int(x) for x in key.split(",")), jax.tree.unflatten(treedefs[kind], leaves)


class Leader:
    """Given to process 0's engine (build_engine): publishes every dispatch, cleans up consumed steps, and watches
    the peers, failing the engine when one is gone."""

    def __init__(self):
        self.client, self.step, self.stepped, self._consumed = _client(), 0, 0, 0
        self.peers = [p for p in range(jax.process_count()) if p != jax.process_index()]
        self._stop = threading.Event()
        self.watchdog = None

    def watch(self, fail):
        """Start the watchdog; fail(error) marks the engine dead when a peer or the coordination service is lost."""
        self._fail = fail
        self.watchdog = threading.Thread(target=self._watch, name="qwen35-peer-watchdog", daemon=True)
        self.watchdog.start()

    def publish(self, kind: str, key: tuple, inputs):
        self.client.key_value_set_bytes(f"{PREFIX}{self.step}", _encode(kind, key, inputs))
        self.step += 1
        if kind not in ("restore", "save"):
            self.stepped = self.step      # keys before this one are read by every follower that has run this step

    def consumed_before(self, step: int):
        """Called once the leader has read back the outputs of the steps published before key `step` (`stepped`
        when they were dispatched): every process has run them and read every key before, so those can go."""
        first, self._consumed = self._consumed, max(self._consumed, step)
        for n in range(first, step):
            try:
                self.client.key_value_delete(f"{PREFIX}{n}")
            except Exception:       # already deleted
                pass

    def dead_peers(self) -> list[int]:
        live = set(self.client.get_live_nodes(list(range(jax.process_count()))))
        return [p for p in self.peers if p not in live]

    def _watch(self):
        while not self._stop.wait(PEER_POLL_SECONDS):
            try:
                dead = self.dead_peers()
            except Exception as e:   # the coordination service itself is unreachable
                self._fail(PeerLost(f"lost the coordination service: {e}"))
                return
            if dead and not self._stop.is_set():          # peers leaving after our own shutdown are expected
                self._fail(PeerLost(f"peer process(es) {dead} stopped responding; this multi-process engine "
                                          f"cannot continue"))
                return

    def shutdown(self, timeout: float = 30.0):
        """Orderly end: tell the followers to stop, wait until each has left the job, then leave it ourselves
        (the coordination service lives in this process, so it must go last). Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self.watchdog is not None and self.watchdog is not threading.current_thread():
            self.watchdog.join(timeout=timeout)      # wakes from its wait at once; at most one poll in progress
        try:
            self.client.key_value_set_bytes(f"{PREFIX}{self.step}", b"stop||0\n")
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                live = set(self.client.get_live_nodes(list(range(jax.process_count()))))
                if not live & set(self.peers):
                    break
                time.sleep(0.05)
            jax.distributed.shutdown()
        except Exception:
            log.warning("multi-process shutdown was not clean", exc_info=True)


def follow(engine, poll_ms: int = 1000):
    """Follower loop: replay the leader's dispatches into this process's executables until told to stop or the
    leader disappears (then raise PeerLost)."""
    client = _client()
    ex = engine.executor
    from qwen35_jax.engine.sampler import host_batch
    from qwen35_jax.model.forward import Batch
    sp = host_batch([], 1)
    treedefs = {"prefill": jax.tree.structure((Batch(0, 0, 0, 0, 0), 0, sp)),   # what the leader flattened
                "prompt_logprobs": jax.tree.structure((Batch(0, 0, 0, 0, 0), 0, sp, 0)),
                "decode": jax.tree.structure((0, 0, 0, sp)),
                "mixed": jax.tree.structure(((0, 0, 0, sp), (Batch(0, 0, 0, 0, 0), 0, sp))),
                "restore": jax.tree.structure((0, 0, 0, 0, 0)), "save": jax.tree.structure((0, 0, 0, 0))}
    step, pending = 0, []
    while True:
        try:
            blob = client.blocking_key_value_get_bytes(f"{PREFIX}{step}", poll_ms)
        except Exception:
            live = client.get_live_nodes(list(range(jax.process_count())))
            if 0 not in live:
                raise PeerLost("the leader (process 0) is gone")
            continue
        kind, key, inputs = _decode(blob, treedefs)
        if kind == "stop":
            log.info("leader asked followers to stop after %d steps", step)
            jax.block_until_ready(pending)
            jax.distributed.shutdown()            # leave the job before the leader (which hosts the service) does
            return
        if kind in ("prefill", "prompt_logprobs"):
            batch, finishing, sp, *targets = inputs
            out = ex.prefill(key, batch.tokens, batch.start, batch.lens, batch.slots, batch.pages, finishing, sp,
                             *targets)
        elif kind == "mixed":
            out = ex.mixed(key[0], key[1:], *inputs)
        elif kind in ("restore", "save"):       # the prefix cache's copies: no output
            ex.copy_state(kind, key[0], *inputs)
            step += 1
            continue
        else:
            out = ex.decode(key[0], *inputs)
        pending.append(out)
        if len(pending) > 2:                       # keep the device queue short; outputs are not needed here
            jax.block_until_ready(pending.pop(0))
        step += 1
