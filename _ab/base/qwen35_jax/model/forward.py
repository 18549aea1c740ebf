"""The Qwen3.5 text decoder as pure functions of (weights, state, batch), run per rank inside one `shard_map`.

One code path serves prefill and decode: a batch is N rows of T tokens (a prompt chunk per row, or T = 1 for
decode), each row continuing its own request from `start` with `lens` real tokens, its GDN state in slot
`slots[n]` and its K/V in pages `pages[n]`. A mixed step runs two such batches (decode rows and a prefill chunk) as
groups of one pass (`decoder_groups`): projections and MLP over both groups' tokens, each mixer per group. Inside
`shard_map` every array has its per-rank shape; the only collectives are the `psum`s after the row-parallel
projections (o_proj, out_proj, down_proj) and the embedding lookup, all over `tp`. The recurrent and conv states
are never all-reduced.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pallas_kernels.expert_gemm import router_top_k_reference, routed_experts_reference
from pallas_kernels.gemv import ROWS as GEMV_ROWS
from qwen35_jax.model import attention as attn_ops
from qwen35_jax.model.config import ModelConfig
from qwen35_jax.model.sharding import DP, TP, Layout
from qwen35_jax.model.state import State
from qwen35_jax.model.weights import Attention, GatedDeltaNet, Weights


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Batch:
    tokens: Any   # [N, T] int32
    start: Any    # [N] int32: tokens already in this request's state (position of tokens[:, 0])
    lens: Any     # [N] int32: real tokens in the row (0 = padded row)
    slots: Any    # [N] int32: GDN state slot (0 = null slot)
    pages: Any    # [N, P] int32: KV page table (0 = null page)


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The GDN/conv/attention operations the model runs; a backend supplies them (see qwen35_jax.model.backends).
    Contracts: pallas_kernels/gdn_reference.py, conv1d_reference.py and attention.decode_attention. Prefill rows
    starting at position 0 begin from zero state (use_state False), so a recycled slot never leaks its previous
    request's state. Decode reads the layer's packed activations in place (gdn_decode_packed, and conv_decode on
    the whole input projection): slicing them first would cost a kernel launch per slice and layer."""
    gdn_prefill: Callable
    gdn_decode: Callable
    conv_prefill: Callable
    conv_decode: Callable
    attention_decode: Callable
    attention_prefill: Callable = attn_ops.paged_attention    # contract: attention.paged_attention
    # several tokens per row from the slot's state, the state written or only read (speculative decoding's verify
    # and commit); contract: pallas_kernels.gdn.gdn_decode_tokens_packed
    gdn_tokens: Callable | None = None
    gate_up_rounds_from: int = 64       # decode rows from which gate_up's GEMM rounds its result (mlp_block)
    # decode batches from split_k_from rows: the row-parallel GEMMs as one batched dot over split_k ranges of K
    # (row_parallel), compiled with XLA's own K splits off (Executor._compiler_options: in_proj runs unsplit)
    split_k: int = 1
    split_k_from: int = 64
    # decode attention from the packed qkv: (qkv [N, W], q_norm, k_norm, k_pages, v_pages, pages, positions, lens,
    # *, q_heads, rotary_dim, theta, eps) -> (query tiles, k_pages, v_pages), then attention_tiles(tiles, q_heads,
    # k_pages, v_pages, pages, ctx) -> [N, Hq, D]; None: XLA's norm / RoPE / K-V write, then attention_decode
    attention_prologue: Callable | None = None
    attention_tiles: Callable | None = None
    # an MoE layer's routed and shared experts on this rank, and its router's choice of them; contracts:
    # pallas_kernels.expert_gemm.routed_experts_reference and router_top_k_reference
    routed_experts: Callable = routed_experts_reference
    router_top_k: Callable = router_top_k_reference
    # a prefill step's lm_head (its rows' last tokens, up to pallas_kernels.gemv.ROWS, an untied head): (x [M, K],
    # w [K, N], out_dtype) -> [M, N]; contract: pallas_kernels.gemv.gemv_reference; None: XLA's dot
    prefill_head: Callable | None = None


