"""Pallas kernels of the gated delta rule (Triton; the prefill scan also in Mosaic GPU): chunked prefill and the
in-place decode step.

Contract: pallas_kernels/gdn_reference.py (the pure-jnp oracle beside this file). State pool fp32, V-first
[slots, Hv, dv, dk]; value head hv reads key head hv // (Hv // Hk); gates, l2norm and the dk^-0.5 scale are
computed inside the kernels from the raw projections.

Two prefill pipelines (gdn-kernels.md section 3 for the math), chosen by the type of `config`:

WYConfig (the default, "wy"): everything that does not depend on the running state is done by one fully parallel
kernel, so the sequential scan does the minimum per 64-token chunk.
1. `_prep_kernel`, grid (chunk, value head) (prep_mode "tile"; "tile2": grid (chunk, key head) with both value
   heads of a key head in one program): A = strict_lower(beta K^ K^T * Gamma), T = (I + A)^-1 (fp32 blocked
   forward substitution as fla: 16x16 diagonal blocks row by row, exact fp32 merges), assembled into one [64, 64]
   tile, and per value head, as full-tile products stored whole:
     W = T (beta e^gamma K^)  [64, dk]  (bf16: a W·H operand; the error analysis below)
     U = T (beta V)           [64, dv]  (fp32)
     P = Q^ K^T * Gamma       [64, 64]  (fp32, causal incl. the diagonal)
     row factors fq = e^gamma |q|^-1 dk^-0.5, fk = e^(gamma_C - gamma) |k|^-1, e^gamma_C.
   (`_prep_blocks_kernel`, prep_mode="blocks", computes the same in 16-row blocks without the tile assembly.)
2. `_wy_scan_kernel`, one program per (sequence, value head, V-block), the fp32 state H^T [dk, BV] on chip:
     X = W H,  Y = q H          (raw bf16 q: exact operand; bf16 H operand)
     Vnew = U - X
     o = fq * Y + P Vnew        (TF32)
     H <- e^gamma_C H + k^T (fk * Vnew)   (raw bf16 k; fk * Vnew as a bf16 hi + lo pair: ~16-bit operand)
   Four dots per chunk of which two (X, then the update) are the sequential dependency, against six dependent
   products per chunk in the previous kernel; no per-chunk state ever goes to memory.
   Operand precision was chosen by emulating every rounding on the CPU against the fp32 token scan (9B head dims,
   777 tokens, fast and slow decays): rounding H or W to bf16 costs <= 7e-4 of o; rounding U, P, Vnew or T to bf16
   costs ~1.7e-3 each (fla rounds all of them: 2.5-3.4e-3 o, 2.2-3.1e-3 state). With the choice above the emulated
   errors are o <= 8e-4, state <= 3e-4.
3. The T-form (WYConfig.tform, the default since 7ccd469): three kernels instead of two, and no W
   or U in memory. `_solve_kernel` (one warp per (chunk, key head), tf32x3 merges) writes T; `_prep_kernel` with
   pf_only (one program per (chunk, value head); prep_mode "solve2": per (chunk, key head), q, k and Q K^T once for
   its value heads, half the programs) writes only P and the row factors (plus fw = beta e^gamma |k|^-1 and beta);
   the scan applies T itself:
     Z = k H, Y = q H                      (raw bf16 k, q; bf16 H operand)
     Vnew = T (beta V - fw * Z)            (TF32; the same products as U - W H, without rounding W to bf16)
   then o and the state update as above: one more dot per chunk (T is on the sequential path), but the prep's
   traffic drops from ~145 KB to ~50 KB per (chunk, value head): 584 vs 719 us for the whole 1x8k prefill on the
   H200 (bench/prefill_parts.py). Dots on the tensor cores are waited for one at a time by Triton (a wait right
   after each wgmma), so each dot in the chunk loop costs its full latency: the scan is bound by that, not by the
   state dependency (a scan whose state never changes took 355 vs 381 us).
4. The Mosaic GPU scan (WYConfig.mgpu; "auto", the default since c123fba, wherever its shapes allow):
   pallas_kernels/gdn_mgpu.py, the same T-form math with TMA loads a chunk ahead and independent products issued
   together; the solve and the prep then write T and P as bf16 hi + lo parts (split=2), ready tensor-core
   operands. Whole prefill on the H200 (bench/RESULTS.md, 2026-12-02): 453.6 vs 578.6 us at 1x8k, 840.9 vs 1197.1
   at 8x2k against the Triton scan; final state 2.2e-5 from the fp32 token scan against 2.1e-4.
5. prep_mode "fused": one Triton kernel per (chunk, value head) writes T, P and f, T by recursive doubling on the
   whole [64, 64] tile (`_doubling_inverse`: six steps of two full-tile products) instead of the solve kernel's
   16x16 substitutions and merges (one warp, ~45 us per program on the H200). Faster while its programs fit in a
   few waves (1x1k: 83.4-89.0 vs 102.0-119.6 us), slower past that (1x8k: 628-633 vs 482-484 us). Since the
   solve runs per value head for few chunks (solve_grid "auto", half the chain per program) and the P / f prep on
   2 warps (pf_warps), "solve2" wins from two waves of fused programs on (1x1k: 70.9 vs 86.1 us): prep_mode "auto"
   (the default) picks the fused prep within one wave (FUSED_PREP_PROGRAMS) and "solve2" otherwise.
6. The conv computed inside the P / f prep (3c2e063, removed): each (chunk, key head) program made its q, k and v
   tiles from the in_proj output (in 16-column pieces: whole tiles spilled 2.5 KB per thread at 2 warps), stored
   them for the solve and the scan and wrote the conv state; bit-identical outputs, no conv kernel. On the H200 it
   took 877.9 / 766.2 us (2 / 8 warps) against 429.7 for the conv kernel then this prefill at 1x8k, 1687.1 vs
   750.2 at 8x2k (bench/kernels.py conv_gdn), and the 9B prefill at 64 x 1024 tokens 1618.2 vs 1564.4 ms (GDN +
   conv 168.0 vs 89.8 ms): a program per (chunk, key head) makes its 32k conv outputs one piece after another,
   where the conv kernel's 16k programs of 32 x 128 run at memory speed (bench/RESULTS.md, readings of the
   2026-12-04 late morning).

PrefillConfig (the previous kernels, "v1", kept for side-by-side timing): `_solve_kernel` writes T per
(chunk, value head) and `_scan_kernel` computes Vnew = T (beta (v - e^gamma K H)), o and the state update per
chunk: six dependent products per chunk, ~10 us per chunk on the H200 (bench/RESULTS.md).

Sequences are packed: tokens [total, H, d] with per-sequence start offsets and lengths; each starts from its
slot's state (zeros where use_state is False) and writes its final state back in place (input_output_aliases).
The padded-batch contract of the model (`gdn_prefill`) is the packed call with row n starting at n * T.

Dot precisions ("bf16", "bf16x2" = a bf16 hi + lo split of the fp32 operand against an exact bf16 operand,
"bf16x3" = both operands split, "tf32", "tf32x3", "ieee"): fp32 model inputs select "tf32x3" everywhere (their
logits must match the reference closely); interpret mode (CPU) reproduces the operand rounding of "bf16", "bf16x2",
"bf16x3" and "tf32" and computes the others in fp32.

Decode: one program per (row, value head or key head group, V-block); see DecodeConfig.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import gdn_mgpu

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

CHUNK = 64
SUB = 16            # diagonal-block size of the triangular solve
HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """The previous prefill kernels ("v1": T from a parallel kernel, six products per chunk in the scan).
    bv=None picks the V-block from the amount of parallel work."""
    bv: int | None = None
    num_warps: int = 4
    num_stages: int = 2
    solve_warps: int = 4
    solve_stages: int = 1
    prec: str | None = None         # scan-kernel dots; None: "tf32" for bf16 inputs, "tf32x3" for fp32 inputs
    solve_prec: str | None = None   # K K^T of fp32 inputs (bf16 inputs: exact bf16 products; merges: exact fp32)

    @property
    def name(self):
        return f"v1_bv{self.bv or 'auto'}_w{self.num_warps}_s{self.num_stages}_{self.prec or 'auto'}"


@dataclasses.dataclass(frozen=True)
class WYConfig:
    """The WY prefill ("wy"): parallel prep kernel + a scan of four dots per chunk (module docstring).
    bv=None: the largest V-block (16..64) that still gives two scan programs per SM.
    prefetch: the scan loads chunk c+1's tiles while it computes chunk c (register double buffering, independent
    of Triton's software pipelining; meant for num_stages=1).
    Precisions (None = auto: bf16 inputs "bf16" / "tf32" / "bf16x2" / "tf32", fp32 inputs "tf32x3" everywhere):
    h_prec  X = W H and Y = q H (W is stored bf16 iff h_prec == "bf16"),
    o_prec  P Vnew,
    s_prec  the state update k^T (fk Vnew),
    prep_prec  W = T (..) and U = T (..) in the prep kernel.
    prep_mode  "tile": one value head per program, T assembled into one [64, 64] tile, W, U, P as full-tile
               products (the default; its Triton compile takes ~7 s on a CPU core, against ~20 s for "tile2");
               "tile2": the same with all value heads of a key head in one program (K K^T, Q K^T computed once,
               the heads' solve chains interleaved);
               "blocks": everything in 16-row blocks, heads in a loop (no assembly; the fallback);
               "solve": T by the v1 solve kernel on `solve_warps` warps, then the "tile" kernel given T (the
               solve's row loops and 16x16 reductions stay within one or two warps; T costs 2 x 16 KB of
               traffic per chunk and head);
               "solve2": the same with the value heads of a key head in one program given T (q, k and Q K^T
               once per key head);
               "auto": "fused" (bf16x3) for few chunks, else "solve2" (resolve_prep);
               "fused" (tform only): one kernel per (chunk, value head) writes T, P and f, T by recursive doubling
               on the whole [64, 64] tile (gdn._doubling_inverse: twelve full-tile products in solve_prec instead
               of the solve kernel's 16x16 substitutions and merges); "fused2": the same per (chunk, key head),
               Q K^T and K K^T once for its value heads."""
    bv: int | None = None
    num_warps: int = 4
    num_stages: int | None = 1    # None: 2 while the scan's programs fit in one wave on the SMs, else 1 (smaller
                                  # buffers, two programs per SM): pick_stages
    prefetch: bool = True
    prep_warps: int = 4
    pf_warps: int | None = None   # the P / f prep's warps after the T solve (prep_mode "solve" / "solve2"; None:
                                  # prep_warps, which the fused prep keeps): H200, 1x8k, kernel traces: 45.2 us at 2
                                  # warps, 74.8 at 4, 64.7 at 8 (40df20e; DEFAULT_PREFILL's note)
    prep_mode: str = "tile"
    h_prec: str | None = None
    o_prec: str | None = None
    s_prec: str | None = None
    prep_prec: str | None = None
    solve_warps: int = 2
    solve_grid: str = "key"       # the T solve's grid: "key" (chunk, key head), the key head's value heads in a loop;
                                  # "value" (chunk, value head), K K^T per value head: half the chain per program, for
                                  # few chunks, where every program runs in one wave and the chain is the time; "auto":
                                  # "value" while those programs fit in SOLVE_WAVE_PROGRAMS (resolve_prep)
    tform: bool = False           # the scan applies T itself: Vnew = T (beta V - beta e^gamma |k|^-1 K H) (one more
                                  # dot per chunk); the prep writes P and f only (no W, U: ~1/3 of its traffic)
    overlap: bool = False         # W-form scan: both products of H issued before either is used, the row factors
                                  # loaded a chunk ahead and the chunk decay as a scalar (no reduction); Triton still
                                  # waits after every dot. The T-form scan always runs this way.
    mgpu: str = ""                # tform: the scan as a Mosaic GPU kernel (pallas_kernels/gdn_mgpu.py), not Triton:
                                  # "on" (V-block bv if 32 or 64, else gdn_mgpu.pick_bv's; num_stages TMA buffers, 2 if
                                  # None), or "auto": pick_bv's V-block wherever gdn_mgpu.applies (bf16, starts aligned,
                                  # dk % 64, dv % 32, rows % 8), the Triton scan elsewhere
    mgpu_out: str = "chunks"      # the Mosaic scan's output: "chunks" (whole tiles per chunk, gathered by XLA) |
                                  # "direct" (TMA into o's rows, a tail chunk as power-of-two row pieces): gdn_mgpu;
                                  # H200, d61f829, whole prefill: direct 457.9 vs chunks 501.6 us at 1x8k
    mgpu_wgs: int = 1             # the Mosaic scan's warpgroups per program, each its own V-block (bv; 16 allowed
                                  # with 2) on shared q, k, T, P, f tiles: two dependent-product chains per SM
    t_parts: int = 2              # the Mosaic scan's T as bf16 hi + lo parts (2: ~tf32x3 products with the split
                                  # operand) or hi alone (1: T rounded to bf16 as fla's A, half its traffic, one
                                  # product fewer per chunk)
    p_parts: int = 2              # the same for P (its rounding reaches o alone, not the state)
    v_parts: int = 2              # the Mosaic scan's X, Vnew and fk Vnew (formed per chunk in fp32) as bf16 hi + lo
                                  # (2) or rounded to bf16 (1: fla's bf16 v_new; three products and three tile
                                  # stores fewer per chunk on the chain of dependent products): gdn_mgpu.scan
    mgpu_lookahead: bool = False  # the Mosaic scan carries the next chunk's K H (two rounds of products per chunk
                                  # on its chain instead of three; V-block <= 32): gdn_mgpu.scan
    mgpu_defer_o: bool = False    # the Mosaic scan stores a chunk's output while the next chunk's K H and Q H run
                                  # (H200, ccc4f03: no faster at 1x8k, slower at 1x32k: DEFAULT_PREFILL's note)
    solve_prec: str = "tf32x3"    # the solve's merge dots: "tf32x3" | "ieee" (exact fp32; 146.0 vs 102.3 us at
                                  # 1x8k, T within 1.6e-10: bench/prefill_parts.py) | "tf32" (one product each:
                                  # T within 2.3e-5, 8.7e-4 on repeated keys, below T's bf16 rounding for the
                                  # Mosaic scan, t_parts=1; the fused preps' doubling 3.1e-5 / 9.3e-4; the
                                  # default's: DEFAULT_PREFILL's note) |
                                  # "bf16x3" (the fused preps' under prep_mode "auto") | "auto" (TF32 on bf16
                                  # inputs, tf32x3 on fp32: resolve_prep)

    @property
    def name(self):
        p = "_".join(x or "a" for x in (self.h_prec, self.o_prec, self.s_prec, self.prep_prec))
        inv = "" if self.solve_prec == "tf32x3" else f"_{self.solve_prec}"
        return (f"wy_bv{self.bv or 'auto'}_w{self.num_warps}_s{self.num_stages or 'auto'}"
                + ('_pf' if self.prefetch else '')
                + ("_ov" if self.overlap else "") + ("_tf" if self.tform else "")
                + (f"_mg_{self.mgpu}" if self.mgpu else "") + ("_odir" if self.mgpu_out == "direct" else "")
                + (f"_wg{self.mgpu_wgs}" if self.mgpu_wgs != 1 else "") + ("_la" if self.mgpu_lookahead else "")
                + ("_do" if self.mgpu_defer_o else "")
                + ("" if self.t_parts == 2 else f"_t{self.t_parts}")
                + ("" if self.p_parts == 2 else f"_p{self.p_parts}")
                + ("" if self.v_parts == 2 else f"_v{self.v_parts}")
                + f"_pw{self.prep_warps}" + (f"_pfw{self.pf_warps}" if self.pf_warps else "")
                + ('' if self.prep_mode == 'tile' else '_' + self.prep_mode)
                + (f"{self.solve_warps}" if self.prep_mode in ("solve", "solve2", "auto") else "")
                + ("" if self.solve_grid == "key" else f"_sg{self.solve_grid[0]}") + inv
                + ("" if p == "a_a_a_a" else f"_{p}"))

    def precisions(self, dtype):
        auto = ("tf32x3",) * 4 if dtype == jnp.float32 else ("bf16", "tf32", "bf16x2", "tf32")
        return tuple(x or a for x, a in zip((self.h_prec, self.o_prec, self.s_prec, self.prep_prec), auto))


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """bv: V-rows of the state per program; group: one program does all value heads of a key head (q, k and
    their norms loaded once), grid (rows, Hk, dv / bv) instead of (rows, Hv, dv / bv)."""
    bv: int = 8                # fla's decode tile ([8, 128] fp32 per program, one warp): 96% of copy at batch 256
    num_warps: int = 1
    num_stages: int = 1
    group: bool = False
    vblocks: int = 1           # V-blocks per program, in a loop that loads block j + 1's state before it stores
                               # block j's; q, k and their norms computed once per program, not once per V-block
    vfirst: bool = False       # grid (V-block, head, row) instead of (row, head, V-block): the first grid axis is
                               # CUDA's x, scheduled fastest, so neighbouring programs then walk one head's
                               # contiguous state (as fla's grid (NV, N * HV)) instead of one block of every row

    @property
    def name(self):
        return (f"bv{self.bv}_w{self.num_warps}" + ("_grp" if self.group else "") + ("_vf" if self.vfirst else "")
                + (f"_l{self.vblocks}" if self.vblocks > 1 else "")
                + (f"_s{self.num_stages}" if self.num_stages > 1 else ""))


# The fastest configuration of the H200 sweeps (bench/RESULTS.md): at 8d3cb55 the scan alone took 401 us at 1x8k
# against 900 us for the register-prefetching WYConfig() (whole prefill 1019 vs 1564 us); at 1652ce8 the "solve"
# prep on one warp took 417 us against 615 us for the one-kernel prep (whole prefill 838 us). At fa696dc, by part
# (bench/prefill_parts.py): the solve with tf32x3 merges 92.2 us against 152.6 with exact ones, the tile kernel
# given T 263.6 us, the scan with overlap 359.4 us against 380.7 without.
# At 0f84710 (bench/prefill_parts.py, whole prefill): the T-form 584.0 us against 719.0 at 1x8k (bv 16 598.5, one
# stage 719.9), and at 8x2k 1228.8 us at one stage, 1323.0 at two, 1569.7 for the W-form.
# At 14b2a2a (one run, bench/prefill_parts.py whole): P and f per key head ("solve2") 557.9 vs 576.1 us at 1x8k and
# 1187.8 vs 1218.0 at 8x2k; two dot-merging variants of the T-form scan were slower and removed: the state update's
# bf16 hi + lo pair as one K = 128 dot [k; k]^T [hi; lo] (638.3 us) and k H, q H as one [k; q] H dot split in
# registers (700.4 us; both 799.3): Triton's joins and splits go through shared memory, and the registers ran out.
# At 8169ddc solve2 was no faster at 1x8k (576.0 vs 575.8 us, prefill_parts whole), and the headline run with it as
# the default read 104.4 us at 1x1k against 85.3 us with "solve" at 7ccd469 (1x8k 577.2 vs 588.2, 8x2k 1223.8 vs
# 1236.2): per key head it has half the programs, ~2 per SM at 1k tokens. So "solve" is the default again.
# At c123fba (bench/prefill_parts.py whole, H200) the Mosaic GPU scan (gdn_mgpu) took 453.6 us at 1x8k against
# 578.6 for the Triton scan, 840.9 against 1197.1 at 8x2k (the Mosaic figures up to c257dc4 leave out the XLA gather
# of its chunk tiles, 45 us at 1x8k, 91 at 8x2k: the timing let XLA fuse its one-row slice into the gather).
# At c757fe0 / a1f01f0 (two runs, bench/prefill_parts.py whole, H200) the fused T / P / f prep in bf16x3 took 89.0 /
# 83.4 us at 1x1k against 102.0 / 119.6 for "solve", but 628.3 / 632.5 at 1x8k against 481.9 / 484.0 (its doubling
# products outgrow the solve once its programs pass a few waves), and "solve2" 475.3 / 475.4 at 1x8k, 815.4 / 840.3
# at 8x2k against 838.9 / 838.5: hence prep_mode "auto" (resolve_prep).
# At d61f829 (prefill_parts whole, the gather timed) the Mosaic scan's direct output took 457.9 us at 1x8k against
# 501.6 for the chunk tiles, 831.2 vs 924.2 at 8x2k (the same scan kernel time: 272.4 vs 272.1 us), and T and P as
# bf16 hi alone 450.7 / 750.6 more (93.1 / 80.7 at 1x1k); against the fp32 token scan o 2.3e-3 vs 1.7e-3, the states
# 2.5e-5 vs 4.1e-6 (T alone as hi: o 1.7e-3, 463.5 / 787.6 us).
# At 04f74c6 (bench/kernels.py headline, one run against fla) the T solve's merges as one TF32 product each
# (solve_prec "tf32": T is rounded to bf16 for the Mosaic scan anyway) with the Mosaic scan's X, Vnew and fk Vnew
# rounded to bf16 (v_parts=1, as fla's v_new: 5 products and 3 tile stores per chunk on its chain instead of 8 and 5)
# took 77.6 / 336.0 / 1340.3 / 634.7 us at 1x1k / 1x8k / 1x32k / 8x2k against 95.6 / 432.3 / 1697.4 / 802.2 for
# PREVIOUS_PREFILL (fla 94.0 / 530.3 / 2080.4 / 1047.4). Its errors sit at fla's level rather than below it: CPU
# interpret, dk 64, dv 128, 2048 tokens, o 3.39e-3 and state 2.52e-3 from the fp32 token scan against 2.42e-3 /
# 3.55e-4 (bars 4e-3 / 3e-3; fla's own on the H200 check 3.86e-3 / 2.55e-3). The deferred output store
# (mgpu_defer_o, ccc4f03) read 441.6 / 1695.6 / 773.5 us at 1x8k / 1x32k / 8x2k against 440.4 / 1602.6 / 763.8
# without it: not taken. (solve_prec "auto": the solve in TF32 on bf16 inputs only; fp32 models keep tf32x3 merges.)
# At 95822fc (bench/prefill_parts.py whole + kernel traces, H200) the P / f prep on 2 warps (pf_warps=2: 5 programs
# per SM, mma.sync) took 44.2 us at 1x8k against 74.8 on 4 warps (wgmma, 4 per SM) and 64.7 on 8 (1 warp spills:
# triton_compile_check), whole prefill 319.0 vs 349.3; the T solve per value head (solve_grid "value") 88.2 against
# 73.5 at 1x8k, but at 1x1k, with "solve2" in place of the fused prep, 70.9 us against 80.2 per key head and 86.1
# for the fused prep (solve 22.0 vs 30.9, the fused prep 44.4: two waves of 512 programs at 178 registers). The
# headline (bench/kernels.py, same run) read the candidate (solve2, pf_warps=2, per value head at every size) at
# 71.0 / 323.2 / 1260.6 / 592.5 us at 1x1k / 1x8k / 1x32k / 8x2k against 88.3 / 349.8 / 1306.2 / 614.7 for the
# previous default and fla's 93.7 / 527.5 / 2070.6 / 1040.1. Hence pf_warps=2, solve_grid "auto" and the fused
# prep in one wave at most (FUSED_PREP_PROGRAMS).
# At a14febd (bench/prefill_parts.py whole + kernel traces) the T solve and the P / f prep as one launch (both
# kernels' programs side by side in one grid, on one warp: 255 registers, 288 B of spills) took 45.9 us at 1x1k
# against 20.9 + 8.9 for the two kernels (whole 80.2 vs 65.0; on two warps 75.5), 134.4 vs 74.4 + 44.8 at 1x8k; only
# 1x512 on two warps read faster (44.9 vs 49.5, one reading): removed.
DEFAULT_PREFILL = WYConfig(bv=32, num_stages=None, prefetch=False, prep_mode="auto", solve_warps=1, overlap=True,
                           tform=True, mgpu="auto", mgpu_out="direct", t_parts=1, p_parts=1, v_parts=1,
                           solve_prec="auto", pf_warps=2, solve_grid="auto")
# The default up to 04f74c6: tf32x3 merges in the T solve, X, Vnew, fk Vnew as bf16 hi + lo (errors below fla's),
# P / f on prep_warps, the solve per key head (the fused prep's threshold, FUSED_PREP_PROGRAMS, is today's)
PREVIOUS_PREFILL = dataclasses.replace(DEFAULT_PREFILL, v_parts=2, solve_prec="tf32x3", pf_warps=None,
                                       solve_grid="key")
# Timed beside the default in bench/kernels.py's headline: the next default if it reads faster there. The T solve
# per value head at every size: at 1x8k 328.0 against 319.0 us per key head (95822fc, one parts run); in the
# headline 334.1 / 1118.3 / 590.6 us at 1x8k / 1x32k / 8x2k against the default's 324.5 / 1170.7 / 559.5 (dc9bd2c),
# 304.6 / 1233.2 / 543.7 against 283.5 / 1192.8 / 512.0 (6a53c84). The last candidates: solve2 with pf_warps=2 and the solve
# per value head everywhere (95822fc: now the default wherever it was faster); P / f on 8 warps read 315.6 / 86.9 /
# 1281.2 / 616.1 us at 1x8k / 1x1k / 1x32k / 8x2k against 350.2 / 87.2 / 1363.3 / 613.5 (40df20e); two warpgroups per
# scan program (mgpu_wgs=2) 385.7 us at 1x8k against 370.8 (660dad0).
CANDIDATE_PREFILL = dataclasses.replace(DEFAULT_PREFILL, solve_grid="value")
TRITON_PREFILL = dataclasses.replace(DEFAULT_PREFILL, mgpu="", mgpu_out="chunks", t_parts=2, p_parts=2)  # the Triton
# T-form scan (the default before the Mosaic scan; the Mosaic-only options at their field defaults)
FUSED_PREP_PROGRAMS = 2 * 132     # prep_mode "auto": the fused prep while its programs run in one wave on the H200
# (178 registers at 4 warps: 2 per SM): at 1x1k (512 programs, two waves) it read 86.1 us against 70.9 for solve2
SOLVE_WAVE_PROGRAMS = 8 * 132     # solve_grid "auto": "value" while the 1-warp solve's programs (255 registers: 8 per
# SM) run in one wave


def resolve_prep(config: WYConfig, max_chunks: int, hv: int, dtype) -> WYConfig:
    """solve_prec "auto": TF32 on bf16 inputs, tf32x3 on fp32 ones (near-fp32 dots for fp32 models, as
    WYConfig.precisions). prep_mode "auto": T, P and f from the fused kernel (T products in bf16x3, or TF32 where
    solve_prec asks for it) while its (chunk, value head) programs fit in FUSED_PREP_PROGRAMS on bf16 inputs with the
    T-form; else T from the solve kernel and P, f per key head ("solve2"). solve_grid "auto": the solve per value
    head while its (chunk, value head) programs fit in SOLVE_WAVE_PROGRAMS, else per key head."""
    if config.solve_prec == "auto":
        config = dataclasses.replace(config, solve_prec="tf32" if jnp.dtype(dtype) == jnp.bfloat16 else "tf32x3")
    if config.solve_grid not in ("key", "value", "auto"):
        raise ValueError(f"WYConfig.solve_grid must be 'key', 'value' or 'auto', got {config.solve_grid!r}")
    if config.solve_grid == "auto":
        config = dataclasses.replace(config, solve_grid="value" if max_chunks * hv <= SOLVE_WAVE_PROGRAMS else "key")
    if config.prep_mode != "auto":
        return config
    if config.tform and jnp.dtype(dtype) == jnp.bfloat16 and max_chunks * hv <= FUSED_PREP_PROGRAMS:
        return dataclasses.replace(config, prep_mode="fused", solve_prec="tf32" if config.solve_prec == "tf32"
                                   else "bf16x3")
    return dataclasses.replace(config, prep_mode="solve2")


# Decode: at 4ba363e the V-block-fastest grid took 272 us at batch 256 (92% of copy) against 309 us for the same
# tile in (row, head, V-block) order, 70.5 vs 76.1 us at batch 64.
DEFAULT_DECODE = DecodeConfig(vfirst=True)


def prefill_sweep():
    """Every prefill configuration bench/kernels.py times (tests cross-lower each one for CUDA). Compiled for sm_90
    with Triton 3.9 on the CPU (pallas_kernels/triton_compile_check.py, ptxas spills read from the stack frame):
    the register-prefetching scan (prefetch=True, the first default) spills 512 B per thread at 4 warps; the
    others listed here do not. Scans at num_stages=2 take 148-164 KB of shared memory (one program per SM: bv=16's
    256 single-sequence programs run in two waves). A split of the scan into a state-chain kernel and a parallel
    output kernel (fla's fwd_h / fwd_o) timed 473-609 us against 395-401 us for the one-kernel default at 1x8k on
    the H200 (two runs, bench/RESULTS.md) and was removed."""
    nopf = functools.partial(WYConfig, prefetch=False)
    return [WYConfig(),                                                   # bv auto, 4 warps, 1 stage, prefetch
            nopf(bv=16), nopf(bv=32, num_warps=8), nopf(bv=16, num_warps=8), nopf(bv=64, num_warps=8),
            nopf(bv=16, num_stages=2), nopf(bv=32, num_stages=2), nopf(bv=32, num_warps=8, num_stages=2),
            nopf(bv=32, num_stages=2, overlap=True), nopf(bv=32, num_stages=2, overlap=True, num_warps=8),
            nopf(bv=16, num_stages=2, overlap=True),
            nopf(bv=32, num_stages=2, prep_mode="solve", solve_warps=1, tform=True),
            dataclasses.replace(DEFAULT_PREFILL, prep_mode="solve"),
            dataclasses.replace(DEFAULT_PREFILL, prep_mode="solve2"),
            dataclasses.replace(DEFAULT_PREFILL, mgpu_out="chunks"),
            dataclasses.replace(DEFAULT_PREFILL, mgpu_wgs=2),
            dataclasses.replace(DEFAULT_PREFILL, mgpu_lookahead=True),
            dataclasses.replace(DEFAULT_PREFILL, t_parts=2, p_parts=2),
            dataclasses.replace(DEFAULT_PREFILL, p_parts=2),
            dataclasses.replace(DEFAULT_PREFILL, mgpu_defer_o=True),
            dataclasses.replace(DEFAULT_PREFILL, solve_prec="tf32x3"),
            dataclasses.replace(DEFAULT_PREFILL, v_parts=2), PREVIOUS_PREFILL, CANDIDATE_PREFILL,
            dataclasses.replace(DEFAULT_PREFILL, prep_mode="fused"),
            dataclasses.replace(DEFAULT_PREFILL, prep_mode="fused", solve_prec="bf16x3"),
            dataclasses.replace(DEFAULT_PREFILL, prep_mode="fused2", solve_prec="bf16x3"),
            dataclasses.replace(DEFAULT_PREFILL, s_prec="bf16"),
            nopf(bv=64, num_stages=2, num_warps=8, prep_mode="solve", solve_warps=1, tform=True),
            nopf(bv=32, num_stages=2, s_prec="bf16"),      # one-dot state update; emulated state error ~1.8e-3
            nopf(bv=32, num_stages=2, s_prec="tf32"),
            PrefillConfig()]


# WYConfig overrides of the prep variants bench/kernels.py times alone
PREP_VARIANTS = (dict(prep_mode="tile", prep_warps=4), dict(prep_mode="tile", prep_warps=2),
                 dict(prep_mode="solve", solve_warps=1), dict(prep_mode="solve", solve_warps=2),
                 dict(prep_mode="solve", solve_warps=1, solve_prec="ieee"),
                 dict(prep_mode="solve", solve_warps=1, prep_warps=8),
                 dict(prep_mode="solve", solve_warps=1, prep_warps=2),
                 dict(prep_mode="solve2", solve_warps=1, prep_warps=4),
                 dict(prep_mode="solve2", solve_warps=1, prep_warps=8),
                 dict(prep_mode="tile2", prep_warps=4), dict(prep_mode="blocks", prep_warps=4))


def decode_sweep():
    """Every decode configuration bench/kernels.py times (tests cross-lower each one for CUDA)."""
    return [DecodeConfig(), DecodeConfig(bv=32, num_warps=2), DecodeConfig(bv=16, num_warps=1),
            DecodeConfig(bv=64, num_warps=4), DecodeConfig(bv=8, num_warps=1, group=True),
            DecodeConfig(bv=32, num_warps=4, group=True),
            DecodeConfig(vblocks=4), DecodeConfig(vblocks=16), DecodeConfig(bv=16, vblocks=4),
            DecodeConfig(bv=16, num_warps=2, vblocks=8), DecodeConfig(bv=32, num_warps=2, vblocks=4),
            DecodeConfig(vfirst=True), DecodeConfig(bv=16, vfirst=True), DecodeConfig(bv=32, num_warps=2, vfirst=True),
            DecodeConfig(bv=8, num_warps=1, group=True, vfirst=True)]


# ----------------------------------------------------------------------------------------------------------------
# In-kernel helpers (all traced inside the kernels; only ops the Triton lowering supports).


def _round_tf32(x):
    """fp32 -> the nearest TF32 value (10 mantissa bits, ties away, as cvt.rna.tf32.f32): interpret-mode emulation."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jax.lax.bitcast_convert_type((bits + 0x1000) & ~0x1FFF, jnp.float32)


def _mm(a, b, contract, prec, interpret):
    """2-D dot with fp32 accumulation. contract = (lhs axis, rhs axis).
    "bf16x2": a is taken as bf16 (meant for an exact bf16 operand), b as a bf16 hi + lo pair (two dots);
    "bf16x3": a and b as bf16 hi + lo pairs (three dots, the lo x lo term dropped)."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    dot = functools.partial(jax.lax.dot_general, dimension_numbers=dims, preferred_element_type=jnp.float32)
    if prec == "bf16":
        return dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16))
    if prec == "bf16x2":
        hi, lo = gdn_mgpu.split_bf16(b.astype(jnp.float32))
        a = a.astype(jnp.bfloat16)
        return dot(a, lo) + dot(a, hi)
    if prec == "bf16x3":                      # both operands as bf16 hi + lo: ~2^-16 relative, three bf16 products
        (ah, al), (bh, bl) = gdn_mgpu.split_bf16(a.astype(jnp.float32)), gdn_mgpu.split_bf16(b.astype(jnp.float32))
        return dot(ah, bl) + dot(al, bh) + dot(ah, bh)
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    if interpret and prec == "tf32":           # reproduce the GPU's operand rounding on the CPU
        a, b, precision = _round_tf32(a), _round_tf32(b), HIGHEST
    elif interpret or prec == "ieee":
        precision = HIGHEST
    elif prec == "tf32":
        precision = None                      # fp32 operands -> TF32 tensor cores in the Triton lowering
    elif prec == "tf32x3":
        precision = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    else:
        raise ValueError(f"unknown dot precision {prec!r}")
    return dot(a, b, precision=precision)


def _l2norm(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _gates(a, b, a_log, dt_bias):
    """fp32 log decay g <= 0 and beta = sigmoid(b), as gdn_reference.gates."""
    g = -jnp.exp(a_log) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias)
    return g, jax.nn.sigmoid(b.astype(jnp.float32))


def _load(ref, mask, other=0.0):
    return pltriton.load(ref, mask=mask, other=other)


def _inv_unit_lower(blocks):
    """(I + a)^-1 for each strictly lower [16,16] fp32 block a, by forward substitution (exact fp32, like fla);
    one loop over rows updates all blocks (independent chains). (The product form (I - a)(I + a^2)(I + a^4)
    (I + a^8) timed slower on the H200, 190.6 vs 102.3 us for the 1x8k solve, and lost up to 1.5e-4 of T on
    repeated keys: bench/prefill_parts.py.)"""
    n = blocks[0].shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    cols1 = jax.lax.broadcasted_iota(jnp.int32, (n,), 0)

    def row(i, invs):
        out = []
        for a, inv in zip(blocks, invs):
            r = jnp.sum(jnp.where(rows == i, -a, 0.0), axis=0)
            r = jnp.where(cols1 < i, r, 0.0)
            r = r + jnp.sum(r[:, None] * inv, axis=0)
            out.append(jnp.where(rows == i, r[None, :], inv))
        return tuple(out)

    invs = jax.lax.fori_loop(2, n, row, tuple(-a for a in blocks))
    eye = (rows == jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)).astype(jnp.float32)
    return [inv + eye for inv in invs]


# ----------------------------------------------------------------------------------------------------------------
# Kernel 1: T = (I + A)^-1 per (chunk, value head).


def _store_t(ref, lead, tile, x):
    """ref[lead + tile] = x (fp32), or where ref is bf16 with a parts axis after lead: its hi and lo parts (x = hi +
    lo to ~2^-16 relative), or hi alone where that axis has one entry (the Mosaic GPU scan's bf16 tensor-core
    operands, gdn_mgpu)."""
    if ref.dtype == jnp.float32:
        ref[lead + tile] = x
        return
    hi, lo = gdn_mgpu.split_bf16(x)
    ref[lead + (0,) + tile] = hi
    if ref.shape[len(lead)] == 2:
        ref[lead + (1,) + tile] = lo


def _solve_kernel(row0_ref, nvalid_ref, k_ref, a_ref, b_ref, alog_ref, dtb_ref, t_ref, *, ratio, prec, interpret,
                  inv_prec="ieee", per_value_head=False):
    """Grid (chunk, key head), the key head's value heads in a loop; per_value_head: grid (chunk, value head)."""
    c, h = pl.program_id(0), pl.program_id(1)
    kh, heads = (h // ratio, 1) if per_value_head else (h, ratio)
    nvalid = nvalid_ref[c]

    @pl.when(nvalid > 0)
    def _():
        row0 = row0_ref[c]
        mm = functools.partial(_mm, interpret=interpret)
        nb = CHUNK // SUB
        # raw K K^T: exact on bf16 tensor cores for bf16 inputs
        _, _, valid, kk = _k_blocks(k_ref, row0, kh, nvalid, "bf16" if k_ref.dtype == jnp.bfloat16 else prec, mm)

        def per_head(r, carry):                              # the value heads sharing this key head
            hv = h if per_value_head else kh * ratio + r
            gam, betas, _ = _chunk_gates(a_ref, b_ref, row0, hv, valid, alog_ref[hv], dtb_ref[hv])
            inv = _unit_lower_inverse(kk, gam, betas, interpret, inv_prec)
            zero = jnp.zeros((SUB, SUB), jnp.float32)
            for i in range(nb):
                for j in range(nb):
                    _store_t(t_ref, (c, hv), (pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)),
                             inv[i, j] if j <= i else zero)
            return carry

        jax.lax.fori_loop(0, heads, per_head, 0)


# ----------------------------------------------------------------------------------------------------------------
# Kernel 2: the chunk scan with the state on chip.


def _scan_kernel(start_ref, len_ref, span_ref, slot_ref, use_ref, coff_ref, q_ref, k_ref, v_ref, a_ref, b_ref,
                 alog_ref, dtb_ref, t_ref, pool_ref, o_ref, pool_out_ref, *, ratio, bv, prec, interpret):
    # Q K^T of bf16 inputs is exact on bf16 tensor cores (fp32 accumulation); fp32 inputs use `prec`.
    exact_prec = "bf16" if q_ref.dtype == jnp.bfloat16 else prec
    n, hv, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kh = hv // ratio
    start, length, span = start_ref[n], len_ref[n], span_ref[n]
    slot, coff = slot_ref[n], coff_ref[n]
    dk = q_ref.shape[-1]
    scale = dk ** -0.5
    a_log, dt_bias = alog_ref[hv], dtb_ref[hv]
    mm = functools.partial(_mm, prec=prec, interpret=interpret)
    vcols = pl.ds(vb * bv, bv)
    rows = jnp.arange(CHUNK, dtype=jnp.int32)
    incl = rows[:, None] >= rows[None, :]

    h = pool_ref[slot, hv, vcols, :]
    h = jnp.where(use_ref[n] != 0, h, 0.0)

    def chunk(c, h):
        row0 = start + c * CHUNK
        nvalid = jnp.minimum(length - c * CHUNK, CHUNK)
        valid = rows < nvalid
        vk = jnp.broadcast_to(valid[:, None], (CHUNK, dk))
        # q, k stay raw (input dtype, half the registers of fp32); l2norm and scale act as fp32 row factors.
        qr = _load(q_ref.at[pl.ds(row0, CHUNK), kh, :], vk)
        kr = _load(k_ref.at[pl.ds(row0, CHUNK), kh, :], vk)
        qf, kf = qr.astype(jnp.float32), kr.astype(jnp.float32)
        rq = jax.lax.rsqrt(jnp.sum(qf * qf, axis=1) + 1e-6) * scale
        rk = jax.lax.rsqrt(jnp.sum(kf * kf, axis=1) + 1e-6)
        v = _load(v_ref.at[pl.ds(row0, CHUNK), hv, vcols], jnp.broadcast_to(valid[:, None], (CHUNK, bv)))
        g, beta = _gates(_load(a_ref.at[pl.ds(row0, CHUNK), hv], valid),
                         _load(b_ref.at[pl.ds(row0, CHUNK), hv], valid), a_log, dt_bias)
        g = jnp.where(valid, g, 0.0)                       # padding is inert: no decay, no write
        beta = jnp.where(valid, beta, 0.0)
        gam = jnp.cumsum(g)
        g_last = jnp.min(gam)                              # gamma at the last valid row (gamma non-increasing)
        eg = jnp.exp(gam)
        t = t_ref[coff + c, hv, :, :]
        kh_ = mm(kf, h, (1, 1))                            # [C, BV] = K H (H is V-first [BV, dk]), k unnormalised
        vnew = mm(t, beta[:, None] * (v.astype(jnp.float32) - (eg * rk)[:, None] * kh_), (1, 0))
        qh = mm(qf, h, (1, 1))
        p = _mm(qr, kr, (1, 1), exact_prec, interpret) * (rq[:, None] * rk[None, :])
        p = jnp.where(incl, p * jnp.exp(jnp.where(incl, gam[:, None] - gam[None, :], 0.0)), 0.0)
        o = (eg * rq)[:, None] * qh + mm(p, vnew, (1, 0))
        ostore = jnp.broadcast_to((rows < span - c * CHUNK)[:, None], (CHUNK, bv))
        pltriton.store(o_ref.at[pl.ds(row0, CHUNK), hv, vcols], o.astype(o_ref.dtype), mask=ostore)
        wgt = vnew * (jnp.exp(g_last - gam) * rk)[:, None]  # decay to the chunk end and k's norm, on Vnew's rows
        return jnp.exp(g_last) * h + mm(wgt, kf, (0, 0))

    nch = (length + CHUNK - 1) // CHUNK
    h = jax.lax.fori_loop(0, nch, chunk, h)

    def zero_chunk(c, carry):                              # rows [len, span): padding of a padded batch
        row0 = start + c * CHUNK
        m = jnp.broadcast_to((rows < span - c * CHUNK)[:, None], (CHUNK, bv))
        pltriton.store(o_ref.at[pl.ds(row0, CHUNK), hv, vcols], jnp.zeros((CHUNK, bv), o_ref.dtype), mask=m)
        return carry

    jax.lax.fori_loop(nch, (span + CHUNK - 1) // CHUNK, zero_chunk, 0)
    pool_out_ref[slot, hv, vcols, :] = h               # same buffer as pool_ref (aliased): in place


# ----------------------------------------------------------------------------------------------------------------
# The WY pipeline (WYConfig): a fully parallel prep kernel, then a scan of four dots per chunk.


def _chunk_gates(a_ref, b_ref, row0, hv, valid, a_log, dt_bias):
    """Per 16-row block of a chunk: gates (zero on invalid rows: inert) and the chunk-local cumulative log decay.
    Returns (gammas, betas, gamma at the last valid row)."""
    gs, betas = [], []
    for i, vi in enumerate(valid):
        av = _load(a_ref.at[pl.ds(row0 + i * SUB, SUB), hv], vi)
        bv = _load(b_ref.at[pl.ds(row0 + i * SUB, SUB), hv], vi)
        g, beta = _gates(av, bv, a_log, dt_bias)
        gs.append(jnp.where(vi, g, 0.0))
        betas.append(jnp.where(vi, beta, 0.0))
    gam, acc = [], 0.0
    for g in gs:
        cs = jnp.cumsum(g) + acc
        gam.append(cs)
        acc = jnp.min(cs)                                    # = last entry: gamma is non-increasing
    return gam, betas, acc


def _k_blocks(k_ref, row0, kh, nvalid, raw, mm):
    """A chunk's raw k rows as four 16-row blocks (rows past nvalid read as 0), their l2norm row factors, the
    masks of valid rows and the blocks of K^ K^T {(i, j): [16, 16], j <= i} (raw: the precision of the raw
    products; bf16 inputs are exact on tensor cores)."""
    dk = k_ref.shape[-1]
    idx = jnp.arange(SUB, dtype=jnp.int32)
    ks, rks, valid = [], [], []
    for i in range(CHUNK // SUB):
        vi = idx + i * SUB < nvalid
        valid.append(vi)
        kx = _load(k_ref.at[pl.ds(row0 + i * SUB, SUB), kh, :], jnp.broadcast_to(vi[:, None], (SUB, dk)))
        kf = kx.astype(jnp.float32)
        ks.append(kx)
        rks.append(jax.lax.rsqrt(jnp.sum(kf * kf, axis=1) + 1e-6))          # l2norm as row factors
    kk = {(i, j): mm(ks[i], ks[j], (1, 1), raw) * (rks[i][:, None] * rks[j][None, :])
          for i in range(len(ks)) for j in range(i + 1)}
    return ks, rks, valid, kk


def _a_blocks(kk, gam, betas):
    """A = strict_lower(beta K^ K^T * Gamma) as 16x16 blocks {(i, j): block, j <= i} (kk: the blocks of K^ K^T)."""
    idx = jnp.arange(SUB, dtype=jnp.int32)
    strict = idx[:, None] > idx[None, :]
    blocks = {}
    for i in range(len(gam)):
        for j in range(i + 1):
            diff = gam[i][:, None] - gam[j][None, :]
            if i == j:                                       # mask before exp: i < j would overflow
                blocks[i, j] = jnp.where(
                    strict, betas[i][:, None] * kk[i, j] * jnp.exp(jnp.where(strict, diff, 0.0)), 0.0)
            else:
                blocks[i, j] = betas[i][:, None] * kk[i, j] * jnp.exp(diff)
    return blocks


def _merge_inverse(blocks, diag, interpret, prec="ieee"):
    """T = (I + A)^-1 as blocks {(i, j): block, j <= i} from A's blocks and the inverses of its diagonal blocks,
    by the merge T_ij = -T_ii sum_m A_im T_mj (fla's scheme) in `prec` ("ieee": exact fp32)."""
    nb = len(diag)
    exact = functools.partial(_mm, contract=(1, 0), prec=prec, interpret=interpret)
    inv = {(i, i): diag[i] for i in range(nb)}
    for d in range(1, nb):
        for j in range(nb - d):
            i = j + d
            s = exact(blocks[i, j], inv[j, j])
            for m in range(j + 1, i):
                s = s + exact(blocks[i, m], inv[m, j])
            inv[i, j] = -exact(inv[i, i], s)
    return inv


def _unit_lower_inverse(kk, gam, betas, interpret, prec="ieee"):
    """T = (I + A)^-1 as 16x16 blocks: diagonal blocks by forward substitution, the others by the merge in prec."""
    blocks = _a_blocks(kk, gam, betas)
    return _merge_inverse(blocks, _inv_unit_lower([blocks[i, i] for i in range(len(gam))]), interpret, prec)


def _doubling_inverse(a, mm):
    """T = (I + A)^-1 of a strictly lower [64, 64] A on the whole tile, by recursive doubling: with X_b the inverse of
    I + A's diagonal blocks of size b, the blocks of size 2b are [[X0, 0], [-X1 C X0, X1]], i.e.
    X_2b = X_b - X_b (M_b X_b) where M_b keeps A's entries in the lower-left b x b quarter of each 2b block. Six steps
    from X_1 = I, two full-tile products each (mm: their precision); no power of A is formed, so nothing grows (the
    product form (I - A)(I + A^2)... lost 1.5e-4 of T on repeated keys)."""
    n = a.shape[0]
    idx = jnp.arange(n, dtype=jnp.int32)

    def step(s, x):                       # a loop, not unrolled: the six masked copies of A never live at once
        lower, upper = ((idx >> s) & 1) == 1, ((idx >> s) & 1) == 0
        quarter = ((idx >> (s + 1))[:, None] == (idx >> (s + 1))[None, :]) & lower[:, None] & upper[None, :]
        return x - mm(x, mm(jnp.where(quarter, a, 0.0), x))

    return jax.lax.fori_loop(0, n.bit_length() - 1, step, (idx[:, None] == idx[None, :]).astype(jnp.float32))


def _hcat(a, b):
    """[m, n] and [m, n] -> [m, 2n] (join + transpose + reshape: Triton-legal, no reordering concatenate)."""
    m, n = a.shape
    return jnp.transpose(jnp.stack([a, b], axis=-1), (0, 2, 1)).reshape(m, 2 * n)


def _vcat(a, b):
    """[m, n] and [m, n] -> [2m, n]."""
    m, n = a.shape
    return jnp.transpose(jnp.stack([a, b], axis=-1), (2, 0, 1)).reshape(2 * m, n)


def _assemble(blocks, nb):
    """{(i, j): [16, 16], j <= i} -> the lower block-triangular [16 nb, 16 nb] matrix (zeros above)."""
    zero = jnp.zeros_like(blocks[0, 0])
    rows = []
    for i in range(nb):
        parts = [blocks[i, j] if j <= i else zero for j in range(nb)]
        while len(parts) > 1:
            parts = [_hcat(parts[2 * m], parts[2 * m + 1]) for m in range(len(parts) // 2)]
        rows.append(parts[0])
    while len(rows) > 1:
        rows = [_vcat(rows[2 * m], rows[2 * m + 1]) for m in range(len(rows) // 2)]
    return rows[0]


def _prep_kernel(row0_ref, nvalid_ref, q_ref, k_ref, v_ref, a_ref, b_ref, alog_ref, dtb_ref, *refs, ratio, prec,
                 interpret, per_value_head=False, solved=False, pf_only=False, t_prec="tf32x3"):
    """Grid (flat chunk, key head); the `ratio` value heads of the key head in one program (per_value_head: grid
    (flat chunk, value head), one head per program, K K^T and Q K^T recomputed per value head). Per value head:
    T from 16x16 blocks (fp32 forward substitution of the diagonal blocks, all heads' chains in one row loop;
    exact merges), assembled into one [64, 64] tile; then W = T X_w, U = T (beta V) and P = Q^ K^T * Gamma as
    full-tile products, stored whole: W [64, dk], U [64, dv], P [64, 64], f [3, 64] = (fq, fk, e^gamma_C).
    solved: T comes in (refs[0], [chunks, Hv, 64, 64] from `_solve_kernel`, prep_mode "solve") instead.
    pf_only (the T-form): only P and f, with f's rows 3, 4 = beta e^gamma |k|^-1 and beta (refs = (p, f)); or
    T, P and f (refs = (t, p, f), prep_mode "fused": T by `_doubling_inverse` on the whole tile, from the k tile
    and the gates this kernel has anyway, its products in t_prec: no solve kernel)."""
    t_out_ref = None
    if pf_only:                  # tform: P and f only (the scan applies T itself)
        (t_out_ref, p_ref, f_ref), t_in_ref = (refs if len(refs) == 3 else (None, *refs)), None
    else:
        t_in_ref, (w_ref, u_ref, p_ref, f_ref) = (refs[0], refs[1:]) if solved else (None, refs)
    c, pid1 = pl.program_id(0), pl.program_id(1)
    kh = pid1 // ratio if per_value_head else pid1
    nvalid = nvalid_ref[c]

    @pl.when(nvalid > 0)
    def _():
        row0 = row0_ref[c]
        dk = k_ref.shape[-1]
        scale = dk ** -0.5
        mm = functools.partial(_mm, interpret=interpret)
        rows = jnp.arange(CHUNK, dtype=jnp.int32)
        incl = rows[:, None] >= rows[None, :]
        valid64 = rows < nvalid
        nb = CHUNK // SUB
        raw = "bf16" if k_ref.dtype == jnp.bfloat16 else prec  # raw bf16 products are exact on tensor cores
        # Ordered for register pressure (the whole-tile values die before the next phase starts; ptxas spilled
        # 528 B per thread when they all lived at once): P and f per head from the full q, k tiles; then the
        # 16-row blocks and the solve; then W and U from a fresh load of the k tile.
        full = jnp.broadcast_to(valid64[:, None], (CHUNK, dk))
        kt = _load(k_ref.at[pl.ds(row0, CHUNK), kh, :], full)
        qt = _load(q_ref.at[pl.ds(row0, CHUNK), kh, :], full)
        rk = jax.lax.rsqrt(jnp.sum(jnp.square(kt.astype(jnp.float32)), axis=1) + 1e-6)
        rq = jax.lax.rsqrt(jnp.sum(jnp.square(qt.astype(jnp.float32)), axis=1) + 1e-6) * scale
        qk = mm(qt, kt, (1, 1), raw) * (rq[:, None] * rk[None, :])
        # fused: K^ K^T here too, so that the q and k tiles die now (exact bf16 products for bf16 inputs)
        kk = None if t_out_ref is None else mm(kt, kt, (1, 1), raw) * (rk[:, None] * rk[None, :])
        heads = [pid1] if per_value_head else [kh * ratio + r for r in range(ratio)]
        gates = []
        for hv in heads:
            a_log, dt_bias = alog_ref[hv], dtb_ref[hv]
            g, beta = _gates(_load(a_ref.at[pl.ds(row0, CHUNK), hv], valid64),
                             _load(b_ref.at[pl.ds(row0, CHUNK), hv], valid64), a_log, dt_bias)
            gam, beta = jnp.cumsum(jnp.where(valid64, g, 0.0)), jnp.where(valid64, beta, 0.0)
            g_last = jnp.min(gam)                            # gamma at the last valid row (non-increasing)
            gates.append((gam, beta))
            _store_t(p_ref, (c, hv), (slice(None), slice(None)),
                     jnp.where(incl, qk * jnp.exp(jnp.where(incl, gam[:, None] - gam[None, :], 0.0)), 0.0))
            f_ref[c, hv, 0, :] = jnp.exp(gam) * rq
            f_ref[c, hv, 1, :] = jnp.where(valid64, jnp.exp(g_last - gam) * rk, 0.0)
            f_ref[c, hv, 2, :] = jnp.broadcast_to(jnp.exp(g_last), (CHUNK,))
            if pf_only:
                f_ref[c, hv, 3, :] = beta * jnp.exp(gam) * rk
                f_ref[c, hv, 4, :] = beta
        if t_out_ref is not None:                            # fused: T per head from K^ K^T
            strict = rows[:, None] > rows[None, :]
            tmm = functools.partial(mm, contract=(1, 0), prec=t_prec)
            for hv, (gam, beta) in zip(heads, gates):
                a = jnp.where(strict, beta[:, None] * kk * jnp.exp(jnp.where(strict, gam[:, None] - gam[None, :],
                                                                                  0.0)), 0.0)
                _store_t(t_out_ref, (c, hv), (slice(None), slice(None)), _doubling_inverse(a, tmm))
        if pf_only:
            return

        if solved:
            ts = [t_in_ref[c, hv, :, :] for hv in heads]
        else:
            _, _, valid, kk = _k_blocks(k_ref, row0, kh, nvalid, raw, mm)
            blocks = [_a_blocks(kk, *_chunk_gates(a_ref, b_ref, row0, hv, valid, alog_ref[hv], dtb_ref[hv])[:2])
                      for hv in heads]
            diag = _inv_unit_lower([blk[i, i] for blk in blocks for i in range(nb)])   # every head's chains at once
            ts = [_assemble(_merge_inverse(blk, diag[h * nb:(h + 1) * nb], interpret), nb)   # [64, 64] fp32
                  for h, blk in enumerate(blocks)]
        for h, hv in enumerate(heads):
            t = ts[h]
            gam, beta = gates[h]
            wk = (beta * jnp.exp(gam) * rk)[:, None]
            for ref, src, hd, coef in ((w_ref, k_ref, kh, wk), (u_ref, v_ref, hv, beta[:, None])):
                half = src.shape[-1] // 2                    # two column halves: half the live accumulator
                for cols in (pl.ds(0, half), pl.ds(half, half)):
                    x = _load(src.at[pl.ds(row0, CHUNK), hd, cols], jnp.broadcast_to(valid64[:, None], (CHUNK, half)))
                    ref[c, hv, :, cols] = mm(t, coef * x.astype(jnp.float32), (1, 0), prec).astype(ref.dtype)


def _prep_blocks_kernel(row0_ref, nvalid_ref, q_ref, k_ref, v_ref, a_ref, b_ref, alog_ref, dtb_ref,
                        w_ref, u_ref, p_ref, f_ref, *, ratio, prec, interpret):
    """prep_mode="blocks": the same outputs as _prep_kernel computed and stored in 16-row blocks only (no [64, 64]
    assembly; 16x16 tensor-core products throughout). A fallback should the tile assembly not compile."""
    c, kh = pl.program_id(0), pl.program_id(1)
    nvalid = nvalid_ref[c]

    @pl.when(nvalid > 0)
    def _():
        row0 = row0_ref[c]
        dk, dv = k_ref.shape[-1], v_ref.shape[-1]
        scale = dk ** -0.5
        mm = functools.partial(_mm, interpret=interpret)
        idx = jnp.arange(SUB, dtype=jnp.int32)
        incl = idx[:, None] >= idx[None, :]
        nb = CHUNK // SUB
        raw = "bf16" if k_ref.dtype == jnp.bfloat16 else prec  # raw bf16 products are exact on tensor cores
        ks, rks, valid, kk = _k_blocks(k_ref, row0, kh, nvalid, raw, mm)

        def per_head(r, carry):                              # the value heads sharing this key head
            hv = kh * ratio + r
            gam, betas, g_last = _chunk_gates(a_ref, b_ref, row0, hv, valid, alog_ref[hv], dtb_ref[hv])
            inv = _unit_lower_inverse(kk, gam, betas, interpret)
            xw = [(betas[j] * jnp.exp(gam[j]) * rks[j])[:, None] * ks[j].astype(jnp.float32) for j in range(nb)]
            for i in range(nb):
                rows_i = pl.ds(i * SUB, SUB)
                w_i = mm(inv[i, 0], xw[0], (1, 0), prec)
                for j in range(1, i + 1):
                    w_i = w_i + mm(inv[i, j], xw[j], (1, 0), prec)
                w_ref[c, hv, rows_i, :] = w_i.astype(w_ref.dtype)
            xu = []
            for j in range(nb):
                vj = _load(v_ref.at[pl.ds(row0 + j * SUB, SUB), hv, :], jnp.broadcast_to(valid[j][:, None], (SUB, dv)))
                xu.append(betas[j][:, None] * vj.astype(jnp.float32))
            for i in range(nb):
                rows_i = pl.ds(i * SUB, SUB)
                u_i = mm(inv[i, 0], xu[0], (1, 0), prec)
                for j in range(1, i + 1):
                    u_i = u_i + mm(inv[i, j], xu[j], (1, 0), prec)
                u_ref[c, hv, rows_i, :] = u_i
            # P = Q^ K^T * Gamma: q loaded and Q K^T formed here (per value head) so they are not live above
            qs, rqs = [], []
            for i in range(nb):
                qx = _load(q_ref.at[pl.ds(row0 + i * SUB, SUB), kh, :], jnp.broadcast_to(valid[i][:, None], (SUB, dk)))
                qf = qx.astype(jnp.float32)
                qs.append(qx)
                rqs.append(jax.lax.rsqrt(jnp.sum(qf * qf, axis=1) + 1e-6) * scale)
            zero = jnp.zeros((SUB, SUB), jnp.float32)
            for i in range(nb):
                rows_i = pl.ds(i * SUB, SUB)
                qk = {j: mm(qs[i], ks[j], (1, 1), raw) * (rqs[i][:, None] * rks[j][None, :]) for j in range(i + 1)}
                for j in range(nb):
                    if j < i:
                        blk = qk[j] * jnp.exp(gam[i][:, None] - gam[j][None, :])
                    elif j == i:                             # causal incl. the diagonal; mask before exp
                        blk = jnp.where(incl, qk[i] * jnp.exp(jnp.where(incl, gam[i][:, None] - gam[i][None, :],
                                                                           0.0)), 0.0)
                    else:
                        blk = zero
                    p_ref[c, hv, rows_i, pl.ds(j * SUB, SUB)] = blk
                f_ref[c, hv, 0, rows_i] = jnp.exp(gam[i]) * rqs[i]
                f_ref[c, hv, 1, rows_i] = jnp.where(valid[i], jnp.exp(g_last - gam[i]) * rks[i], 0.0)
                f_ref[c, hv, 2, rows_i] = jnp.broadcast_to(jnp.exp(g_last), (SUB,))
            return carry

        jax.lax.fori_loop(0, ratio, per_head, 0)


def _wy_scan_kernel(start_ref, len_ref, span_ref, slot_ref, use_ref, coff_ref, q_ref, k_ref, w_ref, u_ref, p_ref,
                    f_ref, pool_ref, o_ref, pool_out_ref, *, ratio, bv, precs, prefetch, overlap, interpret,
                    tform=False, t_prec="tf32"):
    """Grid (sequence, value head, V-block): the fp32 state H^T [dk, BV] stays on chip across the chunks."""
    h_prec, o_prec, s_prec = precs
    n, hv, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kh = hv // ratio
    start, length, span = start_ref[n], len_ref[n], span_ref[n]
    slot, coff = slot_ref[n], coff_ref[n]
    dk = q_ref.shape[-1]
    last_chunk = w_ref.shape[0] - 1
    mm = functools.partial(_mm, interpret=interpret)
    vcols = pl.ds(vb * bv, bv)
    rows = jnp.arange(CHUNK, dtype=jnp.int32)

    h = pool_ref[slot, hv, vcols, :]                         # [BV, dk], V-first as the pool
    h = jnp.where(use_ref[n] != 0, h, 0.0).T                 # -> [dk, BV]: every product below is a plain one
    nch = (length + CHUNK - 1) // CHUNK

    def fetch(c):
        """Chunk c's tiles; only the state-independent inputs (prefetchable). tform: (w, u) slots hold (T, V)."""
        row0 = start + c * CHUNK
        valid = (rows < length - c * CHUNK)[:, None]
        vk = jnp.broadcast_to(valid, (CHUNK, dk))
        cc = jnp.minimum(coff + c, last_chunk)               # in bounds even for an empty sequence's fetch
        qk = (_load(q_ref.at[pl.ds(row0, CHUNK), kh, :], vk), _load(k_ref.at[pl.ds(row0, CHUNK), kh, :], vk))
        if tform:
            vmask = jnp.broadcast_to(valid, (CHUNK, bv))
            wu = (w_ref[cc, hv, :, :], _load(u_ref.at[pl.ds(row0, CHUNK), hv, vcols], vmask))
        else:
            wu = (w_ref[cc, hv, :, :], u_ref[cc, hv, :, vcols])
        rest = (p_ref[cc, hv, :, :], f_ref[cc, hv, 0, :], f_ref[cc, hv, 1, :], f_ref[cc, hv, 2, :])
        return qk + wu + rest

    def step(c, h, tiles):
        qr, kr, w, u, p, fq, fk, fd = tiles[:8]
        if tform:                                            # Vnew = T (beta V - beta e^gamma |k|^-1 K H)
            fw, beta = tiles[8:]
            z, y = mm(kr, h, (1, 0), h_prec), mm(qr, h, (1, 0), h_prec)
            vnew = mm(w, beta[:, None] * u.astype(jnp.float32) - fw[:, None] * z, (1, 0), t_prec)    # w holds T
            pv = mm(p, vnew, (1, 0), o_prec)
            upd = mm(kr, vnew * fk[:, None], (0, 0), s_prec)
            h_new, o = fd * h + upd, fq[:, None] * y + pv
        elif overlap:                                        # both products of H issued before either is used
            x, y = mm(w, h, (1, 0), h_prec), mm(qr, h, (1, 0), h_prec)
            vnew = u - x
            pv = mm(p, vnew, (1, 0), o_prec)                 # issued before the update's (two-dot) sum
            upd = mm(kr, vnew * fk[:, None], (0, 0), s_prec)
            h_new, o = fd * h + upd, fq[:, None] * y + pv
        else:
            vnew = u - mm(w, h, (1, 0), h_prec)              # [C, BV] the true per-token deltas
            wgt = vnew * fk[:, None]                         # decay to the chunk end and |k|^-1, on Vnew's rows
            h_new = jnp.max(fd) * h + mm(kr, wgt, (0, 0), s_prec)
            o = fq[:, None] * mm(qr, h, (1, 0), h_prec) + mm(p, vnew, (1, 0), o_prec)
        ostore = jnp.broadcast_to((rows < span - c * CHUNK)[:, None], (CHUNK, bv))
        pltriton.store(o_ref.at[pl.ds(start + c * CHUNK, CHUNK), hv, vcols], o.astype(o_ref.dtype), mask=ostore)
        return h_new

    if overlap or tform:
        def factors(c):                                      # the row factors and the chunk's decay, a scalar
            cc = jnp.minimum(coff + jnp.minimum(c, nch - 1), last_chunk)
            extra = (f_ref[cc, hv, 3, :], f_ref[cc, hv, 4, :]) if tform else ()
            return (f_ref[cc, hv, 0, :], f_ref[cc, hv, 1, :], f_ref[cc, hv, 2, 0]) + extra

        def body(c, carry):                                  # they are loaded a chunk ahead (plain loads: the
            h, fs = carry                                    # pipeliner leaves them synchronous)
            nxt = factors(c + 1)
            tiles = fetch(c)                                 # (q, k, w, u, p, f rows...)
            return step(c, h, tiles[:5] + fs), nxt
        h, _ = jax.lax.fori_loop(0, nch, body, (h, factors(0)))
    elif prefetch:
        def body(c, carry):
            h, tiles = carry
            nxt = fetch(jnp.minimum(c + 1, nch - 1))        # issued before this chunk's products: overlaps them
            return step(c, h, tiles), nxt
        h, _ = jax.lax.fori_loop(0, nch, body, (h, fetch(0)))
    else:
        h = jax.lax.fori_loop(0, nch, lambda c, h: step(c, h, fetch(c)), h)

    def zero_chunk(c, carry):                                # rows [len, span): padding of a padded batch
        m = jnp.broadcast_to((rows < span - c * CHUNK)[:, None], (CHUNK, bv))
        pltriton.store(o_ref.at[pl.ds(start + c * CHUNK, CHUNK), hv, vcols], jnp.zeros((CHUNK, bv), o_ref.dtype),
                       mask=m)
        return carry

    jax.lax.fori_loop(nch, (span + CHUNK - 1) // CHUNK, zero_chunk, 0)
    pool_out_ref[slot, hv, vcols, :] = h.T               # same buffer as pool_ref (aliased): in place


# ----------------------------------------------------------------------------------------------------------------
# Wrappers.


def _check_dims(dk, dv, hk, hv):
    for name, d in (("dk", dk), ("dv", dv)):
        if d < 16 or d & (d - 1):
            raise ValueError(f"GDN Pallas kernels need {name} a power of two >= 16, got {d}")
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk})")


def pick_bv(n_seq, hv, dv, cores=132):
    """Largest V-block that still gives about two programs per SM; at least 32 (or dv)."""
    bv = dv
    while bv > 32 and n_seq * hv * (dv // bv) < 2 * cores:
        bv //= 2
    return min(bv, dv)


def pick_stages(programs, cores=132):
    """Scan pipeline depth for num_stages=None: two stages while every program has an SM to itself (one long
    sequence: the deeper pipeline wins), one when there are more programs than SMs (smaller buffers let two
    programs share an SM)."""
    return 2 if programs <= cores else 1


def pick_bv_wy(n_seq, hv, dv, cores=132):
    """WY scan: the largest V-block in 16..64 that still gives two programs per SM."""
    bv = min(64, dv)
    while bv > 16 and n_seq * hv * (dv // bv) < 2 * cores:
        bv //= 2
    return bv


def _chunk_tiles(chunks, hv, split):
    """The [chunks, Hv, 64, 64] fp32 T or P output (split 0), or its bf16 parts [chunks, Hv, split, 64, 64]: hi and
    lo (split 2) or hi alone (split 1)."""
    if split not in (0, 1, 2):
        raise ValueError(f"split is 0 (fp32), 1 (bf16 hi) or 2 (bf16 hi + lo), got {split!r}")
    return jax.ShapeDtypeStruct((chunks, hv) + ((split,) if split else ()) + (CHUNK, CHUNK),
                                jnp.bfloat16 if split else jnp.float32)


def wy_solve(k, a, b, A_log, dt_bias, row0, nvalid, *, prec, num_warps=2, inv_prec="tf32x3", per_value_head=False,
             split=0, interpret=False):
    """T = (I + A)^-1 [chunks, Hv, 64, 64] fp32 for every flat chunk by `_solve_kernel` (grid (chunk, key head),
    the key head's value heads in a loop, or per_value_head: grid (chunk, value head), K K^T computed per value
    head; few warps: its 16x16 row loops and reductions stay within one or two). split: T as bf16 hi and lo parts,
    [chunks, Hv, 2, 64, 64], or 1: hi alone (the Mosaic GPU scan's operands; _chunk_tiles)."""
    hk, hv, f32 = k.shape[1], a.shape[1], jnp.float32
    return pl.pallas_call(
        functools.partial(_solve_kernel, ratio=hv // hk, prec=prec, interpret=interpret, inv_prec=inv_prec,
                          per_value_head=per_value_head),
        out_shape=_chunk_tiles(row0.shape[0], hv, split),
        grid=(row0.shape[0], hv if per_value_head else hk),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="gdn_solve",
    )(row0, nvalid, k, a, b, A_log.astype(f32), dt_bias.astype(f32))


def wy_prep(q, k, v, a, b, A_log, dt_bias, row0, nvalid, *, w_dtype, prec, num_warps=4, mode="tile",
            solve_warps=2, solve_prec="tf32x3", solve_per_value_head=False, t=None, pf_only=False, split=0,
            t_split=None, with_t=False, interpret=False):
    """The WY prep kernel on every flat chunk: W [chunks, Hv, 64, dk] (w_dtype), U [chunks, Hv, 64, dv] fp32,
    P [chunks, Hv, 64, 64] fp32, f [chunks, Hv, 3, 64] fp32 (module docstring). Unused chunk ids stay unwritten.
    mode "solve" / "solve2": T first, by `wy_solve` (solve_warps, solve_prec, solve_per_value_head: its grid) unless
    given as t, then
    the "tile" kernel from T (per value head / per key head).
    pf_only (the T-form scan, WYConfig.tform): P and f [chunks, Hv, 5, 64] only, f's rows 3 and 4 = beta e^gamma
    |k|^-1 and beta; no T, W or U (grid (chunk, value head); (chunk, key head) for mode "solve2"); split: P as
    bf16 parts as wy_solve's T. with_t (pf_only): T too, by recursive doubling in the same
    kernel (`_doubling_inverse`, its products in solve_prec), returned first: (T, P, f), T in t_split parts (default
    split)."""
    if pf_only:                 # mode "solve2": one program per key head (q, k loaded and Q K^T computed once)
        hk, hv = k.shape[1], v.shape[1]
        mc, f32 = row0.shape[0], jnp.float32
        per_kh = mode == "solve2"
        return pl.pallas_call(
            functools.partial(_prep_kernel, ratio=hv // hk, prec=prec, interpret=interpret, per_value_head=not per_kh,
                              pf_only=True, t_prec=solve_prec),
            out_shape=((_chunk_tiles(mc, hv, split if t_split is None else t_split),) if with_t else ())
                      + (_chunk_tiles(mc, hv, split),)
                      + (jax.ShapeDtypeStruct((mc, hv, 5, CHUNK), f32),),
            grid=(mc, hk if per_kh else hv),
            compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
            interpret=interpret, name="gdn_wy_prep_tpf" if with_t else "gdn_wy_prep_pf",
        )(row0, nvalid, q, k, v, a, b, A_log.astype(f32), dt_bias.astype(f32))
    hk, dk = k.shape[1:]
    hv, dv = v.shape[1:]
    mc = row0.shape[0]
    f32 = jnp.float32
    extra = ()
    if mode in ("solve", "solve2"):
        extra = (wy_solve(k, a, b, A_log, dt_bias, row0, nvalid, prec=prec, num_warps=solve_warps,
                          inv_prec=solve_prec, per_value_head=solve_per_value_head, interpret=interpret)
                 if t is None else t,)
    kernel = {"tile": functools.partial(_prep_kernel, per_value_head=True), "tile2": _prep_kernel,
              "blocks": _prep_blocks_kernel, "solve": functools.partial(_prep_kernel, per_value_head=True, solved=True),
              "solve2": functools.partial(_prep_kernel, solved=True)}
    return pl.pallas_call(
        functools.partial(kernel[mode], ratio=hv // hk, prec=prec, interpret=interpret),
        out_shape=(jax.ShapeDtypeStruct((mc, hv, CHUNK, dk), w_dtype), jax.ShapeDtypeStruct((mc, hv, CHUNK, dv), f32),
                   jax.ShapeDtypeStruct((mc, hv, CHUNK, CHUNK), f32), jax.ShapeDtypeStruct((mc, hv, 3, CHUNK), f32)),
        grid=(mc, hk if mode in ("tile2", "blocks", "solve2") else hv),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="gdn_wy_prep",
    )(row0, nvalid, q, k, v, a, b, A_log.astype(f32), dt_bias.astype(f32), *extra)


def wy_scan(q, k, w, u, p, f, pool, starts, lens, spans, slots, use_state, chunk_off, *, config: WYConfig,
            precs, interpret=False):
    """The WY scan kernel given the prep outputs (wy_prep). precs = (h_prec, o_prec, s_prec[, t_prec]).
    config.tform: w = T [chunks, Hv, 64, 64] fp32, u = v [total, Hv, dv] (raw), f with 5 rows (wy_prep pf_only);
    t_prec: the precision of T (beta V - ...).
    Returns (o [total, Hv, dv] in q.dtype, pool)."""
    total, hk, dk = k.shape
    hv, dv = u.shape[1], u.shape[-1]
    n = starts.shape[0]
    bv = min(config.bv or pick_bv_wy(n, hv, dv), dv)
    if dv % bv or bv < 16:
        raise ValueError(f"V-block {bv} must divide dv={dv} and be >= 16")
    return pl.pallas_call(
        functools.partial(_wy_scan_kernel, ratio=hv // hk, bv=bv, precs=tuple(precs[:3]), prefetch=config.prefetch,
                          overlap=config.overlap, interpret=interpret, tform=config.tform,
                          t_prec=precs[3] if len(precs) > 3 else "tf32"),
        out_shape=(jax.ShapeDtypeStruct((total, hv, dv), q.dtype), jax.ShapeDtypeStruct(pool.shape, pool.dtype)),
        grid=(n, hv, dv // bv),
        input_output_aliases={12: 1},
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps,
                                                num_stages=config.num_stages or pick_stages(n * hv * (dv // bv))),
        interpret=interpret, name="gdn_wy_scan",
    )(starts, lens, spans, slots, use_state, chunk_off, q, k, w, u, p, f, pool)


def _prefill_wy(q, k, v, a, b, A_log, dt_bias, pool, starts, lens, slots, use_state, spans, max_chunks,
                config: WYConfig, interpret):
    config = resolve_prep(config, max_chunks, v.shape[1], v.dtype)
    t_split, split = (config.t_parts, config.p_parts) if config.mgpu else (0, 0)
    h_prec, o_prec, s_prec, prep_prec = config.precisions(v.dtype)
    chunk_off, row0, nvalid = chunk_map(starts, lens, max_chunks)
    w_dtype = jnp.bfloat16 if h_prec == "bf16" else jnp.float32
    if config.tform:
        if config.prep_mode not in ("solve", "solve2", "fused", "fused2"):
            raise ValueError("tform needs prep_mode 'solve', 'solve2' (T from wy_solve), 'fused' or 'fused2'")
        if config.prep_mode in ("fused", "fused2"):
            t, p, f = wy_prep(q, k, v, a, b, A_log, dt_bias, row0, nvalid, w_dtype=w_dtype, prec=prep_prec,
                              num_warps=config.prep_warps, solve_prec=config.solve_prec, pf_only=True,
                              mode="solve2" if config.prep_mode == "fused2" else "solve", split=split,
                              t_split=t_split, with_t=True, interpret=interpret)
        else:
            t = wy_solve(k, a, b, A_log, dt_bias, row0, nvalid, prec=prep_prec, num_warps=config.solve_warps,
                         inv_prec=config.solve_prec, per_value_head=config.solve_grid == "value", split=t_split,
                         interpret=interpret)
            p, f = wy_prep(q, k, v, a, b, A_log, dt_bias, row0, nvalid, w_dtype=w_dtype, prec=prep_prec,
                           num_warps=config.pf_warps or config.prep_warps, mode=config.prep_mode, pf_only=True,
                           split=split, interpret=interpret)
        if config.mgpu:
            bv = None if config.mgpu == "auto" or config.bv not in (16, 32, 64) else config.bv
            return gdn_mgpu.scan(q, k, v, t, p, f, pool, starts, lens, spans, slots, use_state, chunk_off,
                                 bv=bv, buffers=config.num_stages or 2, out=config.mgpu_out, wgs=config.mgpu_wgs,
                                 lookahead=config.mgpu_lookahead, defer_o=config.mgpu_defer_o,
                                 v_parts=config.v_parts, row0=row0,
                                 nvalid=nvalid, interpret=interpret)
        return wy_scan(q, k, t, v, p, f, pool, starts, lens, spans, slots, use_state, chunk_off, config=config,
                       precs=(h_prec, o_prec, s_prec, prep_prec), interpret=interpret)
    if config.prep_mode in ("fused", "fused2"):
        raise ValueError(f"prep_mode {config.prep_mode!r} writes T, P and f for the T-form scan: it needs tform=True")
    w, u, p, f = wy_prep(q, k, v, a, b, A_log, dt_bias, row0, nvalid, w_dtype=w_dtype, prec=prep_prec,
                         num_warps=config.prep_warps, mode=config.prep_mode, solve_warps=config.solve_warps,
                         solve_prec=config.solve_prec, solve_per_value_head=config.solve_grid == "value",
                         interpret=interpret)
    return wy_scan(q, k, w, u, p, f, pool, starts, lens, spans, slots, use_state, chunk_off, config=config,
                   precs=(h_prec, o_prec, s_prec), interpret=interpret)


def chunk_map(starts, lens, max_chunks):
    """Flat chunk ids of packed sequences. Returns (chunk_off [N]: each sequence's first flat chunk,
    row0 [max_chunks]: a chunk's first row, nvalid [max_chunks]: its valid rows, 0 for unused ids)."""
    n = starts.shape[0]
    nch = (lens + CHUNK - 1) // CHUNK
    cum = jnp.cumsum(nch)
    chunk_off = (cum - nch).astype(jnp.int32)
    cid = jnp.arange(max_chunks, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(cum, cid, side="right"), n - 1).astype(jnp.int32)
    local = cid - chunk_off[seq]
    row0 = (starts[seq] + local * CHUNK).astype(jnp.int32)
    nvalid = jnp.where(cid < cum[-1], jnp.clip(lens[seq] - local * CHUNK, 0, CHUNK), 0).astype(jnp.int32)
    return chunk_off, row0, nvalid


def solve_t(k, a, b, A_log, dt_bias, starts, lens, max_chunks, ratio, prec, config: PrefillConfig, interpret):
    """Kernel 1 of the v1 prefill: T = (I + A)^-1 for every chunk of every sequence, [max_chunks, Hv, 64, 64] fp32.
    Returns (chunk_off [N]: the first flat chunk of each sequence, T)."""
    hk, hv = k.shape[1], a.shape[1]
    chunk_off, row0, nvalid = chunk_map(starts, lens, max_chunks)
    tmat = pl.pallas_call(
        functools.partial(_solve_kernel, ratio=ratio, prec=prec, interpret=interpret),
        out_shape=jax.ShapeDtypeStruct((max_chunks, hv, CHUNK, CHUNK), jnp.float32),
        grid=(max_chunks, hk),
        compiler_params=pltriton.CompilerParams(num_warps=config.solve_warps, num_stages=config.solve_stages),
        interpret=interpret, name="gdn_solve",
    )(row0, nvalid, k, a, b, A_log.astype(jnp.float32), dt_bias.astype(jnp.float32))
    return chunk_off, tmat


def gdn_prefill_packed(q, k, v, a, b, A_log, dt_bias, pool, starts, lens, slots, use_state, *, spans=None,
                       max_chunks=None, config: WYConfig | PrefillConfig | None = None, starts_aligned=False,
                       interpret=False):
    """Packed prefill. q,k [total, Hk, dk]; v [total, Hv, dv]; a,b [total, Hv] raw; pool [slots, Hv, dv, dk] fp32.
    Sequence n is rows [starts[n], starts[n] + lens[n]) (disjoint ranges); it starts from pool[slots[n]] (zeros
    where use_state[n] is False) and its final state is written back there. Output rows [starts + lens,
    starts + spans) are zeroed (spans default to lens); rows outside every sequence are left unwritten.
    max_chunks: static bound on sum(ceil(lens / 64)) (default ceil(total / 64) + N).
    config: WYConfig (the WY pipeline; None = DEFAULT_PREFILL) or PrefillConfig (the previous kernels).
    starts_aligned: the caller promises every start is a multiple of 8 (the Mosaic GPU scan, config.mgpu, needs
    it: its TMA copies into swizzled tiles take row offsets in whole 8-row tiles).
    Returns (o [total, Hv, dv] in v.dtype, pool)."""
    total, hk, dk = k.shape
    hv, dv = v.shape[-2:]
    _check_dims(dk, dv, hk, hv)
    if pool.dtype != jnp.float32:
        raise ValueError(f"the GDN state pool must be float32, got {pool.dtype}")
    n = starts.shape[0]
    config = DEFAULT_PREFILL if config is None else config
    i32 = lambda x: jnp.asarray(x).astype(jnp.int32)
    if isinstance(config, WYConfig):
        if config.mgpu not in ("", "on", "auto"):
            raise ValueError(f"WYConfig.mgpu must be '', 'on' or 'auto', got {config.mgpu!r}")
        if any(x not in (1, 2) for x in (config.t_parts, config.p_parts, config.v_parts)):
            raise ValueError(f"WYConfig.t_parts, p_parts and v_parts are 1 or 2, got {config.t_parts}, "
                             f"{config.p_parts}, {config.v_parts}")
        if config.mgpu == "auto" and not gdn_mgpu.applies(total, dk, dv, starts_aligned, v.dtype):
            config = dataclasses.replace(config, mgpu="")
        if config.mgpu and not starts_aligned:
            raise ValueError("the Mosaic GPU scan (WYConfig.mgpu) needs sequence starts that are multiples of 8: "
                             "pass starts_aligned=True where they are")
        return _prefill_wy(q, k, v, a, b, A_log, dt_bias, pool, i32(starts), i32(lens), i32(slots), i32(use_state),
                           i32(lens) if spans is None else i32(spans), max_chunks or (-(-total // CHUNK) + n),
                           config, interpret)
    if not isinstance(config, PrefillConfig):
        raise TypeError(f"config must be a WYConfig or a PrefillConfig, got {type(config).__name__}")
    ratio = hv // hk
    bv = config.bv or pick_bv(n, hv, dv)
    auto = "tf32x3" if v.dtype == jnp.float32 else "tf32"
    prec, solve_prec = config.prec or auto, config.solve_prec or auto
    if dv % bv or bv < 16:
        raise ValueError(f"V-block {bv} must divide dv={dv} and be >= 16")
    i32 = lambda x: jnp.asarray(x).astype(jnp.int32)
    starts, lens, slots = i32(starts), i32(lens), i32(slots)
    spans = lens if spans is None else i32(spans)
    use_state = i32(use_state)
    max_chunks = max_chunks or (-(-total // CHUNK) + n)

    chunk_off, tmat = solve_t(k, a, b, A_log, dt_bias, starts, lens, max_chunks, ratio, solve_prec, config, interpret)
    a_log, dtb = A_log.astype(jnp.float32), dt_bias.astype(jnp.float32)
    o, pool = pl.pallas_call(
        functools.partial(_scan_kernel, ratio=ratio, bv=bv, prec=prec, interpret=interpret),
        out_shape=(jax.ShapeDtypeStruct((total, hv, dv), v.dtype), jax.ShapeDtypeStruct(pool.shape, pool.dtype)),
        grid=(n, hv, dv // bv),
        input_output_aliases={14: 1},
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret, name="gdn_scan",
    )(starts, lens, spans, slots, use_state, chunk_off, q, k, v, a, b, a_log, dtb, tmat, pool)
    return o, pool


def gdn_prefill(q, k, v, a, b, A_log, dt_bias, pool, slots, lens, use_state, *,
                config: WYConfig | PrefillConfig | None = None, interpret=False):
    """The model's padded-batch contract (gdn_reference.gdn_prefill): row n holds lens[n] real tokens of T."""
    n, t = q.shape[:2]
    flat = lambda x: x.reshape(n * t, *x.shape[2:])
    starts = jnp.arange(n, dtype=jnp.int32) * t
    o, pool = gdn_prefill_packed(flat(q), flat(k), flat(v), flat(a), flat(b), A_log, dt_bias, pool, starts, lens,
                                 slots, use_state, spans=jnp.full((n,), t, jnp.int32),
                                 max_chunks=n * (-(-t // CHUNK)), config=config, starts_aligned=t % 8 == 0,
                                 interpret=interpret)
    return o.reshape(n, t, *o.shape[1:]), pool


# ----------------------------------------------------------------------------------------------------------------
# Decode: one token per row, the state updated in place in the pool.


def _decode_kernel(slot_ref, q_ref, k_ref, v_ref, a_ref, b_ref, alog_ref, dtb_ref, pool_ref, o_ref, pool_out_ref,
                   *, ratio, bv, group, vblocks, vfirst, cols):
    """Grid (row, value head, V-block group of `vblocks`), or with group=True (row, key head, V-block group) doing
    its `ratio` value heads; vfirst reverses the grid's axes. q/k/v/a/b are [N, columns] refs: head h of q starts at
    column cols[0] + h * dk (k, v, a, b likewise at cols[1..4]), so they may all be views of one packed array."""
    n, h, vb = (pl.program_id(2), pl.program_id(1), pl.program_id(0)) if vfirst else \
        (pl.program_id(0), pl.program_id(1), pl.program_id(2))
    kh = h if group else h // ratio
    slot = slot_ref[n]
    dk = pool_ref.shape[-1]
    q0, k0, v0, a0, b0 = cols
    q = _l2norm(q_ref[n, pl.ds(q0 + kh * dk, dk)].astype(jnp.float32)) * (dk ** -0.5)
    k = _l2norm(k_ref[n, pl.ds(k0 + kh * dk, dk)].astype(jnp.float32))
    qk = jnp.sum(q * k)
    for hv in ([kh * ratio + r for r in range(ratio)] if group else [h]):
        g, beta = _gates(a_ref[n, a0 + hv], b_ref[n, b0 + hv], alog_ref[hv], dtb_ref[hv])
        alpha = jnp.exp(g)

        vcols = lambda j: pl.ds((vb * vblocks + j) * bv, bv)

        def block(j, s, hv=hv, beta=beta, alpha=alpha):
            """V-block j given its state s [BV, dk] (fp32, contiguous dk); returns block j + 1's state, whose
            load is issued before this block's math and store (the loop's software pipelining)."""
            nxt = pool_ref[slot, hv, vcols(jnp.minimum(j + 1, vblocks - 1)), :] if vblocks > 1 else s
            v = v_ref[n, pl.ds(v0 + hv * pool_ref.shape[2] + (vb * vblocks + j) * bv, bv)].astype(jnp.float32)
            r_k = jnp.sum(s * k[None, :], axis=1)
            r_q = jnp.sum(s * q[None, :], axis=1)
            u = beta * (v - alpha * r_k)
            o = alpha * r_q + qk * u
            pool_out_ref[slot, hv, vcols(j), :] = alpha * s + u[:, None] * k[None, :]     # aliased: in place
            o_ref[n, hv, vcols(j)] = o.astype(o_ref.dtype)
            return nxt

        first = pool_ref[slot, hv, vcols(0), :]
        if vblocks == 1:
            block(0, first)
        else:
            jax.lax.fori_loop(0, vblocks, block, first)


def _decode_call(q, k, v, a, b, A_log, dt_bias, pool, slots, cols, hk, config, interpret):
    """The decode kernel on [N, columns] operands (see _decode_kernel's cols); returns (o [N, Hv, dv], pool)."""
    config = DEFAULT_DECODE if config is None else config
    n = q.shape[0]
    hv, dv, dk = pool.shape[1:]
    _check_dims(dk, dv, hk, hv)
    if pool.dtype != jnp.float32:
        raise ValueError(f"the GDN state pool must be float32, got {pool.dtype}")
    bv = min(config.bv, dv)
    if dv % bv or bv & (bv - 1):
        raise ValueError(f"decode V-block {bv} must be a power of two dividing dv={dv}")
    vblocks = min(config.vblocks, dv // bv)
    if (dv // bv) % vblocks:
        raise ValueError(f"{vblocks} V-blocks per program must divide the {dv // bv} V-blocks of {bv}")
    grid = (n, hk if config.group else hv, dv // bv // vblocks)
    o, pool = pl.pallas_call(
        functools.partial(_decode_kernel, ratio=hv // hk, bv=bv, group=config.group, vblocks=vblocks,
                          vfirst=config.vfirst, cols=cols),
        out_shape=(jax.ShapeDtypeStruct((n, hv, dv), v.dtype), jax.ShapeDtypeStruct(pool.shape, pool.dtype)),
        grid=grid[::-1] if config.vfirst else grid,
        input_output_aliases={8: 1},
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret, name="gdn_decode",
    )(jnp.asarray(slots).astype(jnp.int32), q, k, v, a, b, A_log.astype(jnp.float32), dt_bias.astype(jnp.float32),
      pool)
    return o, pool


def gdn_decode(q, k, v, a, b, A_log, dt_bias, pool, slots, *, config: DecodeConfig | None = None,
               interpret=False):
    """One token per row (q,k [N,Hk,dk], v [N,Hv,dv], a,b [N,Hv]); padded rows must use the null slot 0.
    config None = DEFAULT_DECODE."""
    n, hk, dk = k.shape
    if v.shape[1:] != pool.shape[1:3] or dk != pool.shape[3]:
        raise ValueError(f"v {v.shape} and k {k.shape} do not match the state pool {pool.shape}")
    flat = lambda x: x.reshape(n, -1)
    return _decode_call(flat(q), flat(k), flat(v), a, b, A_log, dt_bias, pool, slots, (0, 0, 0, 0, 0), hk, config,
                        interpret)


def gdn_decode_packed(qkv, proj, A_log, dt_bias, pool, slots, *, config: DecodeConfig | None = None,
                      interpret=False):
    """gdn_decode reading the layer's packed activations in place, so no slice of them is materialised first:
    qkv [N, 2*Hk*dk + Hv*dv] = [q | k | v] (the conv output) and proj [N, P] (the input projection) ending in
    [b | a], Hv columns each. Shapes come from the pool [S, Hv, dv, dk]."""
    hv, dv, dk = pool.shape[1:]
    hk, rem = divmod(qkv.shape[1] - hv * dv, 2 * dk)
    gate_col = proj.shape[1] - 2 * hv
    if rem or hk < 1 or gate_col < 0:
        raise ValueError(f"qkv {qkv.shape} / proj {proj.shape} do not match the state pool {pool.shape}")
    return _decode_call(qkv, qkv, qkv, proj, proj, A_log, dt_bias, pool, slots,
                        (0, hk * dk, 2 * hk * dk, gate_col + hv, gate_col), hk, config, interpret)
