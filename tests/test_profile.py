"""Profiler workflows: trace parsing (HLO -> named scopes), start/stop state checks, and the profile command on the
tiny model, whose table must give every layer's scopes non-zero device time."""
import os
import re

import jax
import jax.numpy as jnp
import pytest

from conftest import XLA_CACHE
from qwen35_jax.tools import profile as qp
from qwen35_jax.tools import profile_trace as pt

HLO = """HloModule jit_decode, is_scheduled=true, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%fused_computation.3 (param_0.1: f32[4,8]) -> f32[4,8] {
  %param_0.1 = f32[4,8]{1,0} parameter(0)
  %mul.1 = f32[4,8]{1,0} multiply(%param_0.1, %param_0.1), metadata={op_name="jit(decode)/while/body/layer3/gdn/gated_norm/mul" stack_frame_id=7}
  ROOT %add.2 = f32[4,8]{1,0} add(%mul.1, %param_0.1), metadata={op_name="jit(decode)/while/body/layer3/gdn/gated_norm/add"}
}

%fused_computation.4 (param_0.2: f32[4,8]) -> f32[4,8] {
  %param_0.2 = f32[4,8]{1,0} parameter(0)
  %a.1 = f32[4,8]{1,0} negate(%param_0.2), metadata={op_name="jit(decode)/while/body/layer1/attention/qkv_proj/neg"}
  %b.1 = f32[4,8]{1,0} abs(%a.1), metadata={op_name="jit(decode)/while/body/layer1/attention/qk_norm_rope/abs"}
  ROOT %c.1 = f32[4,8]{1,0} add(%a.1, %b.1)
}

ENTRY %main.9 (Arg_0.1: f32[4,8]) -> f32[4,8] {
  %Arg_0.1 = f32[4,8]{1,0} parameter(0), metadata={op_name="weights"}
  %dot.5 = f32[4,8]{1,0} dot(%Arg_0.1, %Arg_0.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(decode)/while/body/layer0/mlp/gate_up/dot_general"}
  %copy.7 = f32[4,8]{1,0} copy(%dot.5)
  %loop_fusion.3 = f32[4,8]{1,0} fusion(%copy.7), kind=kLoop, calls=%fused_computation.3
  %input_fusion.4 = f32[4,8]{1,0} fusion(%loop_fusion.3), kind=kLoop, calls=%fused_computation.4
  %while.2 = (s32[], f32[4,8]{1,0}) while(%tuple.1), condition=%cond.1, body=%body.1, metadata={op_name="jit(decode)/while"}
  ROOT %add.9 = f32[4,8]{1,0} add(%input_fusion.4, %Arg_0.1), metadata={op_name="jit(decode)/sampling/add"}
}
"""


def test_scope_of_paths():
    assert pt.scope_of("jit(decode)/while/body/layer3/gdn/in_proj/dot_general") == ("layer3", "gdn", "in_proj")
    assert pt.scope_of("jit(prefill)/layer7/attention/attention/while/body/jit(_where)/select_n") == \
        ("layer7", "attention", "attention")
    assert pt.scope_of("jit(prefill)/layer2/gdn/split") == ("layer2", "gdn", "(other)")
    assert pt.scope_of("jit(prefill)/layer2/add") == ("layer2", pt.LAYER_OTHER, "")
    assert pt.scope_of("jit(prefill)/layer2/jit(_where)/select_n") == ("layer2", pt.LAYER_OTHER, "")
    assert pt.scope_of("jit(decode)/while/body/sampling/sort") == ("sampling", "", "")
    assert pt.scope_of("jit(decode)/embed/gather") == ("embed", "", "")
    assert pt.scope_of("jit(decode)/scatter") == (pt.UNSCOPED, "", "")
    assert pt.scope_of("") == (pt.UNSCOPED, "", "")


