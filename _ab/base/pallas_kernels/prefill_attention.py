"""Causal GQA flash attention for prefill chunks over paged K/V, as a Pallas-Triton kernel.

Why a kernel: the jnp attention (qwen35_jax/model/attention.paged_attention, the reference here) walks the pages in
a `fori_loop` whose trip count is read from the data, which XLA:GPU runs on the host: a host-device round trip per
512-key block per attention layer, and a cost that grows with the square of the context. Here each program walks
its keys inside the kernel, bounded by its own queries' positions.

Layout as the model's KV pool: k/v pages [Hkv, num_pages, page_size, D]; `pages[n]` lists row n's pages in order
(0, the null page, past its end). The chunk's own K/V are already written into the pages (forward.attention_core
writes them first), so a query attends to the row's earlier chunks and to its own chunk alike: keys at positions
<= its own and < ctx_lens[n]. Grid (row, KV head, query block): a program takes `block_q` query rows of one KV head,
the chunk's (token, query head) pairs of its GQA group, token-major, so that the group's heads share every K/V block
it loads (rows of different lengths and starts in one launch: varlen). It walks key blocks of `block_k` from
position 0 up to its last query's position with an online softmax in fp32. Keys are gathered row by row from the
pool viewed as [Hkv, num_pages * page_size, D] (key j: row pages[j // ps] * ps + j % ps), as the decode kernel
gathers them (pallas_kernels/paged_attention.py).

A short chunk at a long context (a mixed step's 64 tokens at 128k) makes few programs with long key loops: 16 of
them (4 KV heads, 4 blocks of 64 rows) would leave most of the GPU idle. Such grids split each program's keys
(flash-decoding, as the decode kernel does): grid (row, KV head, query block, split), each split an equal share of
the program's key blocks, its unnormalised sums merged outside the kernel. Chunks with programs enough run unsplit.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.paged_attention import NEG, merge_splits, online_softmax_step


@dataclasses.dataclass(frozen=True)
class PrefillAttentionConfig:
    """Tiles of the prefill attention kernel: query rows ((token, head) pairs) per program, keys per loop step,
    Triton's warps and pipeline depth (head dim 256: a [64, 256] query tile and [32, 256] K and V blocks four
    deep, ~160 KB of shared memory). The defaults: the fastest of bench/long_context.py's `chunktiles` sweep on
    a mixed step's short chunks at 128k, and as fast as any on a causal 8k chunk."""
    block_q: int = 64
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 4
    target_programs: int = 528    # key splits are chosen so that the grid reaches this many programs (4 per SM)
    max_splits: int = 32

    @property
    def name(self):
        return f"q{self.block_q}_k{self.block_k}_w{self.num_warps}_s{self.num_stages}_t{self.target_programs}"


DEFAULT = PrefillAttentionConfig()


