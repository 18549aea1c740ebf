"""Weights as pytrees of small dataclasses, their abstract description, and per-rank loading from HF checkpoints.

Every leaf of the abstract tree is a `Param`: global shape, dtype, logical sharding axes, and where its values come
from in the checkpoint. Tensor-parallel re-layout happens here, once: matrices are stored [in, out] for `x @ w`,
and column-parallel projections are re-stitched so that rank r's contiguous block holds exactly its own heads
(e.g. the GDN input projection becomes [q_r | k_r | v_r | z_r | b_r | a_r] per rank, the conv weight
[q_r | k_r | v_r]). Loading builds each device's shard from only the bytes it needs
(`jax.make_array_from_callback`), so host memory stays bounded by one slice at a time.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from qwen35_jax.model.checkpoint import Checkpoint
from qwen35_jax.model.config import ModelConfig
from qwen35_jax.model.sharding import Layout, named, spec

log = logging.getLogger(__name__)
Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Run:
    """`length` consecutive entries of checkpoint tensor `key` along its stitched axis, from `start`.
    key None means zeros (vocab padding)."""
    key: str | None
    start: int
    length: int


@dataclasses.dataclass(frozen=True)
class Param:
    """Abstract leaf: a global array, how it is sharded, and how to read it from a checkpoint."""
    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str | None, ...]          # logical axes (see sharding.RULES)
    runs: tuple[Run, ...] = ()            # concatenated along the stitched axis
    hf_axis: int = 0                      # stitched axis in the checkpoint tensor
    transpose: bool = False               # checkpoint [out, in] (conv [C, 1, K], experts [E, out, in]) -> stored
                                          # [in, out] / [K, C] / [E, in, out]: the last two axes swapped
    expect: tuple[tuple[str, tuple[int, ...]], ...] = ()   # checkpoint key -> shape it must have
    init: str = "normal"                  # random init: normal | zeros | ones | a_log

    @property
    def stored_axis(self) -> int:
        if not self.transpose:
            return self.hf_axis
        perm = list(range(len(self.shape)))
        perm[-2:] = perm[-1], perm[-2]
        return perm.index(self.hf_axis)


def _leaf(x):
    return isinstance(x, Param)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MLP:
    gate_up: Any     # [H, 2*I] as [gate_r | up_r] per rank
    down: Any        # [I, H]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MoE:
    """A sparse MLP (qwen3_5_moe): softmax router over E experts, top k renormalised, plus a sigmoid-gated shared
    expert. Experts are split whole over tp (each rank holds E / tp of them)."""
    router: Any          # [H, E] replicated
    gate_up: Any         # [E, H, 2*Im] as [gate | up] per expert, experts sharded
    down: Any            # [E, Im, H]
    shared: Any          # MLP of width Is, sharded as a dense MLP
    shared_gate: Any     # [H, 1] replicated


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Attention:
    qkv: Any         # [H, Hq*2D + 2*Hkv'*D] as [q/gate interleaved per head | k | v] per rank
    o_proj: Any      # [Hq*D, H]
    q_norm: Any      # [D] (1+w)
    k_norm: Any      # [D] (1+w)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GatedDeltaNet:
    in_proj: Any     # [H, conv_dim + value_dim + 2*Hv] as [q_r | k_r | v_r | z_r | b_r | a_r] per rank
    conv: Any        # [K, conv_dim] as [q_r | k_r | v_r] per rank
    dt_bias: Any     # [Hv] fp32
    A_log: Any       # [Hv] fp32
    norm: Any        # [dv] fp32, plain weight of the gated RMSNorm
    out_proj: Any    # [value_dim, H]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    input_norm: Any  # [H] (1+w)
    post_norm: Any   # [H] (1+w)
    mixer: Any       # Attention | GatedDeltaNet
    mlp: Any         # MLP | MoE


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MTP:
    """The multi-token-prediction head (checkpoint keys `mtp.*`; forward.mtp): shares the embedding and lm_head."""
    fc: Any                      # [2H, H] replicated: rows [embedding half | hidden half]
    pre_fc_norm_embedding: Any   # [H] (1+w)
    pre_fc_norm_hidden: Any      # [H] (1+w)
    layer: Any                   # a full-attention Layer
    norm: Any                    # [H] (1+w)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    embed: Any               # [V', H] vocab-sharded
    layers: list
    final_norm: Any          # [H]
    lm_head: Any = None      # [H, V'] vocab-sharded; None when tied to the embedding
    mtp: Any = None          # MTP, when asked for (abstract_weights(mtp=True))


# ----------------------------------------------------------------------------------------------------------------
# The abstract tree


def _linear(key_runs, in_dim, out_axis, dtype, expect, in_axis="embed"):
    """Column-parallel linear from checkpoint [out, in] rows: stored [in, sum(lengths)]."""
    out = sum(r.length for r in key_runs)
    return Param((in_dim, out), dtype, (in_axis, out_axis), tuple(key_runs), hf_axis=0, transpose=True,
                 expect=tuple(expect))


def _row_parallel(key, in_dim, out_dim, in_axis, dtype):
    """Row-parallel linear from checkpoint [out, in]: stored [in, out], sharded on `in`."""
    return Param((in_dim, out_dim), dtype, (in_axis, "embed"), (Run(key, 0, in_dim),), hf_axis=1, transpose=True,
                 expect=((key, (out_dim, in_dim)),))


def _vector(key, n, axis, init, dtype=jnp.float32):
    return Param((n,), dtype, (axis,), (Run(key, 0, n),), expect=((key, (n,)),), init=init)


def abstract_weights(cfg: ModelConfig, layout: Layout, dtype=jnp.bfloat16, mtp: bool = False) -> Weights:
    """The model's weights; mtp adds the multi-token-prediction head (the config must declare one)."""
    h, tp = cfg.hidden_size, layout.tp
    norm = lambda key, n=h: _vector(key, n, None, "zeros")

    def dense(p, i, per_rank, axis):
        runs = [Run(f"{p}.{name}.weight", r * per_rank, per_rank)
                for r in range(tp) for name in ("gate_proj", "up_proj")]
        exp = [(f"{p}.gate_proj.weight", (i, h)), (f"{p}.up_proj.weight", (i, h))]
        return MLP(gate_up=_linear(runs, h, axis, dtype, exp),
                   down=_row_parallel(f"{p}.down_proj.weight", i, h, axis, dtype))

    def mlp(p):
        if not cfg.moe:
            return dense(p, cfg.intermediate_size, layout.ffn, "ffn")
        e, im = cfg.num_experts, cfg.moe_intermediate_size
        experts = lambda name, shape, axes: Param(shape, dtype, axes, (Run(f"{p}.experts.{name}", 0, e),), hf_axis=0,
                                                  transpose=True, expect=((f"{p}.experts.{name}",
                                                                           (e, shape[2], shape[1])),))
        return MoE(router=_linear([Run(f"{p}.gate.weight", 0, e)], h, None, dtype, [(f"{p}.gate.weight", (e, h))]),
                   gate_up=experts("gate_up_proj", (e, h, 2 * im), ("experts", "embed", None)),
                   down=experts("down_proj", (e, im, h), ("experts", None, "embed")),
                   shared=dense(f"{p}.shared_expert", cfg.shared_expert_intermediate_size, layout.shared_ffn,
                                "shared_ffn"),
                   shared_gate=_linear([Run(f"{p}.shared_expert_gate.weight", 0, 1)], h, None, dtype,
                                       [(f"{p}.shared_expert_gate.weight", (1, h))]))

    def attention(p):
        d = cfg.head_dim
        runs = []
        for r in range(tp):
            kv0 = layout.kv_head_of_rank(cfg, r)
            runs += [Run(f"{p}.q_proj.weight", r * layout.q_heads * 2 * d, layout.q_heads * 2 * d),
                     Run(f"{p}.k_proj.weight", kv0 * d, layout.kv_heads * d),
                     Run(f"{p}.v_proj.weight", kv0 * d, layout.kv_heads * d)]
        exp = [(f"{p}.q_proj.weight", (cfg.num_heads * 2 * d, h)), (f"{p}.k_proj.weight", (cfg.num_kv_heads * d, h)),
               (f"{p}.v_proj.weight", (cfg.num_kv_heads * d, h))]
        return Attention(qkv=_linear(runs, h, "q_heads", dtype, exp),
                         o_proj=_row_parallel(f"{p}.o_proj.weight", cfg.num_heads * d, h, "q_heads", dtype),
                         q_norm=norm(f"{p}.q_norm.weight", d), k_norm=norm(f"{p}.k_norm.weight", d))

    def gdn(p):
        kd, vd = cfg.key_dim, cfg.value_dim
        kl, vl = layout.k_heads * cfg.linear_key_head_dim, layout.v_heads * cfg.linear_value_head_dim
        hl = layout.v_heads
        qkv = lambda r: [Run(f"{p}.in_proj_qkv.weight", r * kl, kl), Run(f"{p}.in_proj_qkv.weight", kd + r * kl, kl),
                         Run(f"{p}.in_proj_qkv.weight", 2 * kd + r * vl, vl)]
        runs = []
        for r in range(tp):
            runs += qkv(r) + [Run(f"{p}.in_proj_z.weight", r * vl, vl), Run(f"{p}.in_proj_b.weight", r * hl, hl),
                              Run(f"{p}.in_proj_a.weight", r * hl, hl)]
        hv = cfg.linear_num_value_heads
        exp = [(f"{p}.in_proj_qkv.weight", (cfg.conv_dim, h)), (f"{p}.in_proj_z.weight", (vd, h)),
               (f"{p}.in_proj_b.weight", (hv, h)), (f"{p}.in_proj_a.weight", (hv, h))]
        conv_runs = tuple(Run(f"{p}.conv1d.weight", x.start, x.length) for r in range(tp) for x in qkv(r))
        conv = Param((cfg.conv_kernel, cfg.conv_dim), dtype, ("taps", "conv_ch"), conv_runs, hf_axis=0, transpose=True,
                     expect=((f"{p}.conv1d.weight", (cfg.conv_dim, 1, cfg.conv_kernel)),))
        return GatedDeltaNet(in_proj=_linear(runs, h, "gdn_in", dtype, exp), conv=conv,
                             dt_bias=_vector(f"{p}.dt_bias", hv, "gdn_heads", "zeros"),
                             A_log=_vector(f"{p}.A_log", hv, "gdn_heads", "a_log"),
                             norm=_vector(f"{p}.norm.weight", cfg.linear_value_head_dim, None, "ones"),
                             out_proj=_row_parallel(f"{p}.out_proj.weight", vd, h, "gdn_heads", dtype))

    def layer(p, kind):
        mixer = attention(f"{p}.self_attn") if kind == "full_attention" else gdn(f"{p}.linear_attn")
        return Layer(input_norm=norm(f"{p}.input_layernorm.weight"),
                     post_norm=norm(f"{p}.post_attention_layernorm.weight"), mixer=mixer, mlp=mlp(f"{p}.mlp"))

    layers = [layer(f"layers.{i}", kind) for i, kind in enumerate(cfg.layer_types)]
    mtp_head = None
    if mtp:
        if cfg.mtp_layers != 1:
            raise ValueError(f"the MTP head needs mtp_num_hidden_layers = 1 in config.json, got {cfg.mtp_layers}")
        fc = _linear([Run("mtp.fc.weight", 0, h)], 2 * h, "embed", dtype, [("mtp.fc.weight", (h, 2 * h))],
                     in_axis=None)
        mtp_head = MTP(fc=fc, pre_fc_norm_embedding=norm("mtp.pre_fc_norm_embedding.weight"),
                       pre_fc_norm_hidden=norm("mtp.pre_fc_norm_hidden.weight"),
                       layer=layer("mtp.layers.0", "full_attention"), norm=norm("mtp.norm.weight"))
    v, vp = cfg.vocab_size, layout.vocab_padded
    vocab_runs = (Run("embed_tokens.weight", 0, v),) + ((Run(None, 0, vp - v),) if vp > v else ())
    embed = Param((vp, h), dtype, ("vocab", "embed"), vocab_runs, hf_axis=0, expect=(("embed_tokens.weight", (v, h)),))
    lm_head = None
    if not cfg.tie_word_embeddings:
        head_runs = (Run("lm_head.weight", 0, v),) + vocab_runs[1:]
        lm_head = Param((h, vp), dtype, ("embed", "vocab"), head_runs, hf_axis=0, transpose=True,
                        expect=(("lm_head.weight", (v, h)),))
    return Weights(embed=embed, layers=layers, final_norm=norm("norm.weight"), lm_head=lm_head, mtp=mtp_head)