def test_hlo_index_resolves_scopes():
    exe = pt.Executable(HLO)
    assert exe.module == "jit_decode"
    path = lambda op: exe.op_name(exe.find(op, op))
    assert path("dot.5").endswith("layer0/mlp/gate_up/dot_general") and exe.instrs["dot.5"].opcode == "dot"
    # no metadata: the op it copies (nearest operand with a scope)
    assert pt.scope_of(path("copy.7")) == ("layer0", "mlp", "gate_up")
    # a fusion without metadata: its body's root
    assert pt.scope_of(path("loop_fusion.3")) == ("layer3", "gdn", "gated_norm")
    # a body whose root has none: the common path of its ops
    assert pt.scope_of(path("input_fusion.4")) == ("layer1", "attention", "(other)")
    assert exe.instrs["while.2"].opcode == "while"
    assert exe.find(None, "loop_fusion_3") == "loop_fusion.3"        # GPU kernel names: '.' -> '_'
    assert exe.find("nope.1", "nope.1") is None


def event(name, start=0, dur=1, program_id="1"):
    return pt.OpEvent(name, "jit_decode", name, program_id, start, dur, "line", None)


def test_events_pick_their_executable():
    """Two executables with one module name (the engine's buckets): each execution's events go to the one that
    holds their instructions."""
    other = HLO.replace("%dot.5", "%dot.6").replace("layer0/mlp/gate_up", "layer5/mlp/down_proj")
    index = pt.HloIndex([HLO, other])
    events = pt.resolve([event("dot.5", program_id="1"), event("copy.7", program_id="1"),
                         event("dot.6", program_id="2"), event("copy.7", program_id="2")], index)
    assert [e.scope for e in events] == [("layer0", "mlp", "gate_up"), ("layer0", "mlp", "gate_up"),
                                         ("layer5", "mlp", "down_proj"), ("layer5", "mlp", "down_proj")]
    assert pt.resolve([event("dot.5")], pt.HloIndex([]))[0].scope == (pt.UNATTRIBUTED, "dot.5", "")


def test_exclusive_time_and_control_flow():
    events = pt._exclusive([event("while.2", 0, 100), event("dot.5", 10, 30), event("copy.7", 50, 20),
                            event("add.9", 120, 5)])
    assert {e.name: e.self_ns for e in events} == {"while.2": 50, "dot.5": 30, "copy.7": 20, "add.9": 5}
    kept = pt.resolve(events, pt.HloIndex([HLO]))
    assert [e.name for e in kept] == ["dot.5", "copy.7", "add.9"]          # the while's time is its body's
    assert pt.by_block(kept) == {"mlp": 50 / 1e6, "sampling": 5 / 1e6}
    unknown = pt.resolve([event("mystery_kernel", 0, 7)])
    assert unknown[0].scope == (pt.UNATTRIBUTED, "mystery_kernel", "")


TWINS = """HloModule jit_step, is_scheduled=true

%fused_computation.1 (p.1: f32[4,8]) -> f32[4,8] {
  %p.1 = f32[4,8]{1,0} parameter(0)
  ROOT %n.1 = f32[4,8]{1,0} negate(%p.1), metadata={op_name="jit(step)/layer0/gdn/gated_norm/neg"}
}

%fused_computation.2 (p.2: f32[4,8]) -> f32[4,8] {
  %p.2 = f32[4,8]{1,0} parameter(0)
  ROOT %n.2 = f32[4,8]{1,0} negate(%p.2), metadata={op_name="jit(step)/layer1/gdn/gated_norm/neg"}
}

ENTRY %main (a: f32[4,8]) -> f32[4,8] {
  %a = f32[4,8]{1,0} parameter(0)
  %gemm.1 = (f32[4,8]{1,0}, s8[0]{0}) custom-call(%a, %a), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/layer0/gdn/in_proj/dot_general"}, backend_config={"gemm_backend_config":{"alpha_real":1}}
  %gte.1 = f32[4,8]{1,0} get-tuple-element(%gemm.1), index=0
  %custom-call.3 = f32[4,8]{1,0} custom-call(%gte.1), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/layer0/gdn/gated_delta_rule/pallas_call"}, backend_config={"name":"gdn_decode","num_warps":1}
  %loop_negate_fusion = f32[4,8]{1,0} fusion(%custom-call.3), kind=kLoop, calls=%fused_computation.1, metadata={op_name="jit(step)/layer0/gdn/gated_norm/neg"}
  %gemm.2 = (f32[4,8]{1,0}, s8[0]{0}) custom-call(%loop_negate_fusion, %a), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/layer1/gdn/in_proj/dot_general"}, backend_config={"gemm_backend_config":{"alpha_real":1}}
  %gte.2 = f32[4,8]{1,0} get-tuple-element(%gemm.2), index=0
  %custom-call.4 = f32[4,8]{1,0} custom-call(%gte.2), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/layer1/gdn/gated_delta_rule/pallas_call"}, backend_config={"name":"gdn_decode","num_warps":1}
  ROOT %loop_negate_fusion.1 = f32[4,8]{1,0} fusion(%custom-call.4), kind=kLoop, calls=%fused_computation.2, metadata={op_name="jit(step)/layer1/gdn/gated_norm/neg"}
}
"""