def _kernel(start_ref, ctx_ref, q_ref, k_ref, v_ref, pages_ref, *out_refs, page_size, block_k, group, splits):
    """Refs (BlockSpecs): start / ctx [N] (whole), q [BQ, D] (this row, KV head and block of query rows, scaled;
    query row f is token f // group of the chunk, head f % group of the KV head's group), k/v [num_pages * ps, D]
    (this KV head), pages [P'] (this row); output o [BQ, D] (normalised), or with splits > 1 this split's acc
    [BQ, D] and m / l [BQ] (fp32, unnormalised)."""
    n, b = pl.program_id(0), pl.program_id(2)
    start, ctx = start_ref[n], ctx_ref[n]
    q = q_ref[...]
    block_q, d = q.shape
    qpos = start + (b * block_q + jnp.arange(block_q, dtype=jnp.int32)) // group
    # keys up to the block's last query (causal), never past the row's context
    end = jnp.minimum(ctx, start + (b * block_q + block_q - 1) // group + 1)
    blocks = jnp.maximum(end + block_k - 1, 0) // block_k
    first, last = 0, blocks
    if splits > 1:                                       # this split's share of the key blocks
        share = (blocks + splits - 1) // splits
        first = pl.program_id(3) * share
        last = jnp.minimum(first + share, blocks)
    key = jnp.arange(block_k, dtype=jnp.int32)

    def body(i, carry):
        kpos = i * block_k + key
        at = pages_ref[kpos // page_size] * page_size + kpos % page_size
        k, v = k_ref[at], v_ref[at]
        s = pltriton.dot(q, k, trans_b=True)                                  # [BQ, BK] fp32
        ok = (kpos[None, :] <= qpos[:, None]) & (kpos < ctx)[None, :]
        return online_softmax_step(jnp.where(ok, s, NEG), v, *carry)

    init = (jnp.zeros((block_q, d), jnp.float32), jnp.full((block_q,), NEG, jnp.float32),
            jnp.zeros((block_q,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(first, last, body, init)
    if splits == 1:         # block 0 holds key 0, which every query sees; a row with no context gives zeros
        out_refs[0][...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(out_refs[0].dtype)
        return
    # A query that saw no visible key (all of this split's keys lie past it) kept m = NEG, and exp(NEG - NEG) = 1
    # summed its masked keys into acc and l: it has nothing.
    seen = m > NEG
    for ref, x in zip(out_refs, (jnp.where(seen[:, None], acc, 0.0), m, jnp.where(seen, l, 0.0))):
        ref[...] = x


def num_splits(programs: int, key_blocks: int, config: PrefillAttentionConfig) -> int:
    """Key splits for a grid of `programs` unsplit programs: enough to reach config.target_programs, never more
    than the key blocks of the longest context the page table holds."""
    want = -(-config.target_programs // max(1, programs))
    return max(1, min(want, config.max_splits, key_blocks))


def paged_prefill_attention(q, k_pages, v_pages, pages, positions, ctx_lens, *,
                            config: PrefillAttentionConfig | None = None, interpret: bool = False):
    """The contract of qwen35_jax.model.attention.paged_attention for prefill chunks: q [N, T, Hq, D] at positions
    [N, T] (each row's start + 0..T-1) attends causally to its row's first ctx_lens[n] cached keys -> [N, T, Hq,
    D] in q.dtype. Query head h reads KV head h // (Hq / Hkv); softmax scale D^-0.5; fp32 scores and softmax.
    Queries past a row's real tokens see its whole context (their output is not used); rows with ctx_lens 0 give
    zeros."""
    config = DEFAULT if config is None else config
    n, t, hq, d = q.shape
    hkv, _, page_size, _ = k_pages.shape
    if hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of KV heads {hkv}")
    for name, x in (("head_dim", d), ("block_q", config.block_q), ("block_k", config.block_k)):
        if x & (x - 1) or x < 16:
            raise ValueError(f"{name} ({x}) must be a power of two >= 16 (Triton block shapes)")
    g, bq, bk = hq // hkv, config.block_q, config.block_k
    # query rows per KV head, token-major: row f = token f // g, head h * g + f % g; padded to whole blocks
    rows = -(-t * g // bq) * bq
    qs = (q.astype(jnp.float32) * d ** -0.5).astype(q.dtype)
    qs = jnp.moveaxis(qs.reshape(n, t, hkv, g, d), 2, 1).reshape(n, hkv, t * g, d)
    qs = jnp.pad(qs, ((0, 0), (0, 0), (0, rows - t * g), (0, 0)))
    # every key block a program may read must have its page entries (past the table: the null page)
    cover = -(-pages.shape[1] * page_size // bk) * bk
    pages = jnp.pad(pages.astype(jnp.int32), ((0, 0), (0, max(0, -(-cover // page_size) - pages.shape[1]))))
    k_pages = k_pages.reshape(hkv, -1, d)                # [Hkv, num_pages * ps, D]: a free view of the pool
    v_pages = v_pages.reshape(hkv, -1, d)
    splits = num_splits(n * hkv * (rows // bq), cover // bk, config)
    kv_spec = pl.BlockSpec((None, *k_pages.shape[1:]), lambda i, h, b, s: (h, 0, 0))
    q_spec = pl.BlockSpec((None, None, bq, d), lambda i, h, b, s: (i, h, b, 0))
    if splits == 1:
        out_specs, out_shape = q_spec, jax.ShapeDtypeStruct((n, hkv, rows, d), q.dtype)
    else:                       # per split: acc [S, N, Hkv, rows, D], m and l [S, N, Hkv, rows]
        f32 = jnp.float32
        out_specs = [pl.BlockSpec((None, None, None, bq, d), lambda i, h, b, s: (s, i, h, b, 0)),
                     pl.BlockSpec((None, None, None, bq), lambda i, h, b, s: (s, i, h, b)),
                     pl.BlockSpec((None, None, None, bq), lambda i, h, b, s: (s, i, h, b))]
        out_shape = [jax.ShapeDtypeStruct((splits, n, hkv, rows, d), f32),
                     jax.ShapeDtypeStruct((splits, n, hkv, rows), f32),
                     jax.ShapeDtypeStruct((splits, n, hkv, rows), f32)]
    out = pl.pallas_call(
        functools.partial(_kernel, page_size=page_size, block_k=bk, group=g, splits=splits),
        grid=(n, hkv, rows // bq, splits),
        in_specs=[pl.BlockSpec((n,), lambda i, h, b, s: (0,)), pl.BlockSpec((n,), lambda i, h, b, s: (0,)), q_spec,
                  kv_spec, kv_spec, pl.BlockSpec((None, pages.shape[1]), lambda i, h, b, s: (i, 0))],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret, name="paged_prefill_attention",
    )(positions[:, 0].astype(jnp.int32), ctx_lens.astype(jnp.int32), qs, k_pages, v_pages, pages)
    if splits > 1:
        out = merge_splits(*out).astype(q.dtype)
    return jnp.moveaxis(out[:, :, :t * g].reshape(n, hkv, t, g, d), 1, 2).reshape(n, t, hq, d)
