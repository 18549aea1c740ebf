"""One process of a multi-process engine run (tests/test_multihost.py starts two of these on loopback).

    python multihost_driver.py PROCESS_ID NUM_PROCESSES PORT TP DP OUT.json [--hold]
Process 0 generates greedy continuations of fixed prompts and writes them to OUT.json; with --hold it then starts a
long request and records when (and how) the engine reports a lost peer.
"""
import json
import sys
import time

import jax

pid, nproc, port, tp, dp, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), \
    sys.argv[6]
hold = "--hold" in sys.argv
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 2)

from qwen35_jax.engine import multihost  # noqa: E402

multihost.initialize(f"127.0.0.1:{port}", nproc, pid, heartbeat_timeout_seconds=5)
import os  # noqa: E402

from qwen35_jax.llm import LLM  # noqa: E402
from qwen35_jax.engine.sampling_params import SamplingParams  # noqa: E402

MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "hf", "text_untied_r1_g6")
llm = LLM(MODEL, tensor_parallel_size=tp, skip_tokenizer_init=True, data_parallel_size=dp, dtype="float32",
          max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, compilation_cache_dir="",
          decode_prefill_budget=32,     # the long prompt's chunks run in mixed steps beside the decoding rows
          precompile=False)      # each process compiles the buckets it meets: the test runs few of them
if pid != 0:
    try:
        multihost.follow(llm.engine)
    except multihost.PeerLost as e:
        print("follower:", e, flush=True)
        sys.exit(3)
    sys.exit(0)

prompts = [[5 + i, 17, 33 + 2 * i, 90, 4 + i] for i in range(6)] + [list(range(3, 103))]
outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
result = {"tokens": [o.outputs[0].token_ids for o in outs], "mixed_steps": llm.engine.stats.mixed_steps}
if hold:
    done = []
    llm.engine.add_request([7, 8, 9], SamplingParams(max_tokens=200, ignore_eos=True),
                           lambda o: done.append(o) if o.finished else None)
    print("READY", flush=True)
    t0 = time.monotonic()
    while llm.engine.healthy and time.monotonic() - t0 < 120:
        time.sleep(0.05)
    result.update(healthy=llm.engine.healthy, error=repr(llm.engine.error),
                  request_finish=[c.finish_reason for c in done[-1].outputs] if done else None)
    json.dump(result, open(out, "w"))
    os._exit(0)        # collectives of the dead peer may never finish: do not wait for them at exit
json.dump(result, open(out, "w"))
llm.shutdown()