VECTOR_DOT_LIMIT = 10_000_000      # XLA:GPU DotStrengthReduction: IsMatrixMultiplicationTooSmallForRewriting


def project(x, w, out_dtype=None, gemm_rounds=False):
    """x [N, T, K] @ w with fp32 accumulation, rounded once to out_dtype (default x.dtype). Prefill (T > 1) asks
    the GEMM for out_dtype itself: cuBLAS rounds its fp32 accumulators on the way out, where an fp32 result would
    go to memory and back through a convert of its own. Decode (T = 1) asks for fp32 and rounds after: XLA splits
    those GEMMs over K (or row_parallel does, from kernels.split_k_from rows), and the rounding then rides in the
    fusion that adds the partial sums.
    gemm_rounds: a decode GEMM rounds its result itself too (gate_up in large batches, mlp_block).
    A single row against fewer than VECTOR_DOT_LIMIT weight elements is multiplied as two (the second zeros): XLA's
    GPU compiler rewrites such a vector-matrix product into a multiply and a reduce (DotStrengthReduction), which
    it emitted as the whole fp32 product written out and read back (a 35B-A3B decode step, bench/RESULTS.md)."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if x.shape[0] * x.shape[1] == 1 and 1 < w.shape[-1] and w.size + x.size < VECTOR_DOT_LIMIT:
        return project(jnp.concatenate([x, jnp.zeros_like(x)]), w, out_dtype, gemm_rounds)[:1]
    if x.shape[1] > 1 or gemm_rounds:
        return jnp.dot(x, w, preferred_element_type=out_dtype)
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(out_dtype)


def rms_norm_1p(x, w, eps):
    """Zero-centred RMSNorm: normalise in fp32, scale by (1 + w), cast last."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def gated_norm(o, z, w, eps):
    """GDN output norm: RMS-normalise o (plain weight w), then gate by silu(z); norm before gate."""
    of = o.astype(jnp.float32)
    y = of * jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(o.dtype)


