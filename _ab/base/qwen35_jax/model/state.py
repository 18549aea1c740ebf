"""Per-request decoding state: GDN recurrent + conv state in slot pools, and paged K/V of the attention layers.

Slot 0 of the GDN pools and page 0 of the KV pool are null: padded rows read and write them, so a padded row
never touches a live request. Layouts:
- recurrent [slots+1, Hv, dv, dk] fp32, V-first: a decode row streams contiguous dk vectors (docs/kernels.md);
- conv      [slots+1, K-1, conv_dim] in the model dtype: the last K-1 pre-conv inputs, channels [q_r|k_r|v_r];
- k/v pages [Hkv', num_pages, page_size, D] in the model dtype (the layout of JAX's GPU paged attention).
Under tp the GDN state is sharded by value head / channel and the KV pages by KV head; nothing is all-reduced.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from qwen35_jax.model.config import ModelConfig
from qwen35_jax.model.sharding import Layout, named, spec
from qwen35_jax.model.weights import Param, _leaf


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class State:
    conv: list           # per GDN layer
    recurrent: list      # per GDN layer
    k_pages: list        # per attention layer
    v_pages: list        # per attention layer


def abstract_state(cfg: ModelConfig, layout: Layout, num_slots: int, num_pages: int, page_size: int,
                   dtype=jnp.bfloat16, dp: int = 1, mtp: bool = False) -> State:
    """Per data-parallel replica: num_slots live request slots (+1 null slot) and num_pages KV pages (page 0 is
    the null page). With dp replicas the pools are stacked along the slot / page axis, which is sharded on dp.
    mtp: one more K/V pool, the last, for the MTP head's attention layer (paged by the same page tables)."""
    n_attn = len(cfg.attn_layers) + int(mtp)
    kv = Param((layout.kv_total, dp * num_pages, page_size, cfg.head_dim), dtype,
               ("kv_heads", "pages", "page", "head_dim"))
    return dataclasses.replace(abstract_snapshots(cfg, num_slots, dtype, dp), k_pages=[kv] * n_attn,
                               v_pages=[kv] * n_attn)


def abstract_snapshots(cfg: ModelConfig, num: int, dtype=jnp.bfloat16, dp: int = 1) -> State:
    """GDN recurrent and conv state of num slots per replica (+1 null), no K/V pages: the live slots of
    abstract_state, or the prefix cache's snapshot pool (laid out and sharded as the slots)."""
    n_gdn = len(cfg.gdn_layers)
    slots = dp * (num + 1)
    conv = Param((slots, cfg.conv_kernel - 1, cfg.conv_dim), dtype, ("slots", "taps", "conv_ch"))
    rec = Param((slots, cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_key_head_dim),
                jnp.float32, ("slots", "gdn_heads", "dv", "dk"))
    return State(conv=[conv] * n_gdn, recurrent=[rec] * n_gdn, k_pages=[], v_pages=[])


def state_specs(abstract: State):
    return jax.tree.map(lambda p: spec(p.axes), abstract, is_leaf=_leaf)


def init_state(abstract: State, mesh: Mesh) -> State:
    def zeros(p: Param):
        return jax.jit(lambda: jnp.zeros(p.shape, p.dtype), out_shardings=named(mesh, p.axes))()
    return jax.tree.map(zeros, abstract, is_leaf=_leaf)


def nbytes(abstract: State) -> int:
    return sum(int(np.prod(p.shape)) * jnp.dtype(p.dtype).itemsize for p in jax.tree.leaves(abstract, is_leaf=_leaf))


def bytes_per_slot(cfg: ModelConfig, dtype=jnp.bfloat16) -> int:
    """GDN state bytes one request holds (all layers, all ranks)."""
    rec = cfg.linear_num_value_heads * cfg.linear_value_head_dim * cfg.linear_key_head_dim * 4
    conv = (cfg.conv_kernel - 1) * cfg.conv_dim * jnp.dtype(dtype).itemsize
    return len(cfg.gdn_layers) * (rec + conv)
