"""Which implementation of the GDN / conv / decode-attention operations the model runs (`kernel_backend`).

"reference": the pure-jnp references (any platform); "pallas": the Pallas kernels, compiled (GPU only);
"pallas_interpret": the same kernels in Pallas interpret mode (any platform; slow, for tests).

Pallas kernel variants (pallas_kernels/gdn.py): the GDN prefill runs the WY pipeline (`gdn.DEFAULT_PREFILL`: parallel
Triton kernels for T and P (one fused kernel for few chunks, else a T solve and a P prep per key head:
`gdn.resolve_prep`; T and P as bf16 tensor-core operands, T solved in TF32), then the chunk scan as a Mosaic GPU kernel,
pallas_kernels/gdn_mgpu.py (its output by TMA straight into the token rows) wherever its shapes allow, which the model's
always do; `QWEN35_GDN_PREFILL=wy_triton` runs the Triton scan instead) and the decode step `gdn.DEFAULT_DECODE` (8 x
128 state tiles, one warp per program, V-blocks fastest in the grid); both checked and timed on the H200 against the
references and fla (bench/kernels.py, bench/RESULTS.md). `QWEN35_GDN_PREFILL=v1` selects the previous prefill kernels
and `QWEN35_GDN_DECODE=bv32_w2` (or any name in gdn.decode_sweep()) another decode configuration; the choice is logged.
The conv prefill (pallas_kernels/conv1d.py) writes the model's q, k and v as arrays of their own, 32 x 128 tiles on 4
warps by default; `QWEN35_CONV_PREFILL=<name in conv1d.prefill_sweep()>` picks another tile. The conv computed inside
the GDN's P / f prep instead (3c2e063, `QWEN35_GDN_CONV_PREFILL=prep`) made the 9B prefill at 64 x 1024 tokens 1618.2
vs 1564.4 ms and was removed (gdn.py's docstring, item 6).
The decode GDN with its conv and gated norm in one kernel (d02e866 / 38b1084, one program per row and key head) was
+0.15 to +0.46 ms per 9B step at batch 64 in its four configurations (bench/ab_decode.py at 997fa07) and was removed.
Decode attention: pallas_kernels/paged_attention.py (DEFAULT config, checked and timed on the H200 by
bench/attention.py); `QWEN35_DECODE_ATTENTION=jnp` selects the jnp reference instead, and any name in
paged_attention.config_sweep() another configuration. What comes between qkv_proj and that kernel (q / k norm and RoPE,
the K / V page write, the query tiles) is one kernel too, paged_attention.decode_prologue (-0.072 / -0.062 ms per 9B
step at batch 16 / 64, 5 / 5 rounds each, bench/ab_decode.py at bbab894); `QWEN35_DECODE_ATTENTION_PROLOGUE=xla` runs
XLA's ops instead (as with the jnp attention). Decode projections (T = 1) run XLA's dot, gate_up's asked for its bf16
result itself in decode batches of `QWEN35_DECODE_GATE_UP_ROUNDS_FROM` rows or more (default 64, `gate_up_rounds_from`,
model.mlp_block); from 64 rows the model splits the row-parallel ones over K itself and XLA splits none
(`decode_split_k`, model.row_parallel). `QWEN35_DECODE_MATMUL=kernel` runs them through pallas_kernels/matmul.py instead
(configuration per shape by `matmul.choose`, XLA's dot where none fits, logged once per shape;
`QWEN35_DECODE_MATMUL_SHAPES=4096x12352,...` limits the kernel to those K x N weights; another name in matmul.RULES
picks the configurations by another rule; `QWEN35_DECODE_MATMUL=mgpu` and the other names in matmul_mgpu.RULES run the
Mosaic GPU kernel instead: TMA loads and asynchronous wgmma). Both are slower than XLA's GEMMs in the 9B batch-64 step
(bench/ab_decode.py at f4fd1c0: +0.28 ms for the Triton kernel on every projection, +0.22 for the Mosaic GPU kernel; at
17358e7 on each projection alone, +0.05 to +0.18 ms and +0.03 to +0.32), so both stay opt-in. The A/Bs before f4fd1c0
that named these variants timed the default's executable for every variant (bench/RESULTS.md, readings of the 2026-12-03
evening). The same kernel with the SiLU product or the gated norm as its prologue (5017f1d) measured +1.0 ms (gated
norm) and a 12.1 ms step (both) and was removed.
"""
from __future__ import annotations

import functools
import logging
import os

import jax

from pallas_kernels import conv1d, conv1d_reference, gdn, gdn_reference, matmul, matmul_mgpu, paged_attention
from qwen35_jax.attention import decode_attention
from qwen35_jax.model import Kernels

log = logging.getLogger(__name__)
BACKENDS = ("reference", "pallas", "pallas_interpret")


def prefill_variants() -> dict:
    return {"wy": gdn.DEFAULT_PREFILL, "wy_triton": gdn.TRITON_PREFILL,
            "v1": gdn.PrefillConfig(), **{c.name: c for c in gdn.prefill_sweep()}}


def decode_variants() -> dict:
    return {"default": gdn.DEFAULT_DECODE, **{c.name: c for c in gdn.decode_sweep()}}


