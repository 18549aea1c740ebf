"""Decode-shaped matmul (few rows, large weight) as a Pallas-Triton kernel: x [M, K] @ w [K, N], fp32 accumulation.

Why a kernel: a decode step's projections read a whole weight matrix for M <= 64 rows, so they are bound by
memory, and what matters is keeping every SM streaming. XLA's cuBLAS picks tiles for the GEMM's FLOPs: at the 9B
shapes its tiles leave SMs idle (in_proj's N = 12352 is 97 tiles of 128 on 132 SMs; out_proj's N = 4096 only
32), and the profile showed those GEMMs at 61-79% of the copy bandwidth (bench/RESULTS.md). Here a program owns
a narrow column block (bn) and, with split_k > 1, one of split_k equal K ranges, so there are several programs
per SM; it walks its K range in bk steps (software-pipelined loads, num_stages) into an fp32 accumulator.
Split-K partial sums come back as [split_k, M, N] fp32 and are added outside the kernel (XLA fuses that add
into the consumer: the cast, the SiLU, the all-reduce's input).

Contract (the reference is `reference` below, XLA's dot): rows M are padded to at least 16 (tl.dot's smallest
tile); N must be a multiple of bn and K of split_k * bk.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

MIN_ROWS = 16


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    bn: int = 64              # output columns per program (64 bf16 columns = one 128-byte line of each w row)
    bk: int = 128             # K rows per loop step
    split_k: int = 1          # programs along K (partials summed outside)
    num_warps: int = 4
    num_stages: int = 4

    @property
    def name(self):
        return f"n{self.bn}_k{self.bk}_s{self.split_k}_w{self.num_warps}_st{self.num_stages}"


DEFAULT = MatmulConfig()


def config_sweep():
    """Configurations bench/gemm.py times (tests cross-lower each one for CUDA); the first is DEFAULT."""
    c = MatmulConfig
    return [DEFAULT, c(bn=32), c(bn=128), c(bn=64, split_k=2), c(bn=128, split_k=2), c(bn=128, split_k=4),
            c(bn=64, bk=256, num_stages=3), c(bn=64, num_warps=2), c(bn=128, num_warps=8),
            c(bn=32, split_k=2), c(bn=64, split_k=4), c(bn=256, split_k=4, num_warps=8)]


SMEM_BYTES = 200 * 1024     # of the H200's 227 KB per block: Triton's pipeline buffers plus some slack


def _rows(m: int) -> int:
    return max(MIN_ROWS, 1 << max(0, (m - 1).bit_length()))


def fits(m: int, k: int, n: int, config: MatmulConfig) -> bool:
    """Whether the kernel takes this shape with this configuration (see the contract; the pipeline's bf16 x and w
    tiles, num_stages deep, must fit in shared memory)."""
    smem = config.num_stages * (_rows(m) * config.bk + config.bk * config.bn) * 2
    return n % config.bn == 0 and k % (config.split_k * config.bk) == 0 and m <= 256 and smem <= SMEM_BYTES


@dataclasses.dataclass(frozen=True)
class Rule:
    """How `choose` makes a configuration for a shape: column blocks of bn (64 where bn does not divide N), and the
    fewest K splits (up to max_split, keeping >= 8 loop steps of bk) that give >= programs programs."""
    bn: int = 64
    programs: int = 264       # 2 per H200 SM
    max_split: int = 4
    num_stages: int = 4
    num_warps: int = 4


RULES = {"kernel": Rule(), "bn128": Rule(bn=128), "bn128_p528": Rule(bn=128, programs=528, max_split=8),
         "bn64_p528": Rule(programs=528, max_split=8), "bn256_w8": Rule(bn=256, num_warps=8, num_stages=2),
         "bn64_st6": Rule(num_stages=6), "bn128_st3_w8": Rule(bn=128, num_stages=3, num_warps=8)}


def choose(m: int, k: int, n: int, rule: Rule = Rule()) -> MatmulConfig | None:
    """The configuration the model runs for [m, k] @ [k, n], or None where none fits (XLA's dot then). The
    default rule (column blocks of 64, >= 2 programs per H200 SM) is what the H200 runs of bench/gemm.py point to
    (its per-shape picks are noisy at 10-50 us per call); RULES holds others to compare in the decode step."""
    bn = rule.bn if n % rule.bn == 0 else 64
    make = lambda s: MatmulConfig(bn=bn, split_k=s, num_warps=rule.num_warps, num_stages=rule.num_stages)
    return fewest_splits(make, lambda c: fits(m, k, n, c) and k // (c.split_k * c.bk) >= 8,
                         lambda c: n // c.bn * c.split_k >= rule.programs, rule.max_split)


def fewest_splits(make, ok, enough, max_split: int):
    """make(split) for the fewest K splits (1, 2, 4, ... max_split) where enough(config), among those ok(config)
    takes (splits past the first that is not ok are not tried); the most splits tried where none is enough; None
    where one split is not ok. The split rule of `choose` and of matmul_mgpu.choose."""
    best, split = None, 1
    while split <= max_split and ok(c := make(split)):
        best = c
        if enough(c):
            break
        split *= 2
    return best


def _kernel(x_ref, w_ref, o_ref, *, bk, steps):
    """x [R, K] (whole), w [K, bn] (this column block), o [R, bn] (this K range's partial)."""
    kr = pl.program_id(1)
    rows, bn = o_ref.shape

    def body(i, acc):
        k0 = (kr * steps + i) * bk
        return acc + pltriton.dot(x_ref[:, pl.ds(k0, bk)], w_ref[pl.ds(k0, bk), :])

    o_ref[...] = jax.lax.fori_loop(0, steps, body, jnp.zeros((rows, bn), jnp.float32)).astype(o_ref.dtype)


def matmul(x, w, *, out_dtype=None, config: MatmulConfig | None = None, interpret: bool = False):
    """x [M, K] @ w [K, N] -> [M, N] in out_dtype (default x.dtype), accumulated in fp32 and rounded once."""
    config = DEFAULT if config is None else config
    m, k = x.shape
    n = w.shape[1]
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if not fits(m, k, n, config):
        raise ValueError(f"matmul [{m}, {k}] @ [{k}, {n}] does not fit {config.name}: N must be a multiple of "
                         f"{config.bn}, K of {config.split_k * config.bk}, M at most 256, and the pipeline's "
                         f"tiles within {SMEM_BYTES} bytes of shared memory")
    rows = _rows(m)
    xp = jnp.pad(x, ((0, rows - m), (0, 0)))
    s = config.split_k
    part_dtype = out_dtype if s == 1 else jnp.float32
    out = pl.pallas_call(
        functools.partial(_kernel, bk=config.bk, steps=k // (s * config.bk)),
        grid=(n // config.bn, s),
        in_specs=[pl.BlockSpec((rows, k), lambda j, r: (0, 0)),
                  pl.BlockSpec((k, config.bn), lambda j, r: (0, j))],
        out_specs=pl.BlockSpec((None, rows, config.bn), lambda j, r: (r, 0, j)),
        out_shape=jax.ShapeDtypeStruct((s, rows, n), part_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret, name="decode_matmul",
    )(xp, w)
    out = out[0] if s == 1 else jnp.sum(out, axis=0)
    return out[:m].astype(out_dtype)


def reference(x, w, *, out_dtype=None):
    """XLA's dot: fp32 accumulation, one rounding to out_dtype."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype if out_dtype is None else out_dtype)