def test_shared_kernels_attributed_by_launch_order():
    """Kernels launched without their own hlo_op (from a CUDA graph) and shared by several layers (XLA's kernel
    reuse names twin fusions after the first; one Pallas kernel name per layer; cuBLAS names): the k-th launch in
    an execution is the k-th instruction of the group, in schedule order, not the first layer every time."""
    exe = pt.Executable(TWINS)
    assert exe.kernel_groups["loop_negate_fusion"] == ["loop_negate_fusion", "loop_negate_fusion.1"]
    assert exe.kernel_groups["gdn_decode"] == ["custom-call.3", "custom-call.4"]
    assert exe.kernel_groups["cublas"] == ["gemm.1", "gemm.2"]
    names = ["nvjet_sm90_tst_128x64_NNT", "gdn_decode", "loop_negate_fusion"] * 2
    ev = lambda n, t, op=None: pt.OpEvent(n, "jit_step", op, "1", t, 1, "line", None)
    for runs in (1, 2):                                         # one execution, or two in one group
        events = [ev(n, t) for t, n in enumerate(names * runs)]
        got = [(e.name, e.scope) for e in pt.resolve(events, pt.HloIndex([TWINS]))]
        want = [(names[0], ("layer0", "gdn", "in_proj")), (names[1], ("layer0", "gdn", "gated_delta_rule")),
                (names[2], ("layer0", "gdn", "gated_norm")), (names[0], ("layer1", "gdn", "in_proj")),
                (names[1], ("layer1", "gdn", "gated_delta_rule")), (names[2], ("layer1", "gdn", "gated_norm"))]
        assert got == want * runs
    # A twin that launched its own kernel (its own name seen) is not in the group: both map to themselves.
    own = pt.resolve([ev("loop_negate_fusion", 0), ev("loop_negate_fusion_1", 1)], pt.HloIndex([TWINS]))
    assert [e.scope[0] for e in own] == ["layer0", "layer1"]
    # An hlo_op that names an instruction wins over the kernel name.
    assert pt.resolve([ev("gdn_decode", 0, "custom-call.4")], pt.HloIndex([TWINS]))[0].scope[0] == "layer1"
    # Launches that do not fit the group (three for two instructions): the shared scope, layer left open.
    odd = pt.resolve([ev("gdn_decode", t) for t in range(3)], pt.HloIndex([TWINS]))
    assert {e.scope for e in odd} == {(pt.AMBIGUOUS_LAYER, "gdn", "gated_delta_rule")}
    assert pt.by_layer(odd) == {} and set(pt.by_block(odd)) == {"gdn"}


def test_one_pallas_kernel_at_two_shapes_is_two_groups():
    """A Pallas kernel called at two shapes (the GEMV of the GDN in_proj and of the attention qkv) compiles to two
    kernels, which XLA names `gemv` and `gemv__1` in launch order: each launch goes to its own shape's calls."""
    call = ('  %c{i} = bf16[1,{n}]{{1,0}} custom-call(%a), custom_call_target="__gpu$xla.gpu.triton", '
            'metadata={{op_name="jit(step)/layer{i}/{scope}/pallas_call"}}, backend_config={{"name":"gemv"}}')
    body = [call.format(i=0, n=96, scope="gdn/in_proj"), call.format(i=1, n=64, scope="attention/qkv_proj"),
            call.format(i=2, n=96, scope="gdn/in_proj")]
    hlo = ("HloModule jit_step, is_scheduled=true\n\nENTRY %main (a: bf16[1,8]) -> bf16[1,96] {\n"
           "  %a = bf16[1,8]{1,0} parameter(0)\n" + "\n".join(body) + "\n  ROOT %r = bf16[1,96]{1,0} copy(%c2)\n}\n")
    exe = pt.Executable(hlo)
    assert exe.kernel_groups["gemv"] == ["c0", "c2"] and exe.kernel_groups["gemv__1"] == ["c1"]
    ev = lambda n, t: pt.OpEvent(n, "jit_step", None, "1", t, 1, "line", None)
    got = pt.resolve([ev("gemv", 0), ev("gemv__1", 1), ev("gemv", 2)], pt.HloIndex([hlo]))
    assert [e.scope for e in got] == [("layer0", "gdn", "in_proj"), ("layer1", "attention", "qkv_proj"),
                                      ("layer2", "gdn", "in_proj")]


