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
    best = None
    split = 1
    while split <= rule.max_split:
        c = MatmulConfig(bn=bn, split_k=split, num_warps=rule.num_warps, num_stages=rule.num_stages)
        if not fits(m, k, n, c) or k // (split * c.bk) < 8:
            break
        best = c
        if n // c.bn * split >= rule.programs:
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


@dataclasses.dataclass(frozen=True)
class GateUpConfig:
    """The fused decode MLP input kernel: bn output columns per program (gate and up tiles of bn each), bk K rows
    per loop step, no K split (SiLU needs whole sums)."""
    bn: int = 32
    bk: int = 128
    num_warps: int = 4
    num_stages: int = 3

    @property
    def name(self):
        return f"gu_n{self.bn}_k{self.bk}_w{self.num_warps}_st{self.num_stages}"


GATE_UP_DEFAULT = GateUpConfig()


def gate_up_choose(m: int, k: int, i: int) -> GateUpConfig | None:
    """The configuration the model runs, or None where none fits. Column blocks of 32 up to 32 rows (384 programs
    at the 9B's I = 12288), of 64 above: every program reads the whole x once per K step, so at 64 rows 32-column
    blocks would read as many x bytes (from L2) as weight bytes (from HBM); 64 halves that (two stages keep two
    programs per SM). Smaller models take the largest blocks that divide their I and K."""
    base = GATE_UP_DEFAULT if _rows(m) <= 32 else GateUpConfig(bn=64, num_stages=2)
    for bn in (b for b in (64, 32, 16) if b <= base.bn):
        for bk in (128, 64, 32, 16):
            c = dataclasses.replace(base, bn=bn, bk=bk)
            if gate_up_fits(m, k, i, c):
                return c
    return None


def gate_up_sweep():
    """Configurations of `gate_up_silu` the model can select by name (QWEN35_DECODE_MLP; tests cross-lower each)."""
    c = GateUpConfig
    return [GATE_UP_DEFAULT, c(bn=64), c(bn=32, num_stages=4), c(bn=64, num_stages=2), c(bn=16, num_stages=4)]


def gate_up_fits(m: int, k: int, i: int, config: GateUpConfig) -> bool:
    smem = config.num_stages * (_rows(m) * config.bk + 2 * config.bk * config.bn) * 2
    return i % config.bn == 0 and k % config.bk == 0 and m <= 256 and smem <= SMEM_BYTES


def _gate_up_kernel(x_ref, g_ref, u_ref, o_ref, *, bk, steps):
    """x [R, K] (whole), g / u [K, bn] (this column block of the gate and of the up half), o [R, bn]."""
    rows, bn = o_ref.shape

    def body(i, acc):
        xk = x_ref[:, pl.ds(i * bk, bk)]
        return (acc[0] + pltriton.dot(xk, g_ref[pl.ds(i * bk, bk), :]),
                acc[1] + pltriton.dot(xk, u_ref[pl.ds(i * bk, bk), :]))

    zero = jnp.zeros((rows, bn), jnp.float32)
    g, u = jax.lax.fori_loop(0, steps, body, (zero, zero))
    o_ref[...] = (jax.nn.silu(g) * u).astype(o_ref.dtype)


def gate_up_silu(x, w, *, config: GateUpConfig | None = None, interpret: bool = False):
    """silu(x @ w[:, :I]) * (x @ w[:, I:]) for x [M, K], w [K, 2 I] (the gate and up projections side by side, as
    the model stores them) -> [M, I] in x.dtype, each product accumulated in fp32 and the SiLU and the product
    in fp32, rounded once: what XLA's dot with an fp32 result followed by the model's SiLU x up computes, in one
    kernel (the decode step otherwise writes the fp32 [M, 2 I] product and reads it back in a kernel of its own).
    The reference is `gate_up_reference`. Opt-in (QWEN35_DECODE_MLP): on the H200 it read the 9B gate/up weight
    ~10% slower than cuBLASLt, more than the SiLU kernel it saves (bench/RESULTS.md, 2026-12-02)."""
    config = GATE_UP_DEFAULT if config is None else config
    m, k = x.shape
    i = w.shape[1] // 2
    if w.shape[1] % 2 or not gate_up_fits(m, k, i, config):
        raise ValueError(f"gate_up_silu [{m}, {k}] @ [{k}, {w.shape[1]}] does not fit {config.name}: the halves "
                         f"must be multiples of {config.bn} columns, K of {config.bk}, M at most 256, and the "
                         f"pipeline's tiles within {SMEM_BYTES} bytes of shared memory")
    rows = _rows(m)
    xp = jnp.pad(x, ((0, rows - m), (0, 0)))
    blocks = i // config.bn
    out = pl.pallas_call(
        functools.partial(_gate_up_kernel, bk=config.bk, steps=k // config.bk),
        grid=(blocks,),
        in_specs=[pl.BlockSpec((rows, k), lambda j: (0, 0)),
                  pl.BlockSpec((k, config.bn), lambda j: (0, j)),
                  pl.BlockSpec((k, config.bn), lambda j: (0, j + blocks))],
        out_specs=pl.BlockSpec((rows, config.bn), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((rows, i), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret, name="decode_gate_up_silu",
    )(xp, w, w)
    return out[:m]


def gate_up_reference(x, w):
    """XLA's dot in fp32, then SiLU x up in fp32, rounded once to x.dtype (the model's decode MLP input)."""
    gate, up = jnp.split(jnp.dot(x, w, preferred_element_type=jnp.float32), 2, axis=-1)
    return (jax.nn.silu(gate) * up).astype(x.dtype)


def reference(x, w, *, out_dtype=None):
    """XLA's dot: fp32 accumulation, one rounding to out_dtype."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype if out_dtype is None else out_dtype)