def weight_specs(abstract: Weights):
    return jax.tree.map(lambda p: spec(p.axes), abstract, is_leaf=_leaf)


def shardings(abstract: Weights, mesh: Mesh):
    return jax.tree.map(lambda p: named(mesh, p.axes), abstract, is_leaf=_leaf)


def nbytes(abstract: Weights) -> int:
    return sum(int(np.prod(p.shape)) * jnp.dtype(p.dtype).itemsize
               for p in jax.tree.leaves(abstract, is_leaf=_leaf))


# ----------------------------------------------------------------------------------------------------------------
# Loading


def validate(ckpt: Checkpoint, abstract: Weights):
    """Every tensor the model needs is present with its expected shape; raise before anything is built."""
    for p in jax.tree.leaves(abstract, is_leaf=_leaf):
        for key, shape in p.expect:
            if key not in ckpt:
                raise ValueError(f"checkpoint is missing tensor {key!r} (expected shape {list(shape)})")
            if tuple(ckpt.shape(key)) != tuple(shape):
                raise ValueError(f"checkpoint tensor {key!r} has shape {list(ckpt.shape(key))}, "
                                 f"expected {list(shape)}")


def _read_stitched(ckpt: Checkpoint, p: Param, lo: int, hi: int) -> np.ndarray:
    """Entries [lo, hi) of the stitched axis, in checkpoint orientation (stitched axis = p.hf_axis), as p.dtype."""
    parts, pos = [], 0
    for run in p.runs:
        a, b = max(lo, pos), min(hi, pos + run.length)
        if a < b:
            if run.key is None:                       # vocab padding rows: [n, H] in checkpoint orientation
                parts.append(np.zeros((b - a, p.shape[1 - p.stored_axis]), p.dtype))
            else:
                x = ckpt.read(run.key, p.hf_axis, run.start + a - pos, run.start + b - pos)
                if x.ndim == len(p.shape) + 1:        # conv1d [C, 1, K]
                    x = x[:, 0, :]
                parts.append(x.astype(p.dtype, copy=False))
        pos += run.length
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=p.hf_axis)