def test_cublas_launches_placed_between_known_kernels():
    """A GEMM call may launch more than one cuBLAS kernel: launches go to the cuBLAS calls between the known
    kernels around them in launch order (two kernels of layer 0's in_proj, one of layer 1's), over two
    executions in one group; a run with more launches than its calls (more than one) takes their shared scope."""
    ev = lambda n, t: pt.OpEvent(n, "jit_step", None, "1", t, 1, "line", None)
    one = ["nvjet_sm90_tst_128x64_NNT", "cublasLt_splitKreduce_kernel", "gdn_decode", "loop_negate_fusion",
           "nvjet_sm90_tst_128x64_NNT", "gdn_decode", "loop_negate_fusion"]
    got = [e.scope for e in pt.resolve([ev(n, t) for t, n in enumerate(one * 2)], pt.HloIndex([TWINS]))]
    l0, l1 = ("layer0", "gdn", "in_proj"), ("layer1", "gdn", "in_proj")
    want = [l0, l0, ("layer0", "gdn", "gated_delta_rule"), ("layer0", "gdn", "gated_norm"), l1,
            ("layer1", "gdn", "gated_delta_rule"), ("layer1", "gdn", "gated_norm")]
    assert got == want * 2
    two = pt.resolve([ev("nvjet_a", 0), ev("nvjet_b", 1)], pt.HloIndex([TWINS]))
    assert [e.scope for e in two] == [l0, l1]
    three = pt.resolve([ev("nvjet_a", t) for t in range(3)], pt.HloIndex([TWINS]))
    assert {e.scope for e in three} == {(pt.AMBIGUOUS_LAYER, "gdn", "in_proj")}


def gpu_plane(pid: int, device: int, kernels) -> str:
    """An XPlane text proto shaped like a GPU device plane: a stream line of kernels (name, start us, dur us,
    hlo_op or None), the hlo_module / program_id stats XLA's launch annotations give them, and a derived line."""
    events = []
    for i, (name, start, dur, op) in enumerate(kernels):
        stats = 'stats { metadata_id: 2 str_value: "jit_decode" } stats { metadata_id: 3 int64_value: 7 }'
        if op:
            stats += f' stats {{ metadata_id: 1 str_value: "{op}" }}'
        events.append(f"events {{ metadata_id: {i + 1} offset_ps: {start * 10**6} duration_ps: {dur * 10**6} "
                      f"{stats} }}")
    meta = " ".join(f'event_metadata {{ key: {i + 1} value {{ id: {i + 1} name: "{k[0]}" }} }}'
                    for i, k in enumerate(kernels))
    return f"""planes {{ id: {pid} name: "/device:GPU:{device}"
      lines {{ id: 1 display_id: 1 name: "Stream #13(compute)" timestamp_ns: 0 {" ".join(events)} }}
      lines {{ id: 2 display_id: 2 name: "XLA Ops" timestamp_ns: 0 {events[0]} }}
      {meta}
      stat_metadata {{ key: 1 value {{ id: 1 name: "hlo_op" }} }}
      stat_metadata {{ key: 2 value {{ id: 2 name: "hlo_module" }} }}
      stat_metadata {{ key: 3 value {{ id: 3 name: "program_id" }} }} }}"""


