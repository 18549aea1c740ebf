"""The `tp` mesh, the logical-axis table, and each rank's share of the model (validated once, with clear errors)."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qwen35_jax.model.config import ModelConfig

TP = "tp"
DP = "dp"

# Logical axis -> mesh axis. Everything sharded is split over `tp`; None means replicated.
RULES = {
    "vocab": TP,        # embedding rows / lm_head columns
    "q_heads": TP,      # attention q (+gate) columns, o_proj rows
    "kv_heads": TP,     # K/V columns and the KV cache (replicated per rank when tp > num_key_value_heads)
    "ffn": TP,          # MLP gate/up columns, down rows
    "experts": TP,      # MoE routed experts: each rank holds E / tp whole experts (expert parallelism over tp)
    "shared_ffn": TP,   # MoE shared expert's gate/up columns, down rows
    "gdn_in": TP,       # fused GDN input projection columns [q|k|v|z|b|a] per rank
    "gdn_heads": TP,    # GDN value heads: dt_bias, A_log, recurrent state, out_proj rows
    "conv_ch": TP,      # conv channels [q|k|v] per rank: conv weight and conv state
    "slots": DP,        # state slots: each data-parallel replica owns its own slots (and its own null slot)
    "pages": DP,        # KV pages: each replica owns its own page pool (and its own null page)
    "batch": DP,        # rows of a step
    "embed": None, "head_dim": None, "kernel": None, "page": None, "dk": None, "dv": None, "taps": None,
}


def spec(axes) -> P:
    return P(*(RULES[a] if a is not None else None for a in axes))


def make_mesh(tp: int = 1, devices=None, dp: int = 1) -> Mesh:
    """A (dp, tp) mesh: tp ranks that split the model, dp replicas that split requests. tp groups are made of
    consecutive devices (one host's GPUs in a multi-process run)."""
    devices = list(devices if devices is not None else jax.devices())
    if tp not in (1, 2, 4, 8):
        raise ValueError(f"tensor_parallel_size must be 1, 2, 4 or 8, got {tp}")
    if dp < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {dp}")
    if len(devices) < tp * dp:
        raise ValueError(f"tensor_parallel_size={tp} x data_parallel_size={dp} needs {tp * dp} devices but only "
                         f"{len(devices)} are visible ({devices[0].platform if devices else 'none'})")
    return Mesh(np.array(devices[:tp * dp]).reshape(dp, tp), (DP, TP), axis_types=(AxisType.Auto,) * 2)


def named(mesh: Mesh, axes) -> NamedSharding:
    return NamedSharding(mesh, spec(axes))


@dataclasses.dataclass(frozen=True)
class Layout:
    """Per-rank sizes under tensor parallelism. Every head count must split evenly; the KV heads are replicated
    when tp exceeds num_key_value_heads (each rank then holds the one KV head its query heads read)."""

    tp: int
    q_heads: int        # attention query heads per rank
    kv_heads: int       # attention KV heads per rank
    kv_total: int       # KV heads over all ranks (num_key_value_heads, or tp when replicated)
    k_heads: int        # GDN key heads per rank
    v_heads: int        # GDN value heads per rank
    ffn: int            # MLP intermediate per rank (0 for MoE models)
    experts: int        # MoE routed experts per rank (0 for dense models)
    shared_ffn: int     # MoE shared expert's intermediate per rank
    vocab_padded: int   # vocab rounded up to a multiple of tp (extra rows are zero and masked)

    @property
    def vocab(self) -> int:
        return self.vocab_padded // self.tp

    @classmethod
    def build(cls, cfg: ModelConfig, tp: int) -> "Layout":
        def divides(field, value):
            if value % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not divide {field}={value}")
            return value // tp

        q_heads = divides("num_attention_heads", cfg.num_heads)
        if tp <= cfg.num_kv_heads:
            kv_heads, kv_total = divides("num_key_value_heads", cfg.num_kv_heads), cfg.num_kv_heads
        elif tp % cfg.num_kv_heads:
            raise ValueError(f"tensor_parallel_size={tp} is neither a divisor nor a multiple of "
                             f"num_key_value_heads={cfg.num_kv_heads}")
        else:
            kv_heads, kv_total = 1, tp
        return cls(tp=tp, q_heads=q_heads, kv_heads=kv_heads, kv_total=kv_total,
                   k_heads=divides("linear_num_key_heads", cfg.linear_num_key_heads),
                   v_heads=divides("linear_num_value_heads", cfg.linear_num_value_heads),
                   ffn=divides("intermediate_size", cfg.intermediate_size),
                   experts=divides("num_experts", cfg.num_experts),
                   shared_ffn=divides("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size),
                   vocab_padded=-(-cfg.vocab_size // tp) * tp)

    def kv_head_of_rank(self, cfg: ModelConfig, rank: int) -> int:
        """First global KV head read by this rank's query heads."""
        return rank * self.q_heads // (cfg.num_heads // cfg.num_kv_heads)