def load_param(ckpt: Checkpoint, p: Param, sharding) -> Array:
    """One global array, built shard by shard: each device's slice is read, put on its device and released
    before the next is read, so host memory holds at most one shard of one tensor at a time."""
    axis = p.stored_axis
    shards = []
    for device, index in sharding.addressable_devices_indices_map(p.shape).items():
        lo, hi, _ = index[axis].indices(p.shape[axis])
        x = _read_stitched(ckpt, p, lo, hi)
        if p.transpose:
            x = np.swapaxes(x, -1, -2)
        rest = list(index)
        rest[axis] = slice(None)
        shards.append(jax.device_put(np.ascontiguousarray(x[tuple(rest)]), device))
        del x
    return jax.make_array_from_single_device_arrays(p.shape, sharding, shards)


def load_weights(model_dir: str, cfg: ModelConfig, mesh: Mesh, dtype=jnp.bfloat16, progress: bool = False,
                 mtp: bool = False) -> Weights:
    """Checkpoint -> sharded device arrays, each device reading only its own slices (mtp: with the MTP head)."""
    layout = Layout.build(cfg, mesh.shape["tp"])
    abstract = abstract_weights(cfg, layout, dtype, mtp)
    ckpt = Checkpoint(model_dir)
    validate(ckpt, abstract)
    leaves, treedef = jax.tree.flatten(abstract, is_leaf=_leaf)
    if progress:
        from tqdm.auto import tqdm
        leaves_iter = tqdm(leaves, desc="loading weights", unit="tensor")
    else:
        leaves_iter = leaves
    arrays = [load_param(ckpt, p, named(mesh, p.axes)) for p in leaves_iter]
    return jax.tree.unflatten(treedef, arrays)