def test_gpu_shaped_trace(tmp_path):
    """The device-plane path of load_trace on a synthetic GPU-shaped XSpace: only the chosen device's stream
    lines count (not derived lines), kernels map to instructions by hlo_op or by their sanitised name, a copy
    with no HLO op stays visible as unattributed, and events fall into the host step window."""
    from jax.profiler import ProfileData
    host = """planes { id: 1 name: "/host:CPU"
      lines { id: 1 display_id: 1 name: "python" timestamp_ns: 0
        events { metadata_id: 1 offset_ps: 0 duration_ps: 100000000 stats { metadata_id: 1 int64_value: 0 } } }
      event_metadata { key: 1 value { id: 1 name: "decode" } }
      stat_metadata { key: 1 value { id: 1 name: "step_num" } } }"""
    gpu0 = gpu_plane(2, 0, [("sm90_xmma_gemm_bf16bf16", 10, 30, "dot.5"), ("loop_fusion_3", 45, 5, None),
                            ("MemcpyH2D", 2, 3, None), ("late_kernel", 150, 5, "add.9")])
    gpu1 = gpu_plane(3, 1, [("sm90_xmma_gemm_bf16bf16", 10, 30, "dot.5")])
    session = tmp_path / "plugins" / "profile" / "2026_01_01_00_00_00"
    session.mkdir(parents=True)
    (session / "gpu.xplane.pb").write_bytes(ProfileData.text_proto_to_serialized_xspace(host + gpu0 + gpu1))
    trace = pt.load_trace(str(tmp_path), ("decode",), device=0)
    assert trace.platform == "gpu" and len(trace.events) == 4 and len(trace.annotations) == 1
    outside = pt.resolve(pt.assign(trace.events, trace.annotations), pt.HloIndex([HLO]))
    window = trace.annotations[0]
    inside = pt.resolve(window.events, pt.HloIndex([HLO]))
    assert window.step_num == 0 and [e.name for e in outside] == ["late_kernel"]
    assert {e.name: e.scope for e in inside} == {"sm90_xmma_gemm_bf16bf16": ("layer0", "mlp", "gate_up"),
                                                "loop_fusion_3": ("layer3", "gdn", "gated_norm"),
                                                "MemcpyH2D": (pt.UNATTRIBUTED, "MemcpyH2D", "")}
    window.events = inside
    assert window.device_span_ms == pytest.approx(0.048) and window.op_ms == pytest.approx(0.038)
    assert len(pt.load_trace(str(tmp_path)).events) == 5          # both devices
    with pytest.raises(ValueError, match="no plane of device 2"):
        pt.load_trace(str(tmp_path), device=2)


def test_start_stop_profile_state(tmp_path):
    with pytest.raises(qp.ProfilerStateError, match="no trace is running"):
        qp.stop_profile()
    out = str(tmp_path / "trace")
    assert qp.start_profile(out) == out
    try:
        assert qp.profile_active() == out
        with pytest.raises(qp.ProfilerStateError, match="already running"):
            qp.start_profile(str(tmp_path / "other"))
        jax.block_until_ready(jax.jit(lambda x: x * 3)(jnp.ones(8)))
    finally:
        session = qp.stop_profile()
    assert qp.profile_active() is None
    assert os.path.dirname(session) == os.path.join(out, "plugins", "profile")
    files = pt.trace_files(session)
    assert set(files) == {"xplane", "trace_json", "perfetto"}
    assert any(e.name.startswith("wrapped_multiply") or e.hlo_op for e in pt.load_trace(session).events)
    # A trace started elsewhere: start_profile refuses cleanly and leaves no state behind.
    with jax.profiler.trace(str(tmp_path / "outer")):
        with pytest.raises(qp.ProfilerStateError, match="could not start"):
            qp.start_profile(str(tmp_path / "inner"))
    assert qp.profile_active() is None
    # Stopped behind our back: a clear error, and the state is clean again.
    qp.start_profile(str(tmp_path / "again"))
    jax.profiler.stop_trace()
    with pytest.raises(qp.ProfilerStateError, match="could not stop"):
        qp.stop_profile()
    assert qp.profile_active() is None