def conv_prefill_variants() -> dict:
    """Conv prefill configurations by name ($QWEN35_CONV_PREFILL): the sweep's (conv1d.prefill_sweep)."""
    return {"default": conv1d.ConvConfig(), **{c.prefill_name: c for c in conv1d.prefill_sweep()}}


def env_count(name: str, default: int, least: int = 0) -> int:
    """$name as a count of at least `least` (default when unset); anything else is refused, naming it."""
    text = os.environ.get(name, str(default))
    if not text.isdigit() or int(text) < least:
        raise ValueError(f"{name} must be a count of at least {least}, got {text!r}")
    return int(text)


def gate_up_rounds_from() -> int:
    """Decode rows from which gate_up's GEMM rounds its result (model.mlp_block): $QWEN35_DECODE_GATE_UP_ROUNDS_FROM,
    default 64 (the A/B at 868067b: -0.072 ms per 9B step at 64 rows, +0.036 at 16; 32 not measured)."""
    return env_count("QWEN35_DECODE_GATE_UP_ROUNDS_FROM", 64)


def decode_split_k(default: int) -> dict:
    """Kernels.split_k / split_k_from: the model's own K split of the row-parallel decode GEMMs in batches of
    $QWEN35_DECODE_SPLIT_K_FROM rows or more (default 64), over $QWEN35_DECODE_SPLIT_K ranges (1: none, XLA splits
    every decode GEMM as it chooses). The pallas backend's default 4: -0.224 ms per 9B step at 64 rows, 5 / 5
    rounds (bench/ab_decode.py at 827a9c7, H200), with XLA's own splits off, which puts in_proj back in one
    kernel; 8 ranges -0.133. XLA's splits off cost +0.26 ms at 16 rows (+0.011 with 8 ranges, +0.049 with 4), and
    batch 1 ran at 1.74x the floor (6.61 ms), hence only from 64 rows (from 32: -0.046 ms at 32 rows, within the
    noise; at 128 rows S = 4 -0.021, S = 8 +0.28; 4a6f0a5)."""
    return {"split_k": env_count("QWEN35_DECODE_SPLIT_K", default, 1),
            "split_k_from": env_count("QWEN35_DECODE_SPLIT_K_FROM", 64, 1)}


def reference_kernels() -> Kernels:
    return Kernels(gdn_prefill=gdn_reference.gdn_prefill, gdn_decode=gdn_reference.gdn_decode_packed,
                   conv_prefill=conv1d_reference.conv_prefill, conv_decode=conv1d_reference.conv_decode,
                   attention_decode=decode_attention, gate_up_rounds_from=gate_up_rounds_from(),
                   **decode_split_k(1))


def parse_shapes(text: str) -> frozenset | None:
    """'4096x12352,4096x4096' -> {(4096, 12352), (4096, 4096)} (K x N of the per-rank weights); '' -> None (all)."""
    out = set()
    for item in filter(None, (t.strip() for t in text.split(","))):
        k, x, n = item.partition("x")
        if not (x and k.isdigit() and n.isdigit()):
            raise ValueError(f"QWEN35_DECODE_MATMUL_SHAPES: {item!r} is not <K>x<N>")
        out.add((int(k), int(n)))
    return frozenset(out) or None


def decode_matmul(interpret: bool, variant: str = "kernel", shapes: frozenset | None = None):
    """(x [M, K], w [K, N], out_dtype) -> [M, N]: a name in matmul.RULES runs the Pallas-Triton kernel in the
    configuration `matmul.choose` gives for the shape by that rule, one in matmul_mgpu.RULES the Mosaic GPU kernel
    (`matmul_mgpu.choose`); XLA's dot where no configuration fits, or where `shapes` (K, N pairs) leaves the weight
    out (logged once per shape)."""
    if variant in matmul.RULES:
        choose, kernel = functools.partial(matmul.choose, rule=matmul.RULES[variant]), matmul.matmul
    else:
        choose, kernel = functools.partial(matmul_mgpu.choose, **matmul_mgpu.RULES[variant]), matmul_mgpu.matmul
    logged = set()

    def run(x, w, out_dtype):
        (m, k), n = x.shape, w.shape[1]
        listed = shapes is None or (k, n) in shapes
        config = choose(m, k, n) if listed else None
        if (m, k, n) not in logged:
            logged.add((m, k, n))
            why = "no kernel configuration fits the shape" if listed else "not listed"
            log.info("decode matmul [%d, %d] @ [%d, %d]: %s", m, k, k, n,
                     config.name if config else f"XLA dot ({why})")
        if config is None:
            return matmul.reference(x, w, out_dtype=out_dtype)
        return kernel(x, w, out_dtype=out_dtype, config=config, interpret=interpret)

    return jax.jit(run, static_argnums=2)