def random_weights(cfg: ModelConfig, mesh: Mesh, dtype=jnp.bfloat16, seed: int = 0, scale: float = 0.02,
                   mtp: bool = False) -> Weights:
    """Random weights made directly on the devices, sharded (for benchmarks at real shapes, and the initial
    weights of tools/train_tiny). One compiled initialiser per distinct (shape, dtype, init, sharding), so the
    dozens of identical layers share it."""
    layout = Layout.build(cfg, mesh.shape["tp"])
    abstract = abstract_weights(cfg, layout, dtype, mtp)
    leaves, treedef = jax.tree.flatten(abstract, is_leaf=_leaf)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    makers = {}

    def maker(p: Param):
        sig = (p.shape, jnp.dtype(p.dtype).name, p.init, p.axes)
        if sig not in makers:
            def f(key):
                if p.init == "zeros":
                    return jnp.zeros(p.shape, p.dtype)
                if p.init == "ones":
                    return jnp.ones(p.shape, p.dtype)
                if p.init == "a_log":
                    return jnp.log(jax.random.uniform(key, p.shape, jnp.float32, 1.0, 16.0)).astype(p.dtype)
                return (scale * jax.random.normal(key, p.shape, jnp.float32)).astype(p.dtype)
            makers[sig] = jax.jit(f, out_shardings=named(mesh, p.axes))
        return makers[sig]

    return jax.tree.unflatten(treedef, [maker(p)(k) for p, k in zip(leaves, keys)])