def test_profiler_server():
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert qp.start_profiler_server(port) == port
    try:
        with pytest.raises(qp.ProfilerStateError, match=f"already running on port {port}"):
            qp.start_profiler_server(port + 1)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass                                               # xprof's capture endpoint is listening
    finally:
        qp.stop_profiler_server()
    with pytest.raises(qp.ProfilerStateError, match="no profiler server"):
        qp.stop_profiler_server()


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    return qp.main(["--batch", "2", "--prompt-len", "16", "--decode-steps", "2", "--dtype", "float32",
                    "--copy-mib", "16", "--out", str(out), "--compilation-cache-dir", XLA_CACHE])


def test_profile_table_covers_every_layer(report):
    from qwen35_jax.tools.make_tiny_model import TEXT_CONFIG
    kinds = TEXT_CONFIG["layer_types"]
    assert report.layer_types == tuple(kinds)
    block = {"linear_attention": "gdn", "full_attention": "attention"}
    for phase in ("prefill", "decode"):
        layers = report.by_layer(phase)
        assert sorted(layers) == list(range(len(kinds)))
        for i, kind in enumerate(kinds):
            mixer = {k: v for k, v in layers[i].items() if k.startswith(block[kind] + "/")}
            mlp = {k: v for k, v in layers[i].items() if k.startswith("mlp/")}
            assert sum(mixer.values()) > 0 and sum(mlp.values()) > 0, (phase, i, layers[i])
            other = block["full_attention" if kind == "linear_attention" else "linear_attention"]
            assert not any(k.startswith(other + "/") for k in layers[i])
        blocks = report.by_block(phase)
        for name in ("embed", "gdn", "attention", "mlp", "lm_head", "sampling"):
            assert blocks.get(name, 0) > 0, (phase, name, blocks)
        assert blocks.get(pt.UNATTRIBUTED, 0) == 0, blocks     # on CPU every op event maps to our executables
        # Unscoped ops (copies, all-gathers XLA adds) stay a small share; taken in the step where it is smallest,
        # since on a loaded CPU one preempted op can take milliseconds (seen in CI: a 1.8 ms unscoped fusion).
        windows = [report.prefill] if phase == "prefill" else report.decode
        share = min(sum(e.self_ns for e in w.events if e.scope[0] == pt.UNSCOPED) / sum(e.self_ns for e in w.events)
                    for w in windows)
        assert share < 0.2, (share, blocks)
    scopes = report.by_scope("decode")
    for s in ("gdn/in_proj", "gdn/conv1d", "gdn/gated_delta_rule", "gdn/gated_norm", "gdn/out_proj",
              "attention/qkv_proj", "attention/attention", "attention/o_proj", "mlp/gate_up", "mlp/down_proj"):
        assert scopes.get(s, 0) > 0, (s, scopes)
    text = qp.format_report(report)
    for i in range(len(kinds)):
        assert any(line.split()[:1] == [str(i)] for line in text.splitlines()), i


def test_profile_steps_and_roofline(report):
    from qwen35_jax.model.config import load_config
    from qwen35_jax.model.sharding import Layout
    from qwen35_jax.model.state import bytes_per_slot
    from qwen35_jax.model.hub import default_model_dir
    from qwen35_jax.model.weights import abstract_weights, nbytes

    assert len(report.decode) == 2 and len(report.copies) == qp.COPY_RUNS
    for w in [report.prefill] + report.decode + report.copies:
        assert 0 < w.device_span_ms <= w.host_ms
        assert len({e.module for e in w.events}) == 1          # one executable per step
    assert report.outside_ms < 0.05 * report.prefill.op_ms
    # The floor's bytes, recomputed from the config (tp 1, fp32, tied embedding: every weight is read once).
    cfg = load_config(default_model_dir())
    fb = report.floor_bytes
    assert fb["weights"] == nbytes(abstract_weights(cfg, Layout.build(cfg, 1), jnp.float32))
    assert fb["gdn_state"] == 2 * 2 * bytes_per_slot(cfg, jnp.float32)
    per_token = 2 * cfg.num_kv_heads * cfg.head_dim * 4
    assert fb["kv"] == len(cfg.attn_layers) * int(2 * per_token * (16 + 1.5 + 1))
    assert 1e8 < report.copy_bandwidth < 1e13
    assert report.floor_ms == pytest.approx(sum(fb.values()) / report.copy_bandwidth * 1e3)
    assert report.roofline_ratio == pytest.approx(report.floor_ms / report.decode_wall_ms)
    assert report.traced_roofline_ratio == pytest.approx(report.floor_ms / report.decode_ms)
    assert report.decode_wall_ms > 0
    text = qp.format_report(report)
    for needle in ("prefill 0", "decode 1", "roofline ratio", "gdn layer", "attention layer", "sampling"):
        assert needle in text
    # The session holds what load_report needs; reading it back gives the same numbers.
    again = qp.load_report(report.session)
    assert again.by_block("decode") == report.by_block("decode")
    assert os.path.exists(os.path.join(report.session, "perfetto_trace.json.gz"))