def pallas_kernels(interpret: bool, prefill: str | None = None, decode: str | None = None,
                   attention: str | None = None, projections: str | None = None) -> Kernels:
    """prefill / decode / attention / projections: variant names (None: $QWEN35_GDN_PREFILL / $QWEN35_GDN_DECODE /
    $QWEN35_DECODE_ATTENTION / $QWEN35_DECODE_MATMUL, else "wy" / "default" / "kernel" / "xla")."""
    prefill = prefill or os.environ.get("QWEN35_GDN_PREFILL") or "wy"
    conv = os.environ.get("QWEN35_CONV_PREFILL") or "default"
    decode = decode or os.environ.get("QWEN35_GDN_DECODE") or "default"
    attention = attention or os.environ.get("QWEN35_DECODE_ATTENTION") or "kernel"
    projections = projections or os.environ.get("QWEN35_DECODE_MATMUL") or "xla"
    matmul_variants = ["xla", *matmul.RULES, *matmul_mgpu.RULES]
    if projections not in matmul_variants:
        raise ValueError(f"decode matmul variant must be one of {matmul_variants}, got {projections!r}")
    pv, dv = prefill_variants(), decode_variants()
    # Each kernel under its own jit: every layer calls it with the same shapes, so JAX traces and lowers it once per
    # executable instead of once per layer (lowering a 9B-shaped step: ~4x faster on CPU, bench notes in RESULTS).
    p = lambda f, static=(), **kw: jax.jit(functools.partial(f, interpret=interpret, **kw), static_argnames=static)
    # "jnp" rules the kernel out (the reference's page loop costs a host round trip per block on GPU).
    av = {"kernel": p(paged_attention.paged_decode_attention, config=paged_attention.DEFAULT), "jnp": decode_attention,
          **{c.name: p(paged_attention.paged_decode_attention, config=c) for c in paged_attention.config_sweep()}}
    prologue = os.environ.get("QWEN35_DECODE_ATTENTION_PROLOGUE") or ("xla" if attention == "jnp" else "kernel")
    if prologue not in ("xla", "kernel") or (prologue == "kernel" and attention == "jnp"):
        raise ValueError(f"QWEN35_DECODE_ATTENTION_PROLOGUE must be 'xla' or 'kernel' (with a decode attention "
                         f"kernel), got {prologue!r} with decode attention {attention!r}")
    if prefill not in pv:
        raise ValueError(f"GDN prefill variant must be one of {sorted(pv)}, got {prefill!r}")
    cv = conv_prefill_variants()
    if conv not in cv:
        raise ValueError(f"conv prefill variant must be one of {sorted(cv)}, got {conv!r}")
    if decode not in dv:
        raise ValueError(f"GDN decode variant must be one of {sorted(dv)}, got {decode!r}")
    if attention not in av:
        raise ValueError(f"decode attention variant must be one of {sorted(av)}, got {attention!r}")
    split = decode_split_k(4 if projections == "xla" else 1)
    if projections != "xla" and split["split_k"] > 1:
        raise ValueError("QWEN35_DECODE_SPLIT_K splits XLA's decode GEMMs; the decode matmul kernel "
                         f"({projections}) runs them instead")
    log.info("GDN kernels: prefill %s (%s), decode %s (%s); conv prefill %s; decode attention %s, its prologue %s; "
             "decode projections %s, the row-parallel ones split over %d ranges of K from %d rows", prefill,
             pv[prefill].name, decode, dv[decode].name, cv[conv].prefill_name,
             paged_attention.DEFAULT.name if attention == "kernel"
             else attention, prologue, projections, split["split_k"], split["split_k_from"])
    tiles = before_tiles = None
    if prologue == "kernel":
        config = av[attention].__wrapped__.keywords["config"]
        tiles = jax.jit(functools.partial(paged_attention.attend_tiles, config=config, interpret=interpret),
                        static_argnums=1)
        before_tiles = jax.jit(functools.partial(paged_attention.decode_prologue, interpret=interpret),
                               static_argnames=("q_heads", "rotary_dim", "theta", "eps"))
    return Kernels(gdn_prefill=p(gdn.gdn_prefill, config=pv[prefill]),
                   gdn_decode=p(gdn.gdn_decode_packed, config=dv[decode]),
                   conv_prefill=p(conv1d.conv_prefill, static=("split",), config=cv[conv]),
                   conv_decode=p(conv1d.conv_decode),
                   attention_decode=av[attention],
                   matmul=None if projections == "xla" else decode_matmul(
                       interpret, projections, parse_shapes(os.environ.get("QWEN35_DECODE_MATMUL_SHAPES", ""))),
                   gate_up_rounds_from=gate_up_rounds_from(), **split,
                   attention_prologue=before_tiles, attention_tiles=tiles)


def default_backend() -> str:
    """"pallas" on GPU (the default kernel variants above), else "reference"."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def get_kernels(name: str | None) -> tuple[str, Kernels]:
    name = name or default_backend()
    if name not in BACKENDS:
        raise ValueError(f"kernel_backend must be one of {BACKENDS}, got {name!r}")
    if name == "reference":
        return name, reference_kernels()
    if name == "pallas" and jax.default_backend() != "gpu":
        raise ValueError(f"kernel_backend 'pallas' needs a GPU (default backend is {jax.default_backend()!r}); "
                         "use 'pallas_interpret' or 'reference'")
    return name, pallas_kernels(interpret=name == "pallas_interpret")