def to_checkpoint(weights: Weights, cfg: ModelConfig, tp: int = 1) -> dict[str, np.ndarray]:
    """The inverse of loading: every checkpoint tensor (text-decoder key names, checkpoint orientation, the
    weights' dtype) rebuilt from weights laid out for `tp`. Used to write trained models in HF layout."""
    abstract = abstract_weights(cfg, Layout.build(cfg, tp), weights.embed.dtype, mtp=weights.mtp is not None)
    out: dict[str, np.ndarray] = {}
    for p, x in zip(jax.tree.leaves(abstract, is_leaf=_leaf), jax.tree.leaves(weights)):
        x = np.asarray(jax.device_get(x))
        x = np.swapaxes(x, -1, -2) if p.transpose else x     # checkpoint orientation; stitched axis p.hf_axis
        shapes, pos = dict(p.expect), 0
        for run in p.runs:
            if run.key is not None:                  # None: vocab padding, not in the checkpoint
                part = np.take(x, np.arange(pos, pos + run.length), axis=p.hf_axis)
                dst = out.setdefault(run.key, np.zeros(shapes[run.key], x.dtype))
                index = [slice(None)] * part.ndim
                index[p.hf_axis] = slice(run.start, run.start + run.length)
                if dst.ndim == part.ndim + 1:        # conv1d [C, 1, K]
                    dst[tuple(index[:1]) + (0,)] = part
                else:
                    dst[tuple(index)] = part
            pos += run.length
    return out