def test_record_results(report, tmp_path, monkeypatch):
    """bench/profile.py records the table through bench/results.py: a JSON file per run under the runs directory
    ($QWEN35_RUNS_DIR, here a temporary one) and a section appended to its history.md."""
    import json

    from bench import profile as bp
    monkeypatch.setenv("QWEN35_RUNS_DIR", str(tmp_path))
    first = bp.record(report, "python bench/profile.py --batch 2")
    again = bp.record(report, "python bench/profile.py --batch 2")     # same title, same process: replaced
    assert first == again and os.path.dirname(first) == str(tmp_path)
    text = open(tmp_path / "history.md").read()
    assert text.count("## Profile: tiny-qwen3.5-pydoc: batch 2, prompt 16, 2 decode steps") == 1
    assert "- command: `python bench/profile.py --batch 2`" in text and "- machine: " in text
    assert "roofline ratio" in text and "- commit: " in text
    run = json.load(open(first))
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}_profile-tiny-qwen3-5-pydoc-batch-2-prompt-16-[a-z0-9-]*\.json",
                        os.path.basename(first))
    assert run["title"].startswith("Profile: tiny-qwen3.5-pydoc:") and run["command"] == "python bench/profile.py --batch 2"
    assert run["fields"]["roofline_ratio"] == pytest.approx(report.roofline_ratio)
    assert "roofline ratio" in run["body"] and {"commit", "machine", "date"} <= set(run)
    with pytest.raises(SystemExit):                      # the product's command line records nothing itself
        qp.main(["--append-results"])


def test_summarize_engine_trace(tmp_path):
    """What the server does: trace live engine steps with start/stop_profile, then attribute the device time with
    the HLO of the engine's compiled buckets (several executables share the module name jit__lambda)."""
    from conftest import engine_args
    from qwen35_jax.llm import LLM
    from qwen35_jax.engine.sampling_params import SamplingParams
    from qwen35_jax.model.hub import default_model_dir

    llm = LLM(default_model_dir(), skip_tokenizer_init=True,
              **engine_args(max_num_seqs=2, max_num_batched_tokens=32, min_prefill_tokens=32, max_prefill_rows=1,
                            precompile=False))
    try:
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        llm.generate([[5, 6, 7], [8, 9]], params)                       # compile the buckets outside the trace
        qp.start_profile(str(tmp_path))
        try:
            llm.generate([[5, 6, 7], [8, 9]], params)
        finally:
            session = qp.stop_profile()
        texts = [exe.as_text() for exe in llm.engine.executor.compiled.values()]
        assert len(texts) >= 2
        blocks = qp.summarize(session, texts)
        for name in ("embed", "gdn", "attention", "mlp", "lm_head", "sampling"):
            assert blocks.get(name, 0) > 0, (name, blocks)
        assert blocks.get(pt.UNATTRIBUTED, 0) == 0, blocks
        assert set(qp.summarize(session)) == {pt.UNATTRIBUTED}          # without the HLO, CPU events say nothing
    finally:
        llm.shutdown()


