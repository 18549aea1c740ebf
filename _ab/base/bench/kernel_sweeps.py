"""Tile configurations of the shipped Pallas kernels that the benchmarks time (bench/kernels.py, bench/attention.py,
bench/prefill_parts.py) and bench/triton_compile_check.py compiles; tests/test_kernels.py cross-lowers each one for
CUDA. The first entry of every list is the kernel's default."""
from __future__ import annotations

import dataclasses

from pallas_kernels import conv1d, gdn, paged_attention as pa, prefill_attention as pfa


def prefill_sweep():
    """The GDN prefill: the default, the two preps and T-solve grids "auto" chooses between, the P / f prep on 4 warps,
    the Mosaic GPU scan's two V-blocks, and the Triton scan (the fallback) in a few tiles."""
    d, r = gdn.DEFAULT_PREFILL, dataclasses.replace
    return [d, r(d, prep_mode="fused"), r(d, prep_mode="solve2"), r(d, solve_grid="key"), r(d, solve_grid="value"),
            r(d, pf_warps=4), r(d, mgpu_bv=32), r(d, mgpu_bv=64),
            r(d, mgpu=False), r(d, mgpu=False, bv=16), r(d, mgpu=False, bv=64, num_warps=8),
            r(d, mgpu=False, num_stages=2), r(d, mgpu=False, num_stages=1)]


def decode_sweep():
    """The GDN decode step's V-block / warps."""
    c = gdn.DecodeConfig
    return [gdn.DEFAULT_DECODE, c(bv=16), c(bv=32, num_warps=2), c(bv=64, num_warps=4)]


def conv_prefill_sweep():
    """The conv prefill's tiles (the last ones keep fewer values per thread live: 4 taps x bt x bc / threads)."""
    c = conv1d.ConvConfig
    return [c(), c(bt=64, bc=128, num_warps=8), c(bt=64, bc=128, num_warps=4), c(bt=64, bc=256, num_warps=8),
            c(bt=128, bc=128, num_warps=8), c(bt=32, bc=128, num_warps=8), c(bt=16, bc=128, num_warps=8),
            c(bt=16, bc=64, num_warps=4), c(bt=32, bc=64, num_warps=8), c(bt=8, bc=128, num_warps=4)]


def conv_decode_sweep():
    """The conv decode's channel blocks."""
    c = conv1d.ConvConfig
    return [c(), c(decode_bc=1024, decode_warps=4), c(decode_bc=4096, decode_warps=8)]


def attention_sweep():
    """The paged decode attention's pages per step, pipeline depth, warps and program target."""
    c = pa.DecodeAttentionConfig
    return [pa.DEFAULT, c(pages_per_block=1), c(pages_per_block=2, num_stages=3), c(pages_per_block=4, num_stages=2),
            c(pages_per_block=4, num_stages=3), c(pages_per_block=4), c(pages_per_block=8, num_stages=2),
            c(pages_per_block=4, num_stages=2, target_programs=132), c(num_warps=8),
            c(target_programs=528)]


def prefill_attention_sweep():
    """The paged prefill attention's query rows and key blocks, warps, pipeline depth and split target (the default
    first; the second, the default before 2026-12-06)."""
    c, d, r = pfa.PrefillAttentionConfig, pfa.DEFAULT, dataclasses.replace
    return [d, c(num_warps=8, num_stages=2, target_programs=264), r(d, target_programs=264), r(d, num_stages=3),
            r(d, num_stages=2), r(d, block_k=64, num_stages=3), r(d, block_q=128, num_warps=8, num_stages=3),
            r(d, block_q=128, num_warps=8, num_stages=2), r(d, block_q=32), r(d, block_q=16)]


# Timed beside the default in bench/kernels.py's headline: the next default if it reads faster there (the T solve per
# value head at every size).
CANDIDATE_PREFILL = dataclasses.replace(gdn.DEFAULT_PREFILL, solve_grid="value")
