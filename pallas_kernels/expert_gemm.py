"""An MoE layer's routed and shared experts, reading only the experts that have token copies (Pallas-Triton), and
the router's softmax and top k.

Why kernels: `jax.lax.ragged_dot` (the reference's grouped GEMM, `expert_gemm_reference`) is no grouped GEMM on an
NVIDIA GPU: XLA rewrites it into a dense dot over every expert (RaggedDotRewriter: the copies broadcast to [C, E, H]
and masked per group), E times the FLOPs and an E-times temporary. A decode step of Qwen3.5-35B-A3B, which routes
a token to 8 of 256 experts per layer, read all 256 (bench/RESULTS.md, the 35B-A3B section); a 2048-token prefill
chunk (16384 routed copies) would need a 17 GB temporary per GEMM and 256 times its FLOPs.

Small decode batches skip the sort: `routed_experts` runs one program per token copy and weight tile, reading the
copy's expert by id: gate and up tiles as programs of their own, the SiLU product on the down kernel's loads and the
router weight after it; the shared expert is one more copy per token, its sigmoid gate computed in the down
kernel. Copies of one expert in flight together read its tiles from L2 after the first. Everything larger (decode
batches where copies of one expert are many, verify, mixed and prefill steps) runs `sorted_experts`: the copies
sorted by expert into blocks of one expert each, whose kernels gather their tokens' rows themselves; the blocks
grow with the copies per expert (prefill), so each expert's tiles are read by fewer blocks.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


@dataclasses.dataclass(frozen=True)
class ExpertGemmConfig:
    """Tiles: copies per block (Triton's smallest dot), weight columns per program, K per loop step; Triton's warps
    and pipeline depth (router_num_warps: the router kernel's). copies_max: up to this many token copies an MoE
    layer runs routed_experts (one program per copy and tile of copy_block_n columns, copy_block_k of K per step),
    above it sorted_experts (blocks of block_m copies, or more up to block_m_max where the mean group holds more,
    num_warps per block_m of them; block_n columns, block_k of K per step)."""
    block_m: int = 16
    block_m_max: int = 32
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    copies_max: int = 256        # routed_experts: per-copy kernels up to this many token copies (tokens x k)
    copy_block_n: int = 64
    copy_block_k: int = 256
    copy_num_warps: int = 4
    router_num_warps: int = 1    # router_top_k's warps (its 2k + 2 reductions over E: shuffles at one warp)


DEFAULT = ExpertGemmConfig()


def _check(w, **tiles):
    """Refuse tiles Triton cannot take and weights the kernels' int32 element offsets cannot address."""
    for name, v in tiles.items():
        if v & (v - 1) or v < 16:
            raise ValueError(f"{name} ({v}) must be a power of two >= 16 (Triton block shapes)")
    if w.size >= 2 ** 31:
        raise ValueError(f"expert weights {list(w.shape)} have 2^31 elements or more: split the experts over more "
                         "devices (tp), or run jax.lax.ragged_dot (KernelConfig(expert_gemm=None))")


def expert_gemm_reference(x, w, sizes, out_dtype=None):
    """Grouped GEMM (ragged_dot): x [M, K] token copies sorted by expert, group g holding the next sizes[g] rows;
    w [E, K, N] -> [M, N] with row m = x[m] @ w[its group], fp32 accumulation rounded once to out_dtype (default
    x.dtype); rows past sum(sizes) are zeros."""
    out = jax.lax.ragged_dot(x, w, sizes.astype(jnp.int32), preferred_element_type=jnp.float32)
    return out.astype(x.dtype if out_dtype is None else out_dtype)


def shared_expert_reference(x, w_gate_up, w_down, w_gate):
    """The shared expert of an MoE layer as HF runs it: x [M, H]; w_gate_up [H, 2Is] ([gate | up], this rank's Is),
    w_down [Is, H], w_gate [H, 1] -> [M, H] in x.dtype: sigmoid(x @ w_gate) * down(silu(gate) * up), each GEMM
    accumulated in fp32 and rounded to x.dtype, as are the SiLU product, the sigmoid and the last product. Under tp
    the down GEMM's result is this rank's partial sum over Is."""
    f32, dt = jnp.float32, x.dtype
    dot = lambda a, w: jnp.dot(a, w, preferred_element_type=dt)     # fp32 accumulation, rounded once
    gate, up = jnp.split(dot(x, w_gate_up), 2, axis=-1)
    act = (jax.nn.silu(gate.astype(f32)) * up.astype(f32)).astype(dt)
    g = jax.nn.sigmoid(dot(x, w_gate).astype(f32)).astype(dt)
    return (dot(act, w_down).astype(f32) * g.astype(f32)).astype(dt)


def routed_experts_reference(x, experts, weights, w_gate_up, w_down, shared):
    """The contract of an MoE layer's experts on one rank: x [M, H] tokens; experts [M, k] their experts as indices
    into this rank's weights (-1: another rank's); weights [M, k] their router weights (x.dtype); w_gate_up
    [E, H, 2I] ([gate | up]), w_down [E, I, H]; shared: the shared expert's (w_gate_up, w_down, w_gate) as
    shared_expert_reference takes them. -> [M, H] fp32: over each token's experts on this rank, the sum of
    weight * down(silu(gate) * up), each GEMM accumulated in fp32 and rounded to x.dtype, as is the SiLU product and
    its product with the weight; plus the shared expert's output. Computed on the copies sorted by expert with
    grouped GEMMs (expert_gemm_reference: ragged_dot): no group is padded, and copies of other ranks' experts sit
    past the groups, where the GEMMs give zeros."""
    m, k = experts.shape
    e, f32 = w_gate_up.shape[0], jnp.float32
    group = jnp.where(experts >= 0, experts, e).reshape(-1)
    order = jnp.argsort(group, stable=True)
    sizes = jnp.bincount(group, length=e + 1)[:e].astype(jnp.int32)
    tok = order // k
    gate, up = jnp.split(expert_gemm_reference(x[tok], w_gate_up, sizes), 2, axis=-1)
    act = (jax.nn.silu(gate.astype(f32)) * up.astype(f32)).astype(x.dtype)
    out = expert_gemm_reference(act, w_down, sizes)
    routed = jnp.zeros((m, x.shape[1]), f32).at[tok].add((out * weights.reshape(-1)[order][:, None]).astype(f32))
    return routed + shared_expert_reference(x, *shared).astype(f32)


def _row_dot(row, w):
    """row [BK] @ w [BK, BN] as Triton's smallest dot: [16, BN] whose first row is the product and the other 15
    zeros (the row, then rows of zeros), so the loop's weight loads are pipelined as a GEMM's. The loops add these
    up and sum the 16 rows once at the end, exactly row 0."""
    rows = jax.lax.broadcasted_iota(jnp.int32, (16, row.shape[0]), 0)
    return pltriton.dot(jnp.where(rows == 0, row[None, :], jnp.zeros_like(row)[None, :]), w)


def _row_times(row, w_ref, e, j, bn, width, block_k):
    """fp32 [BN]: row(K range) over [0, width) @ w[e][:width, tile j] (e None: w is one matrix), block_k of K per
    step."""
    def body(s, acc):
        rows = pl.ds(s * block_k, block_k)
        wk = w_ref[rows, pl.ds(j * bn, bn)] if e is None else w_ref[e, rows, pl.ds(j * bn, bn)]
        return acc + _row_dot(row(rows), wk)

    return jax.lax.fori_loop(0, width // block_k, body, jnp.zeros((16, bn), jnp.float32)).sum(0)


def _gate_up_kernel(ids_ref, x_ref, w_ref, s_ref, o_ref, *, k, routed, block_k, block_k_shared):
    """Program (c, j): column tile j of copy c's [gate | up] (each half W = max(I, Is) wide), rounded: copy
    c < routed is token c // k times its expert's columns, copy routed + t token t times the shared expert's. Tiles
    past a copy's own width write zeros. Refs: ids [C'] (C' = routed), x [M, H], w [E, H, 2I], s [H, 2Is] (whole),
    o [BN]."""
    c, j = pl.program_id(0), pl.program_id(1)
    bn, dt, h = o_ref.shape[0], o_ref.dtype, x_ref.shape[1]
    half, half_s = w_ref.shape[2] // 2, s_ref.shape[1] // 2
    wide = max(half, half_s)
    e = ids_ref[jnp.minimum(c, routed - 1)]
    up = (j * bn >= wide).astype(jnp.int32)
    at = j * bn - up * wide                                      # the tile's offset in its half

    def tile(w, e, half, t, bk):
        start = at + up * half
        row = lambda rows: x_ref[t, rows]
        o_ref[...] = _row_times(row, w, e, start // bn, bn, h, bk).astype(dt)

    @pl.when((c < routed) & (e >= 0) & (at < half))
    def _():
        tile(w_ref, e, half, c // k, block_k)

    @pl.when((c >= routed) & (at < half_s))
    def _():
        tile(s_ref, None, half_s, c - routed, block_k_shared)

    @pl.when(((c < routed) & ((e < 0) | (at >= half))) | ((c >= routed) & (at >= half_s)))
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, dt)


def _down_kernel(ids_ref, wt_ref, a_ref, w_ref, x_ref, sd_ref, sg_ref, o_ref, *, routed, block_k, block_k_shared):
    """Program (c, j): copy c's silu(gate) * up (from its rounded GEMM results, rounded as HF) times its expert's
    down columns of tile j (copy routed + t: the shared expert's), summed in fp32 and rounded, times the copy's weight
    (the router's; the shared expert's sigmoid(x_t @ w_gate), rounded as HF), rounded. Refs: ids [C'], weights [C']
    (C' = routed), gate_up [C, 2W], w [E, I, H], x [M, H], shared down [Is, H], shared gate [H] (whole), o [BN]."""
    c, j = pl.program_id(0), pl.program_id(1)
    bn, dt, f32 = o_ref.shape[0], o_ref.dtype, jnp.float32
    i, i_s, wide = w_ref.shape[1], sd_ref.shape[0], a_ref.shape[1] // 2
    r = jnp.minimum(c, routed - 1)
    e = ids_ref[r]

    def act(rows):
        gate = a_ref[c, rows].astype(f32)
        up = a_ref[c, pl.ds(wide + rows.start, rows.size)].astype(f32)
        return (gate / (1.0 + jnp.exp(-gate)) * up).astype(dt)

    @pl.when((c < routed) & (e >= 0))
    def _():
        acc = _row_times(act, w_ref, e, j, bn, i, block_k)
        o_ref[...] = (acc.astype(dt).astype(f32) * wt_ref[r].astype(f32)).astype(dt)

    @pl.when(c >= routed)
    def _():
        acc = _row_times(act, sd_ref, None, j, bn, i_s, block_k_shared)
        logit = jnp.sum(x_ref[c - routed, :].astype(f32) * sg_ref[...].astype(f32)).astype(dt).astype(f32)
        gate = (1.0 / (1.0 + jnp.exp(-logit))).astype(dt).astype(f32)
        o_ref[...] = (acc.astype(dt).astype(f32) * gate).astype(dt)

    @pl.when((c < routed) & (e < 0))
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, dt)


def _widths(experts, w_gate_up, shared):
    """(m tokens, k, E, H, I, shared Is, routed copies m k, the wider of I and Is) of an MoE layer's call."""
    m, k = experts.shape
    e, h, i2 = w_gate_up.shape
    i, i_s = i2 // 2, shared[1].shape[0]
    return m, k, e, h, i, i_s, m * k, max(i, i_s)


def routed_experts(x, experts, weights, w_gate_up, w_down, shared, *, config: ExpertGemmConfig | None = None,
                   interpret: bool = False):
    """routed_experts_reference's contract for a few token copies (decode): no sort, one program per copy and
    weight tile in each of two kernels (gate_up's GEMM results; down with the SiLU product on its loads and the
    copy's weight after), the shared expert as one more copy per token (its gate computed in the down kernel), then
    each token's k + 1 rows summed in fp32. gate and up tiles are programs of their own (twice the programs of one
    that computes both: a batch-1 step has 8 copies)."""
    config = DEFAULT if config is None else config
    m, k, e, h, i, i_s, routed, wide = _widths(experts, w_gate_up, shared)
    s_gate_up, s_down, s_gate = shared
    bn = min(config.copy_block_n, i, i_s, h)
    bk, bk_s = min(config.copy_block_k, i, h), min(config.copy_block_k, i_s, h)
    _check(w_gate_up, copy_block_n=bn, copy_block_k=bk, shared_block_k=bk_s)
    _check(w_down)
    if i % bn or h % bn or i % bk or h % bk or i_s % bn or i_s % bk_s or h % bk_s:
        raise ValueError(f"expert widths H={h}, I={i}, shared Is={i_s} must be multiples of the tiles ({bk}, {bn})")
    ids = experts.reshape(routed).astype(jnp.int32)
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
    params = pltriton.CompilerParams(num_warps=config.copy_num_warps, num_stages=config.num_stages)
    grid = lambda n: (routed + m, n // bn)
    gate_up = pl.pallas_call(
        functools.partial(_gate_up_kernel, k=k, routed=routed, block_k=bk, block_k_shared=bk_s), grid=grid(2 * wide),
        in_specs=[whole(ids), whole(x), whole(w_gate_up), whole(s_gate_up)],
        out_specs=pl.BlockSpec((None, bn), lambda r, j: (r, j)),
        out_shape=jax.ShapeDtypeStruct((routed + m, 2 * wide), x.dtype), compiler_params=params,
        interpret=interpret, name="expert_gate_up",
    )(ids, x, w_gate_up, s_gate_up)
    wts, gate = weights.reshape(routed).astype(x.dtype), s_gate.reshape(h)
    y = pl.pallas_call(
        functools.partial(_down_kernel, routed=routed, block_k=bk, block_k_shared=bk_s), grid=grid(h),
        in_specs=[whole(ids), whole(wts), whole(gate_up), whole(w_down), whole(x), whole(s_down), whole(gate)],
        out_specs=pl.BlockSpec((None, bn), lambda r, j: (r, j)),
        out_shape=jax.ShapeDtypeStruct((routed + m, h), x.dtype), compiler_params=params, interpret=interpret,
        name="expert_down",
    )(ids, wts, gate_up, w_down, x, s_down, gate)
    f32 = jnp.float32
    return y[:routed].reshape(m, k, h).astype(f32).sum(1) + y[routed:].astype(f32)


def _sorted_gate_up_kernel(blk_ref, row0_ref, end_ref, tok_ref, x_ref, w_ref, s_ref, o_ref, *, n_routed,
                           block_k):
    """Program (b, j): block b's up to BM copies of one expert (group g; g = E: the shared expert), their tokens'
    rows gathered from x, times the expert's gate and up column tiles j, each rounded, and silu(gate) * up
    rounded: o [BM, BN]. An empty block (g < 0) writes nothing; tiles past the expert's width write zeros. Refs:
    block groups, first sorted rows, group ends [NB]; sorted copies' tokens [C + BM]; x [M, H]; w [E, H, 2I];
    s [H, 2Is] (all whole)."""
    b, j = pl.program_id(0), pl.program_id(1)
    g = blk_ref[b]
    bm, bn = o_ref.shape
    dt, f32, h = o_ref.dtype, jnp.float32, x_ref.shape[1]
    rows = row0_ref[b] + jnp.arange(bm, dtype=jnp.int32)
    live = rows < end_ref[b]
    tok = jnp.where(live, tok_ref[pl.ds(row0_ref[b], bm)], 0)

    def act(w, e, half):
        def body(i, acc):
            ks = pl.ds(i * block_k, block_k)
            xk = jnp.where(live[:, None], x_ref[tok, ks], 0)
            wg = w_ref[e, ks, pl.ds(j * bn, bn)] if e is not None else w[ks, pl.ds(j * bn, bn)]
            wu = w_ref[e, ks, pl.ds(half + j * bn, bn)] if e is not None else w[ks, pl.ds(half + j * bn, bn)]
            return acc[0] + pltriton.dot(xk, wg), acc[1] + pltriton.dot(xk, wu)

        zero = jnp.zeros((bm, bn), f32)
        gate, up = jax.lax.fori_loop(0, h // block_k, body, (zero, zero))
        gate, up = gate.astype(dt).astype(f32), up.astype(dt).astype(f32)
        o_ref[...] = (gate / (1.0 + jnp.exp(-gate)) * up).astype(dt)

    half, half_s = w_ref.shape[2] // 2, s_ref.shape[1] // 2

    @pl.when((g >= 0) & (g < n_routed) & (j * bn < half))
    def _():
        act(None, g, half)

    @pl.when((g == n_routed) & (j * bn < half_s))
    def _():
        act(s_ref, None, half_s)

    @pl.when(((g >= 0) & (g < n_routed) & (j * bn >= half)) | ((g == n_routed) & (j * bn >= half_s)))
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, dt)


def _sorted_down_kernel(blk_ref, row0_ref, end_ref, tok_ref, ord_ref, wt_ref, a_ref, w_ref, x_ref, sd_ref, sg_ref,
                        o_ref, *, n_routed, block_k, block_n):
    """Program (b, j): block b's SiLU products [BM, W] times its expert's down columns of tile j, rounded, times
    each copy's router weight (the shared expert: sigmoid(x_t @ w_gate), rounded as HF), rounded, stored at the
    copies' own rows of o [C + 1, H] (copy order: token t's routed copies at t k .. t k + k - 1, its shared copy at
    M k + t; rows past the group's end at the spare last row), so that each token's k + 1 rows are summed without
    a gather. Refs as _sorted_gate_up_kernel's, plus the sorted copies' indices and weights [C + BM], the products
    [NB * BM, W], w [E, I, H], x [M, H], shared down [Is, H] and gate [H] (all whole)."""
    b, j = pl.program_id(0), pl.program_id(1)
    g = blk_ref[b]
    bm, bn = a_ref.shape[0] // blk_ref.shape[0], block_n
    dt, f32 = o_ref.dtype, jnp.float32
    rows = pl.ds(b * bm, bm)
    sorted_rows = pl.ds(row0_ref[b], bm)
    live = row0_ref[b] + jnp.arange(bm, dtype=jnp.int32) < end_ref[b]
    cols = pl.ds(j * bn, bn)

    def down(w, e, width):
        def body(i, acc):
            ks = pl.ds(i * block_k, block_k)
            wk = w_ref[e, ks, cols] if e is not None else w[ks, cols]
            return acc + pltriton.dot(a_ref[rows, ks], wk)

        return jax.lax.fori_loop(0, width // block_k, body, jnp.zeros((bm, bn), f32)).astype(dt).astype(f32)

    def store(out):
        o_ref[jnp.where(live, ord_ref[sorted_rows], o_ref.shape[0] - 1), cols] = out.astype(dt)   # past: a spare row

    @pl.when((g >= 0) & (g < n_routed))
    def _():
        store(down(None, g, w_ref.shape[1]) * wt_ref[sorted_rows].astype(f32)[:, None])

    @pl.when(g == n_routed)
    def _():
        tok = jnp.where(live, tok_ref[sorted_rows], 0)

        def dot_gate(i, acc):           # x_t @ w_gate over K steps (a block's whole rows at once would spill)
            ks = pl.ds(i * block_k, block_k)
            return acc + jnp.sum(x_ref[tok, ks].astype(f32) * sg_ref[ks].astype(f32)[None, :], axis=1)

        logit = jax.lax.fori_loop(0, x_ref.shape[1] // block_k, dot_gate, jnp.zeros((bm,), f32))
        gate = (1.0 / (1.0 + jnp.exp(-logit.astype(dt).astype(f32)))).astype(dt).astype(f32)
        store(down(sd_ref, None, sd_ref.shape[0]) * gate[:, None])


def block_m(config: ExpertGemmConfig, copies: int, groups: int) -> int:
    """sorted_experts' copies per block: config.block_m, doubled while the mean group holds twice as many copies,
    up to config.block_m_max (a prefill chunk's groups hold hundreds: each expert's tiles are read per block)."""
    bm = config.block_m
    while 2 * bm <= min(config.block_m_max, copies // groups):
        bm *= 2
    return bm


def sorted_experts(x, experts, weights, w_gate_up, w_down, shared, *, config: ExpertGemmConfig | None = None,
                   interpret: bool = False):
    """routed_experts_reference's contract for any number of tokens (past the per-copy kernels): the token copies
    (the shared expert one more per token, as group E) sorted by expert and cut into blocks of BM copies of one
    expert (BM: `block_m`); one program per block and column tile in each of two kernels, which gather their
    tokens' rows themselves (gate_up: silu(gate) * up of the block; down: times the copies' weights, each row
    stored at its copy's own index), so only the experts with copies are read and no padded copy of x is written;
    then each token's k + 1 rows summed in fp32."""
    config = DEFAULT if config is None else config
    m, k, e, h, i, i_s, routed, wide = _widths(experts, w_gate_up, shared)
    s_gate_up, s_down, s_gate = shared
    bm, bn, bk = block_m(config, routed + m, e + 1), min(config.block_n, i, i_s, h), min(config.block_k, i, i_s, h)
    _check(w_gate_up, block_m=bm, block_n=bn, block_k=bk)
    _check(w_down)
    if i % bn or h % bn or i % bk or h % bk or i_s % bn or i_s % bk:
        raise ValueError(f"expert widths H={h}, I={i}, shared Is={i_s} must be multiples of the tiles ({bk}, {bn})")
    i32, f32 = jnp.int32, jnp.float32
    c = routed + m
    # group of each copy: its expert, E for the shared expert's copies, E + 1 for another rank's (dropped)
    group = jnp.concatenate([jnp.where(experts >= 0, experts, e + 1).reshape(routed).astype(i32),
                             jnp.full((m,), e, i32)])
    order = jnp.argsort(group, stable=True).astype(i32)                       # sorted position -> copy
    sizes = jnp.zeros(e + 2, i32).at[group].add(1)[:e + 1]
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    nblocks = -(-sizes // bm)
    bend = jnp.cumsum(nblocks)
    bstart = bend - nblocks
    nb = -(-c // bm) + min(e, routed) + 1                   # each nonempty group adds at most one partly full block
    blocks = jnp.arange(nb, dtype=i32)
    g = jnp.searchsorted(bend, blocks, side="right", method="compare_all").astype(i32)
    gc = jnp.minimum(g, e)
    blk = jnp.where(g <= e, g, -1)
    row0 = jnp.where(g <= e, starts[gc] + (blocks - bstart[gc]) * bm, 0)
    end = jnp.where(g <= e, ends[gc], 0)
    pad = jnp.zeros(bm, i32)
    tok = jnp.concatenate([jnp.where(order < routed, order // k, order - routed), pad])
    wts = jnp.concatenate([weights.reshape(routed).astype(x.dtype), jnp.zeros(m + bm, x.dtype)])[
        jnp.concatenate([order, pad + c])]                                   # the shared copies' and padding: 0
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
    params = pltriton.CompilerParams(num_warps=config.num_warps * bm // config.block_m, num_stages=config.num_stages)
    meta = (blk, row0, end, tok)
    act = pl.pallas_call(
        functools.partial(_sorted_gate_up_kernel, n_routed=e, block_k=bk), grid=(nb, wide // bn),
        in_specs=[*map(whole, meta), whole(x), whole(w_gate_up), whole(s_gate_up)],
        out_specs=pl.BlockSpec((bm, bn), lambda b, j: (b, j)),
        out_shape=jax.ShapeDtypeStruct((nb * bm, wide), x.dtype), compiler_params=params, interpret=interpret,
        name="sorted_gate_up",
    )(*meta, x, w_gate_up, s_gate_up)
    order = jnp.concatenate([order, pad])
    y = pl.pallas_call(
        functools.partial(_sorted_down_kernel, n_routed=e, block_k=bk, block_n=bn), grid=(nb, h // bn),
        in_specs=[*map(whole, meta), whole(order), whole(wts), whole(act), whole(w_down), whole(x), whole(s_down),
                  pl.BlockSpec((h,), lambda *_: (0,))],
        out_specs=pl.BlockSpec((c + 1, h), lambda b, j: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((c + 1, h), x.dtype), compiler_params=params, interpret=interpret,
        name="sorted_down",
    )(*meta, order, wts, act, w_down, x, s_down, s_gate.reshape(h))
    # rows of copies of another rank's experts are never written
    rows = jnp.where((group <= e)[:, None], y[:c].astype(f32), 0)
    return rows[:routed].reshape(m, k, h).sum(1) + rows[routed:]


def router_top_k_reference(logits, k, live):
    """The router's choice, as HF: logits [M, E] (model dtype) -> (weights [M, k] in the logits' dtype, experts
    [M, k] int32): the softmax over all E experts in fp32, its k largest (the lower index first among equals),
    renormalised to sum to one. Rows where live [M] is False (padding) get expert -1 (none) and weight 0."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, idx = jax.lax.top_k(probs, k)
    top = (top / top.sum(-1, keepdims=True)).astype(logits.dtype)
    return jnp.where(live[:, None], top, 0), jnp.where(live[:, None], idx.astype(jnp.int32), -1)


def _top_k_kernel(live_ref, l_ref, w_ref, i_ref, *, k):
    """Program t: token t's softmax over its E logits and k rounds of (largest, lowest index holding it, masked
    out). Refs: live [M] (whole), logits [E], weights [KP], experts [KP] (KP: k to a power of two; the rest
    zeros)."""
    f32 = jnp.float32
    x = l_ref[...].astype(f32)
    p = jnp.exp(x - jnp.max(x))
    p = p / jnp.sum(p)
    e = p.shape[0]
    iota = jax.lax.broadcasted_iota(jnp.int32, p.shape, 0)
    slot = jax.lax.broadcasted_iota(jnp.int32, w_ref.shape, 0)
    vals, ids = jnp.zeros(w_ref.shape, f32), jnp.zeros(i_ref.shape, jnp.int32)
    for r in range(k):
        v = jnp.max(p)
        j = jnp.min(jnp.where(p == v, iota, e))
        vals, ids = jnp.where(slot == r, v, vals), jnp.where(slot == r, j, ids)
        p = jnp.where(iota == j, -1.0, p)
    live = live_ref[pl.program_id(0)] != 0
    w_ref[...] = jnp.where(live, vals / jnp.sum(vals), 0.0).astype(w_ref.dtype)
    i_ref[...] = jnp.where(live, ids, -1)


def router_top_k(logits, k, live, *, num_warps: int = 4, interpret: bool = False):
    """router_top_k_reference's contract in one kernel (one program per token), in the place of XLA's softmax,
    its sort for top_k, the renormalisation and the padding's mask: five launches per MoE layer."""
    m, e = logits.shape
    kp = 1 << (k - 1).bit_length()
    if k > e:
        raise ValueError(f"top {k} of {e} experts")
    live = live.astype(jnp.int32)
    w, i = pl.pallas_call(
        functools.partial(_top_k_kernel, k=k), grid=(m,),
        in_specs=[pl.BlockSpec((m,), lambda t: (0,)), pl.BlockSpec((None, e), lambda t: (t, 0))],
        out_specs=[pl.BlockSpec((None, kp), lambda t: (t, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((m, kp), logits.dtype), jax.ShapeDtypeStruct((m, kp), jnp.int32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1), interpret=interpret,
        name="router_top_k",
    )(live, logits)
    return w[:, :k], i[:, :k]