GPU_NAMES_HLO = """HloModule jit_decode, is_scheduled=true

%fused_psum.458.0.clone (param_0.6043: f32[16,4096]) -> f32[16,4096] {
  %param_0.6043 = f32[16,4096]{1,0} parameter(0)
  ROOT %psum.458.2 = f32[16,4096]{1,0} all-reduce(%param_0.6043), channel_id=1, to_apply=%region_8.9, metadata={op_name="jit(f)/shard_map/layer1/gdn/out_proj/psum"}
}

ENTRY %main.1 (a.1: f32[16,4096], p.1: s32[16]) -> f32[16,4096] {
  %a.1 = f32[16,4096]{1,0} parameter(0)
  %p.1 = s32[16]{0} parameter(1)
  %pallas_call.179 = (f32[16,4096]{1,0}) custom-call(%p.1, %a.1), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/layer0/gdn/gated_delta_rule/gdn_decode/pallas_call"}, backend_config={debug = false, grid_x = 16 : i32, name = "gdn_decode", num_stages = 1 : i32}
  %gte.1 = f32[16,4096]{1,0} get-tuple-element(%pallas_call.179), index=0
  %fusion-start.3 = ((f32[16,4096]{1,0}), f32[16,4096]{1,0}) fusion-start(%gte.1), kind=kCustom, calls=%fused_psum.458.0.clone, metadata={op_name="jit(f)/shard_map/layer1/gdn/out_proj/psum"}
  %fusion-done.3 = f32[16,4096]{1,0} fusion-done(%fusion-start.3)
  ROOT %sort.8.1 = f32[16,4096]{1,0} sort(%fusion-done.3), dimensions={1}, to_apply=%cmp.1, metadata={op_name="jit(f)/sampling/sort"}
}
"""


def test_gpu_kernel_names_resolve():
    """Kernel names seen in H200 traces: Pallas kernels named in an MLIR-style backend_config, the passes of one
    sort ("sort_8_1__20"), and XLA's collective kernels named after the computation their fusion-start calls."""
    exe = pt.Executable(GPU_NAMES_HLO)
    assert exe.instrs["pallas_call.179"].kernel == "gdn_decode"
    assert exe.find(None, "sort_8_1__20") == "sort.8.1" and exe.find(None, "sort_8_1") == "sort.8.1"
    assert exe.find(None, "psum_458_0_fusion_1") == "fusion-start.3"
    assert pt.scope_of(exe.op_name("fusion-start.3")) == ("layer1", "gdn", "out_proj")
    assert exe.find(None, "no_such_kernel__3") is None


LOOPS_HLO = """HloModule jit_prefill, is_scheduled=true

%body.1 (p.1: f32[4]) -> f32[4] {
  %p.1 = f32[4]{0} parameter(0)
  ROOT %exp.1 = f32[4]{0} exponential(%p.1), metadata={op_name="jit(f)/layer3/attention/attention/while/body/exp"}
}

%body.1.clone (p.2: f32[4]) -> f32[4] {
  %p.2 = f32[4]{0} parameter(0)
  ROOT %exp.2 = f32[4]{0} exponential(%p.2), metadata={op_name="jit(f)/layer3/attention/attention/while/body/exp"}
}

ENTRY %main.1 (a.1: f32[4]) -> f32[4] {
  %a.1 = f32[4]{0} parameter(0)
  %dot.1 = f32[4]{0} multiply(%a.1, %a.1), metadata={op_name="jit(f)/layer3/attention/qkv_proj/mul"}
  %while.1 = f32[4]{0} while(%dot.1), condition=%cond.1, body=%body.1, metadata={op_name="jit(f)/layer3/attention/attention/while"}
  %dot.2 = f32[4]{0} multiply(%while.1, %while.1), metadata={op_name="jit(f)/layer7/attention/qkv_proj/mul"}
  ROOT %while.2 = f32[4]{0} while(%dot.2), condition=%cond.2, body=%body.1.clone, metadata={op_name="jit(f)/layer7/attention/attention/while"}
}
"""


def test_loop_bodies_launch_at_their_loop_and_take_its_layer():
    """XLA clones a loop body per call site keeping the first site's metadata: the second loop's ops belong to
    layer 7, and launch between layer 7's ops, not before the entry computation."""
    exe = pt.Executable(LOOPS_HLO)
    order = [n for n in exe.launch_order() if not n.startswith(("p.", "a."))]
    assert order == ["dot.1", "exp.1", "while.1", "dot.2", "exp.2", "while.2"]
    assert pt.scope_of(exe.op_name("exp.1"))[:3] == ("layer3", "attention", "attention")
    assert pt.scope_of(exe.op_name("exp.2"))[:3] == ("layer7", "attention", "attention")