def _stitched_sources(p: Param) -> list[tuple[str | None, int]]:
    """(checkpoint key, index) of every entry along a Param's stitched axis."""
    return [(r.key, r.start + i) for r in p.runs for i in range(r.length)]


def relayout(weights: Weights, cfg: ModelConfig, src_mesh: Mesh, dst_mesh: Mesh) -> Weights:
    """The same model re-laid-out for another mesh: each stitched axis is permuted (and KV heads replicated) from
    the source tp layout to the destination's, on the devices. Used to compare tp sizes on random weights."""
    dtype = weights.embed.dtype
    src = abstract_weights(cfg, Layout.build(cfg, src_mesh.shape["tp"]), dtype)
    dst = abstract_weights(cfg, Layout.build(cfg, dst_mesh.shape["tp"]), dtype)
    movers = {}     # identical layers share one compiled gather

    def move(x, ps: Param, pd: Param):
        a, b = _stitched_sources(ps), _stitched_sources(pd)
        if a == b:
            return jax.device_put(x, named(dst_mesh, pd.axes))
        where = {s: i for i, s in enumerate(a)}
        idx = np.array([where.get(s, -1) for s in b], np.int32)    # -1: vocab padding the source did not have
        sig = (x.shape, x.dtype.name, ps.stored_axis, pd.axes, idx.tobytes())
        if sig not in movers:
            axis = ps.stored_axis

            def take(x, idx):
                y = jnp.take(x, jnp.maximum(idx, 0), axis=axis)
                keep = jnp.expand_dims(idx >= 0, 1 - axis) if x.ndim == 2 else idx >= 0
                return jnp.where(keep, y, 0)
            movers[sig] = jax.jit(take, out_shardings=named(dst_mesh, pd.axes))
        replicated = named(dst_mesh, tuple(None for _ in ps.axes))
        return movers[sig](jax.device_put(x, replicated), jax.device_put(idx, named(dst_mesh, (None,))))

    return jax.tree.map(move, weights, src, dst, is_leaf=lambda x: isinstance(x, Param))


# ----------------------------------------------------------------------------------------------------------------
# Converted-weight checkpoints (orbax): a restart restores the already re-laid-out shards directly.


def save_converted(weights: Weights, path: str):
    import orbax.checkpoint as ocp
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, weights)


def restore_converted(path: str, cfg: ModelConfig, mesh: Mesh, dtype=jnp.bfloat16, mtp: bool = False) -> Weights:
    import orbax.checkpoint as ocp
    abstract = abstract_weights(cfg, Layout.build(cfg, mesh.shape["tp"]), dtype, mtp)
    target = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=named(mesh, p.axes)),
                          abstract, is_leaf=_leaf)
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(path, target)


def load_or_restore(model_dir: str, cfg: ModelConfig, mesh: Mesh, dtype, converted_dir: str | None = None,
                    mtp: bool = False) -> Weights:
    """Checkpoint -> sharded weights (mtp: with the MTP head); with converted_dir, restore the re-laid-out shards an
    earlier start saved there (orbax), or save them there after this load."""
    if not converted_dir:
        return load_weights(model_dir, cfg, mesh, dtype, progress=True, mtp=mtp)
    name = f"tp{mesh.shape['tp']}-{jnp.dtype(dtype).name}" + ("-mtp" if mtp else "")
    path = os.path.abspath(os.path.join(converted_dir, name))
    if os.path.exists(path):
        log.info("restoring converted weights from %s", path)
        return restore_converted(path, cfg, mesh, dtype, mtp=mtp)
    weights = load_weights(model_dir, cfg, mesh, dtype, progress=True, mtp=mtp)
    save_converted(weights, path)
    return weights