def row_parallel(kernels: Kernels, x, w):
    """x @ w where w's rows are split over tp: per-rank partial sums in fp32, one all-reduce, one rounding (a
    prefill at tp = 1 has nothing to sum: its GEMM rounds). Decode of kernels.split_k_from rows or more with
    kernels.split_k = S > 1: each rank's GEMM as one batched dot over S ranges of K, its fp32 parts summed before
    the all-reduce: the split XLA makes of these GEMMs by itself, so that it can be told to split no other one."""
    n, t, k = x.shape
    if t > 1 and jax.lax.axis_size(TP) == 1:
        return project(x, w)
    s = kernels.split_k
    if t == 1 and s > 1 and n >= kernels.split_k_from:
        if k % s:
            raise ValueError(f"decode_split_k={s} does not divide this rank's K = {k} of a row-parallel GEMM")
        parts = jax.lax.dot_general(x.reshape(n, s, k // s), w.reshape(s, k // s, -1), (((2,), (1,)), ((1,), (0,))),
                                    preferred_element_type=jnp.float32)              # [S, N, D]
        return jax.lax.psum(parts.sum(0)[:, None], TP).astype(x.dtype)
    return jax.lax.psum(project(x, w, jnp.float32), TP).astype(x.dtype)


def rope(x, positions, rotary_dim, theta):
    """Half-split RoPE on the first rotary_dim dims of each head. x [N,T,H,D], positions [N,T]."""
    inv = theta ** (-jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim)
    freqs = positions.astype(jnp.float32)[..., None] * inv
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    xr = x[..., :rotary_dim].astype(jnp.float32)
    half = rotary_dim // 2
    rotated = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    out = (xr * cos + rotated * sin).astype(x.dtype)
    return jnp.concatenate([out, x[..., rotary_dim:]], axis=-1)


def embed(cfg: ModelConfig, table, tokens):
    """Vocab-sharded lookup: each rank fills the rows it owns, one psum assembles them (exact)."""
    rows = table.shape[0]
    local = tokens - jax.lax.axis_index(TP) * rows
    ok = (local >= 0) & (local < rows)
    x = jnp.where(ok[..., None], table[jnp.clip(local, 0, rows - 1)], 0)
    return jax.lax.psum(x, TP)


# Up to this many tokens per row (a speculative verify pass of k + 1, the MTP head over a step's kept tokens), the
# attention runs each query as a row of the paged decode kernel (attention.few_token_attention); longer passes
# (prefill chunks) take kernels.attention_prefill.
FEW_TOKENS = 8


def shared(f, xs):
    """f over the tokens of every group of rows at once, its result split back per group (xs: [N_i, T_i, ...]
    arrays, as one [1, sum N_i T_i, ...] array to f): a mixed step's decode rows and prefill chunk go through each
    projection as one GEMM, which reads the weights once for both. One group: f(x) itself."""
    if len(xs) == 1:
        return [f(xs[0])]
    y = f(jnp.concatenate([x.reshape(1, -1, *x.shape[2:]) for x in xs], axis=1))
    ends = np.cumsum([x.shape[0] * x.shape[1] for x in xs])[:-1]
    return [part.reshape(*x.shape[:2], *part.shape[2:]) for x, part in zip(xs, jnp.split(y, ends, axis=1))]


def attention_block(cfg: ModelConfig, layout: Layout, kernels: Kernels, w: Attention, xs, k_pages, v_pages,
                    batches, positions):
    """Gated full attention of each group of rows (xs, batches and positions: one per group), the projections
    shared by the groups."""
    with jax.named_scope("qkv_proj"):
        qkvs = shared(lambda x: project(x, w.qkv), xs)
    outs = []
    for qkv, batch, pos in zip(qkvs, batches, positions):
        o, k_pages, v_pages = attention_core(cfg, layout, kernels, w, qkv, k_pages, v_pages, batch, pos)
        outs.append(o)
    with jax.named_scope("o_proj"):
        return shared(lambda o: row_parallel(kernels, o, w.o_proj), outs), k_pages, v_pages


def attention_core(cfg: ModelConfig, layout: Layout, kernels: Kernels, w: Attention, qkv, k_pages, v_pages,
                   batch: Batch, positions):
    """One group's attention from its packed projection qkv [N, T, W]: q / k norms, RoPE, the K/V write, the
    attention and its sigmoid output gate. Returns (o [N, T, Hq * D], k_pages, v_pages)."""
    n, t, _ = qkv.shape
    d, hq, hkv = cfg.head_dim, layout.q_heads, layout.kv_heads
    qg, k, v = jnp.split(qkv, [hq * 2 * d, hq * 2 * d + hkv * d], axis=-1)
    qg = qg.reshape(n, t, hq, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(n, t, hq * d)
    k, v = k.reshape(n, t, hkv, d), v.reshape(n, t, hkv, d)
    ctx = batch.start + batch.lens
    if t == 1 and kernels.attention_prologue is not None:      # decode: one kernel up to the attention kernel's tiles
        with jax.named_scope("qk_norm_rope"):
            tiles, k_pages, v_pages = kernels.attention_prologue(
                qkv[:, 0], w.q_norm, w.k_norm, k_pages, v_pages, batch.pages, batch.start, batch.lens, q_heads=hq,
                rotary_dim=cfg.rotary_dim, theta=cfg.rope_theta, eps=cfg.rms_norm_eps)
        with jax.named_scope("attention"):
            o = kernels.attention_tiles(tiles, hq, k_pages, v_pages, batch.pages, ctx)[:, None]
    else:
        with jax.named_scope("qk_norm_rope"):
            q = rope(rms_norm_1p(q, w.q_norm, cfg.rms_norm_eps), positions, cfg.rotary_dim, cfg.rope_theta)
            k = rope(rms_norm_1p(k, w.k_norm, cfg.rms_norm_eps), positions, cfg.rotary_dim, cfg.rope_theta)
        with jax.named_scope("kv_write"):
            k_pages, v_pages = attn_ops.write_kv(k_pages, v_pages, k, v, batch.pages, positions, batch.lens)
        with jax.named_scope("attention"):
            if t == 1:
                o = kernels.attention_decode(q[:, 0], k_pages, v_pages, batch.pages, ctx)[:, None]
            elif t <= FEW_TOKENS:
                o = attn_ops.few_token_attention(kernels.attention_decode, q, k_pages, v_pages, batch.pages,
                                                 batch.start, batch.lens)
            else:
                o = kernels.attention_prefill(q, k_pages, v_pages, batch.pages, positions, ctx)
    with jax.named_scope("attention"):
        return o.reshape(n, t, hq * d) * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(qkv.dtype), k_pages, v_pages


def gdn_block(cfg: ModelConfig, layout: Layout, kernels: Kernels, w: GatedDeltaNet, xs, conv_pool, rec_pool,
              batches):
    """Gated DeltaNet of each group of rows (xs and batches: one per group), the projections shared by the
    groups."""
    with jax.named_scope("in_proj"):
        projs = shared(lambda x: project(x, w.in_proj), xs)     # [q | k | v | z | b | a] per rank
    outs = []
    for proj, batch in zip(projs, batches):
        o, conv_pool, rec_pool = gdn_core(cfg, layout, kernels, w, proj, conv_pool, rec_pool, batch)
        outs.append(o)
    with jax.named_scope("out_proj"):
        return shared(lambda o: row_parallel(kernels, o, w.out_proj), outs), conv_pool, rec_pool


def gdn_core(cfg: ModelConfig, layout: Layout, kernels: Kernels, w: GatedDeltaNet, proj, conv_pool, rec_pool,
             batch: Batch):
    """One group's Gated DeltaNet from its packed input projection proj [N, T, W]: the causal conv, the gated
    delta rule (state in the group's slots) and the gated output norm. Returns (o [N, T, Hv * Dv], pools)."""
    n, t, _ = proj.shape
    hk, hv = layout.k_heads, layout.v_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    kl, vl = hk * dk, hv * dv
    z = proj[..., 2 * kl + vl:2 * kl + 2 * vl]
    if t == 1:      # decode: the kernels read q | k | v, b and a out of the packed arrays
        with jax.named_scope("conv1d"):
            y, conv_pool = kernels.conv_decode(proj[:, 0], w.conv, conv_pool, batch.slots)
        with jax.named_scope("gated_delta_rule"):
            o, rec_pool = kernels.gdn_decode(y, proj[:, 0], w.A_log, w.dt_bias, rec_pool, batch.slots)
            o = o[:, None]
    else:
        b, a = proj[..., 2 * kl + 2 * vl:2 * kl + 2 * vl + hv], proj[..., 2 * kl + 2 * vl + hv:]
        # q | k | v are proj's first columns: the conv reads them in place and writes q, k and v as arrays of
        # their own (a split after the kernel would copy them all once more)
        with jax.named_scope("conv1d"):
            (q, k, v), conv_pool = kernels.conv_prefill(proj, w.conv, conv_pool, batch.slots, batch.lens,
                                                        batch.start > 0, split=(kl, 2 * kl))
        q, k, v = q.reshape(n, t, hk, dk), k.reshape(n, t, hk, dk), v.reshape(n, t, hv, dv)
        with jax.named_scope("gated_delta_rule"):
            o, rec_pool = kernels.gdn_prefill(q, k, v, a, b, w.A_log, w.dt_bias, rec_pool, batch.slots, batch.lens,
                                              batch.start > 0)
    with jax.named_scope("gated_norm"):
        return gated_norm(o, z.reshape(n, t, hv, dv), w.norm, cfg.rms_norm_eps).reshape(n, t, vl), conv_pool, rec_pool


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Pending:
    """What commit needs of one GDN layer's verify pass: the conv state before it [N, K-1, C], the pass's conv
    inputs [N, T, C] and outputs (q | k | v) [N, T, C], and the gates' raw projections (b | a) [N, T, 2 Hv]."""
    conv_state: Any
    conv_in: Any
    qkv: Any
    gates: Any


def gdn_verify(cfg: ModelConfig, layout: Layout, kernels: Kernels, w: GatedDeltaNet, x, conv_pool, rec_pool,
               batch: Batch):
    """gdn_block over T tokens per row of which only a prefix will be kept (a speculative verify pass): every
    token's output from the row's state, the recurrent state only read. The conv writes its state as prefill
    does; `commit` rewrites it. Returns (out, conv_pool, Pending)."""
    n, t, _ = x.shape
    hv, dv = layout.v_heads, cfg.linear_value_head_dim
    width = 2 * layout.k_heads * cfg.linear_key_head_dim + hv * dv
    with jax.named_scope("in_proj"):
        proj = project(x, w.in_proj)                   # [q | k | v | z | b | a] per rank
    z, gates = proj[..., width:width + hv * dv], proj[..., width + hv * dv:]
    before = conv_pool[batch.slots]
    with jax.named_scope("conv1d"):
        qkv, conv_pool = kernels.conv_prefill(proj, w.conv, conv_pool, batch.slots, batch.lens, batch.lens >= 0)
    with jax.named_scope("gated_delta_rule"):
        o, _ = kernels.gdn_tokens(qkv, gates, w.A_log, w.dt_bias, rec_pool, batch.slots, batch.lens, write=False)
    with jax.named_scope("gated_norm"):
        o = gated_norm(o, z.reshape(n, t, hv, dv), w.norm, cfg.rms_norm_eps).reshape(n, t, hv * dv)
    with jax.named_scope("out_proj"):
        out = row_parallel(kernels, o, w.out_proj)
    return out, conv_pool, Pending(conv_state=before, conv_in=proj[..., :width], qkv=qkv, gates=gates)


def gdn_commit(w: GatedDeltaNet, kernels: Kernels, conv_pool, rec_pool, pending: Pending, slots, accepted):
    """Advance one GDN layer's state by each row's first `accepted` tokens of its verify pass: the conv state
    becomes the last K-1 inputs up to them, the recurrence runs them from the state the pass read."""
    km1 = pending.conv_state.shape[1]
    ext = jnp.concatenate([pending.conv_state, pending.conv_in.astype(pending.conv_state.dtype)], axis=1)
    state = jax.vmap(lambda e, m: jax.lax.dynamic_slice_in_dim(e, m, km1, axis=0))(ext, accepted)
    conv_pool = conv_pool.at[slots].set(state)
    _, rec_pool = kernels.gdn_tokens(pending.qkv, pending.gates, w.A_log, w.dt_bias, rec_pool, slots, accepted,
                                     write=True)
    return conv_pool, rec_pool


def mlp_block(kernels: Kernels, w, x):
    with jax.named_scope("gate_up"):
        # Prefill, and decode from kernels.gate_up_rounds_from rows: x.dtype from the GEMM itself (as HF rounds
        # gate_proj and up_proj), half the bytes to the SiLU. Smaller decode batches: fp32 from the dot into the
        # SiLU, which measured faster there (bench/RESULTS.md).
        fp32_out = x.shape[1] == 1 and x.shape[0] < kernels.gate_up_rounds_from
        gate, up = jnp.split(project(x, w.gate_up, jnp.float32 if fp32_out else None,
                                     gemm_rounds=not fp32_out), 2, axis=-1)
        f32 = lambda a: a.astype(jnp.float32)
        h = (jax.nn.silu(f32(gate)) * f32(up)).astype(x.dtype)
    with jax.named_scope("down_proj"):
        return row_parallel(kernels, h, w.down)


def moe_block(cfg: ModelConfig, layout: Layout, kernels: Kernels, w, x, live=None):
    """Qwen3.5's sparse MLP (weights.MoE) on this rank: the router's softmax over all E experts in fp32, the top k
    renormalised and rounded to the model dtype (as HF), this rank's E / tp experts over the tokens routed to them
    and the shared expert's partial sums times its sigmoid gate (kernels.routed_experts), and one all-reduce of both
    over tp, in the place of the dense MLP's. live [N*T] bool: tokens that route at all (None: every one); the
    others read no expert and get the shared expert's output alone."""
    n, t, h = x.shape
    k, el = cfg.num_experts_per_tok, layout.experts
    xs = x.reshape(n * t, h)
    with jax.named_scope("router"):
        top, idx = kernels.router_top_k(project(x, w.router).reshape(n * t, -1), k=k,
                                        live=jnp.ones(n * t, bool) if live is None else live)
    with jax.named_scope("experts"):
        local = idx - jax.lax.axis_index(TP) * el                          # [N*T, k] expert on this rank
        if el < cfg.num_experts:                                           # -1: another rank's
            local = jnp.where((local >= 0) & (local < el), local, -1)
        out = kernels.routed_experts(xs, local, top, w.gate_up, w.down, (w.shared.gate_up, w.shared.down,
                                                                           w.shared_gate))
    return jax.lax.psum(out.reshape(n, t, h), TP).astype(x.dtype)


def decoder_layer(cfg: ModelConfig, layout: Layout, kernels: Kernels, kind: str, layer, xs, cache, batches,
                  positions, verify: bool = False):
    """One pre-norm layer (mixer, then MLP, each added to the residual) over groups of rows: xs, batches and
    positions hold one entry per group (a mixed step's decode rows and prefill chunk; else one group). The
    projections and the MLP run over every group's tokens at once (`shared`), each mixer per group. cache:
    (k_pages, v_pages) of a full-attention layer, (conv, recurrent) of a GDN layer; returns (xs, new cache).
    verify: a speculative verify pass of one group (gdn_verify: a GDN layer's cache comes back as (conv,
    recurrent, Pending))."""
    hs = [rms_norm_1p(x, layer.input_norm, cfg.rms_norm_eps) for x in xs]
    if kind == "full_attention":
        with jax.named_scope("attention"):
            hs, *cache = attention_block(cfg, layout, kernels, layer.mixer, hs, *cache, batches, positions)
    elif verify:
        (h,), (batch,) = hs, batches
        with jax.named_scope("gdn"):
            h, conv, pending = gdn_verify(cfg, layout, kernels, layer.mixer, h, cache[0], cache[1], batch)
            hs, cache = [h], (conv, cache[1], pending)
    else:
        with jax.named_scope("gdn"):
            hs, *cache = gdn_block(cfg, layout, kernels, layer.mixer, hs, *cache, batches)
    xs = [x + h for x, h in zip(xs, hs)]
    with jax.named_scope("mlp"):
        hs = [rms_norm_1p(x, layer.post_norm, cfg.rms_norm_eps) for x in xs]
        if cfg.moe:         # padding tokens (a bucket's empty rows, a chunk's tail) route to no expert
            live = jnp.concatenate([(jnp.arange(b.tokens.shape[1]) < b.lens[:, None]).reshape(-1) for b in batches])
            mlp = functools.partial(moe_block, cfg, layout, kernels, layer.mlp, live=live)
        else:
            mlp = functools.partial(mlp_block, kernels, layer.mlp)
        xs = [x + h for x, h in zip(xs, shared(mlp, hs))]
    return xs, tuple(cache)


def decoder(cfg: ModelConfig, layout: Layout, kernels: Kernels, weights: Weights, state: State, batch: Batch,
            verify: bool = False):
    """Embedding and every decoder layer: (hidden states after the final norm [N, T, H], new state). The MTP head
    starts from these hidden states. verify: a speculative verify pass, whose GDN recurrent state is only read;
    returns (hidden, state, [Pending per GDN layer]) for `commit`."""
    (x,), *rest = decoder_groups(cfg, layout, kernels, weights, state, (batch,), verify)
    return (x, *rest)


def decoder_groups(cfg: ModelConfig, layout: Layout, kernels: Kernels, weights: Weights, state: State, batches,
                   verify: bool = False):
    """`decoder` over several groups of rows in one pass (a mixed step: decode rows [B, 1] and a prefill chunk
    [N, T]), each group with its own slots and pages: every weight is read once for all of them. Returns a list
    of hidden states, one per group, and the new state (and the Pending list with verify)."""
    positions = [b.start[:, None] + jnp.arange(b.tokens.shape[1], dtype=jnp.int32)[None, :] for b in batches]
    with jax.named_scope("embed"):
        xs = shared(lambda tokens: embed(cfg, weights.embed, tokens), [b.tokens for b in batches])
    conv, rec, kp, vp = list(state.conv), list(state.recurrent), list(state.k_pages), list(state.v_pages)
    pending = []
    gi = ai = 0
    for i, (kind, layer) in enumerate(zip(cfg.layer_types, weights.layers)):
        with jax.named_scope(f"layer{i}"):
            if kind == "full_attention":
                xs, (kp[ai], vp[ai]) = decoder_layer(cfg, layout, kernels, kind, layer, xs, (kp[ai], vp[ai]),
                                                     batches, positions)
                ai += 1
            else:
                xs, (conv[gi], rec[gi], *p) = decoder_layer(cfg, layout, kernels, kind, layer, xs,
                                                            (conv[gi], rec[gi]), batches, positions, verify)
                pending += p
                gi += 1
    with jax.named_scope("lm_head"):         # the final norm is profiled with the head, as before the split
        xs = [rms_norm_1p(x, weights.final_norm, cfg.rms_norm_eps) for x in xs]
    state = State(conv=conv, recurrent=rec, k_pages=kp, v_pages=vp)
    return (xs, state, pending) if verify else (xs, state)


def commit(cfg: ModelConfig, kernels: Kernels, weights: Weights, state: State, pending: list, slots, accepted):
    """After a verify pass (`decoder(..., verify=True)`): advance every GDN layer's state by each row's first
    `accepted` tokens of the pass (0 leaves it). Its K/V stays written; positions past the accepted ones are
    never read before the next pass writes them again."""
    conv, rec = list(state.conv), list(state.recurrent)
    gdn = [layer for kind, layer in zip(cfg.layer_types, weights.layers) if kind != "full_attention"]
    with jax.named_scope("commit"):
        for i, (layer, p) in enumerate(zip(gdn, pending)):
            conv[i], rec[i] = gdn_commit(layer.mixer, kernels, conv[i], rec[i], p, slots, accepted)
    return dataclasses.replace(state, conv=conv, recurrent=rec)


def lm_head(cfg: ModelConfig, weights: Weights, x, gemv: Callable | None = None):
    """fp32 logits over this rank's vocab shard; vocab padding (rows added so tp divides the vocab) is -inf, so it
    is never sampled. gemv: x [M <= gemv.ROWS, H] times an untied head on that kernel (a tied one would be copied
    transposed for it)."""
    with jax.named_scope("lm_head"):
        head = weights.lm_head if weights.lm_head is not None else weights.embed.T
        if gemv is not None and weights.lm_head is not None and x.shape[0] <= GEMV_ROWS:
            logits = gemv(x, head, jnp.float32)
        else:
            logits = jnp.dot(x, head, preferred_element_type=jnp.float32)
        col = jax.lax.axis_index(TP) * head.shape[1] + jnp.arange(head.shape[1])
        return jnp.where(col < cfg.vocab_size, logits, -jnp.inf)


def mtp(cfg: ModelConfig, layout: Layout, kernels: Kernels, weights: Weights, hidden, next_tokens, k_pages, v_pages,
        batch: Batch):
    """Qwen3.5's multi-token-prediction head: from the hidden state at position p (`decoder`'s output) and the
    token at p + 1 (next_tokens), the state whose logits predict the token at p + 2:
    fc(concat[norm_e(embed(next)), norm_h(hidden)]), one full-attention decoder layer with its own K/V pages (at
    the positions of `batch`), mtp.norm; the shared head (`lm_head`) reads what this returns. Returns (that normed
    hidden state [N, T, H], from which a chained draft step also starts, as vLLM chains it; k_pages, v_pages)."""
    w = weights.mtp
    t = batch.tokens.shape[1]
    positions = batch.start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    with jax.named_scope("mtp"):
        e = rms_norm_1p(embed(cfg, weights.embed, next_tokens), w.pre_fc_norm_embedding, cfg.rms_norm_eps)
        h = rms_norm_1p(hidden, w.pre_fc_norm_hidden, cfg.rms_norm_eps)
        x = project(jnp.concatenate([e, h], axis=-1), w.fc)
        (x,), (k_pages, v_pages) = decoder_layer(cfg, layout, kernels, "full_attention", w.layer, [x],
                                                 (k_pages, v_pages), [batch], [positions])
        x = rms_norm_1p(x, w.norm, cfg.rms_norm_eps)
    return x, k_pages, v_pages


def draft(cfg: ModelConfig, layout: Layout, kernels: Kernels, weights: Weights, hidden, next_tokens, k_pages,
          v_pages, batch: Batch, k: int):
    """k greedy drafts per row from the MTP head. It first runs over each row's positions batch.start ..
    + lens - 1 (hidden [N, T, H]: the main model's final-normed states there; next_tokens [N, T]: the token after
    each), filling the MTP layer's K/V there; its argmax at the last real position is the first draft (the token
    two after that position). Each further draft is one more MTP step, one position on, chained on the MTP's own
    hidden state and the draft before it. Returns (drafts [N, k] int32, k_pages, v_pages)."""
    argmax = lambda logits: jnp.argmax(jax.lax.all_gather(logits, TP, axis=logits.ndim - 1, tiled=True),
                                       axis=-1).astype(jnp.int32)
    h, k_pages, v_pages = mtp(cfg, layout, kernels, weights, hidden, next_tokens, k_pages, v_pages, batch)
    h = last_real(h, batch.lens)                 # the head runs at the last real position only
    tok = argmax(lm_head(cfg, weights, h))
    out, live = [tok], (batch.lens > 0).astype(jnp.int32)
    for i in range(1, k):
        step = dataclasses.replace(batch, tokens=tok[:, None], start=batch.start + batch.lens + i - 1, lens=live)
        h, k_pages, v_pages = mtp(cfg, layout, kernels, weights, h[:, None], tok[:, None], k_pages, v_pages, step)
        h = h[:, 0]
        tok = argmax(lm_head(cfg, weights, h))
        out.append(tok)
    return jnp.stack(out, axis=1), k_pages, v_pages


def forward(cfg: ModelConfig, layout: Layout, kernels: Kernels, weights: Weights, state: State, batch: Batch,
            all_logits: bool):
    """Per-rank forward. Returns (fp32 logits over this rank's vocab shard, new state).
    Logits are [N, T, V/tp] when all_logits, else [N, V/tp] at each row's last real token."""
    x, state = decoder(cfg, layout, kernels, weights, state, batch)
    if not all_logits:
        x = last_real(x, batch.lens)
    prefill = batch.tokens.shape[1] > 1 and not all_logits
    return lm_head(cfg, weights, x, kernels.prefill_head if prefill else None), state


def last_real(x, lens):
    """x [N, T, ...] -> [N, ...] at each row's last real position (lens - 1)."""
    return jnp.take_along_axis(x, jnp.maximum(lens - 1, 0)[:, None, None], axis=1)[:, 0]


BATCH_SPEC = Batch(tokens=P(DP), start=P(DP), lens=P(DP), slots=P(DP), pages=P(DP))


def make_forward(cfg: ModelConfig, layout: Layout, mesh: Mesh, kernels: Kernels, weight_specs, state_specs,
                 all_logits: bool):
    """The SPMD program: forward under shard_map over (dp, tp); rows are split over dp replicas (each with its own
    state pools, slot indices local to the replica), logits come out vocab-sharded over tp."""
    body = functools.partial(forward, cfg, layout, kernels, all_logits=all_logits)
    logit_spec = P(DP, None, TP) if all_logits else P(DP, TP)
    return jax.shard_map(body, mesh=mesh, in_specs=(weight_specs, state_specs, BATCH_SPEC),
                         out_specs=(logit_spec, state_specs), check_vma=False)
