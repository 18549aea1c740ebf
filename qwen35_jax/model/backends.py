"""Kernel settings (`KernelConfig`) and the backends that turn them into the model's operations (`Kernels`).

A backend is chosen by name from `BACKENDS`: "reference" runs the pure-jnp references (any platform), "pallas" the
Pallas kernels compiled for the GPU, "pallas_interpret" the same kernels in Pallas interpret mode (any platform;
slow, for tests). The defaults of `KernelConfig` are the fastest settings measured on the H200 (bench/RESULTS.md;
docs/kernels.md says what each kernel does and why its tiles are what they are). Benchmarks pass other values to
compare variants side by side; the engine keys its compiled executables on the whole configuration.
"""
from __future__ import annotations

import dataclasses
import functools
import typing

import jax

from pallas_kernels import (conv1d, conv1d_reference, expert_gemm, gdn, gdn_reference, gemv, paged_attention,
                            prefill_attention)
from qwen35_jax.model.attention import decode_attention, paged_attention as prefill_attention_reference
from qwen35_jax.model.config import ModelConfig
from qwen35_jax.model.forward import Kernels
from qwen35_jax.model.sharding import Layout

BACKENDS = ("reference", "pallas", "pallas_interpret")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """The kernel and performance settings of an engine (frozen: it keys the compiled executables).

    backend: a name in BACKENDS; None picks "pallas" on a GPU, else "reference".
    gdn_prefill / gdn_decode / conv / decode_attention / prefill_attention: the Pallas kernels' tile
    configurations (pallas backends). decode_attention None runs the jnp reference for decode attention instead of
    the kernel (with XLA's q / k norm, RoPE and K / V write before it); attention_prologue runs those as one kernel
    that also lays out the kernel's query tiles. prefill_attention None runs the jnp reference for prefill chunks
    (a data-dependent loop: a host round trip per key block on the GPU).
    expert_gemm: an MoE layer's routed and shared experts: up to copies_max token copies (small decode batches)
    the per-copy kernels, the sorted grouped kernels past them (both read only the experts routed to); the
    router's softmax and top k as one kernel. None: the reference, XLA's top k and jax.lax.ragged_dot (which XLA
    runs on a GPU as a dense dot over every expert: pallas_kernels/expert_gemm.py).
    gemv: a prefill step's untied lm_head (its rows' last tokens) on the GEMV kernel, where XLA ran a cuBLAS gemv
    on an fp32 copy of the head; None: XLA's dot. (Decode steps run XLA's GEMMs: with a padding row beside a lone
    request they measured faster than the GEMV on one row, bench/RESULTS.md.)
    gate_up_rounds_from: decode batches from this many rows ask gate_up's GEMM for its bf16 result itself (smaller
    ones take fp32 into the SiLU).
    decode_split_k / decode_split_k_from: decode batches from split_k_from rows run each row-parallel GEMM as one
    batched dot over split_k ranges of K, compiled with XLA's own K splits off (so XLA splits no other GEMM); None:
    4 with the Pallas backends, 1 (XLA splits as it chooses) with the reference.
    decode_min_rows: decode steps run at least this many rows per replica (a power of two; the smallest decode
    bucket), the rest padding rows on the null slot, which route to no expert: XLA runs a one-row GEMM on slower
    tiles than a two-row one, and a lone request's step was faster beside a padding row than alone on the GEMV
    (bench/RESULTS.md), the padding row's GDN state traffic included.
    staged_inputs: each step's packed host inputs are first copied into a device buffer that keeps one address,
    so the step's CUDA graphs see unchanged input addresses.
    xla_options: XLA debug options for the step executables alone, as (name, value) pairs (a dict is accepted).
    """
    backend: str | None = None
    gdn_prefill: gdn.PrefillConfig = gdn.DEFAULT_PREFILL
    gdn_decode: gdn.DecodeConfig = gdn.DEFAULT_DECODE
    conv: conv1d.ConvConfig = conv1d.ConvConfig()
    decode_attention: paged_attention.DecodeAttentionConfig | None = paged_attention.DEFAULT
    attention_prologue: bool = True
    prefill_attention: prefill_attention.PrefillAttentionConfig | None = prefill_attention.DEFAULT
    expert_gemm: expert_gemm.ExpertGemmConfig | None = expert_gemm.DEFAULT
    gemv: gemv.GemvConfig | None = gemv.DEFAULT
    gate_up_rounds_from: int = 64
    decode_split_k: int | None = None
    decode_split_k_from: int = 64
    decode_min_rows: int = 2
    staged_inputs: bool = False
    xla_options: tuple = ()

    def __post_init__(self):
        if isinstance(self.xla_options, dict):
            object.__setattr__(self, "xla_options", tuple(sorted(self.xla_options.items())))
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"kernel backend must be one of {BACKENDS}, got {self.backend!r}")
        for name in ("gate_up_rounds_from", "decode_split_k_from"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.decode_min_rows < 1 or self.decode_min_rows & (self.decode_min_rows - 1):
            raise ValueError(f"decode_min_rows must be a power of two >= 1, got {self.decode_min_rows}")
        if self.decode_split_k is not None and self.decode_split_k < 1:
            raise ValueError(f"decode_split_k must be >= 1, got {self.decode_split_k}")
        for name, value in self.xla_options:
            if not name.startswith("xla_"):
                raise ValueError(f"xla_options: {name!r} is not an XLA option (xla_...)")

    def resolved(self) -> KernelConfig:
        """The configuration with its automatic choices made for this process (backend, split_k)."""
        backend = self.backend or ("pallas" if jax.default_backend() == "gpu" else "reference")
        if backend == "pallas" and jax.default_backend() != "gpu":
            raise ValueError(f"kernel backend 'pallas' needs a GPU (default backend is {jax.default_backend()!r}); "
                             "use 'pallas_interpret' or 'reference'")
        if self.attention_prologue and self.decode_attention is None and backend != "reference":
            raise ValueError("attention_prologue lays out the decode attention kernel's tiles: it needs "
                             "decode_attention (set attention_prologue=False to run the jnp attention)")
        split = self.decode_split_k or (1 if backend == "reference" else 4)
        return dataclasses.replace(self, backend=backend, decode_split_k=split)

    @classmethod
    def parse(cls, text: str, base: KernelConfig | None = None) -> KernelConfig:
        """'decode_split_k=1 gdn_decode.bv=32 xla_options.xla_gpu_enable_pdl=false' -> a KernelConfig: fields of
        `base` (default: the defaults) replaced by name, nested configurations by dotted names, values in their
        field's type ('none' for None). How benchmarks and the --kernel-config flag name variants."""
        config = base or cls()
        for item in text.replace(",", " ").split():
            name, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"kernel config: {item!r} is not <field>=<value>")
            config = _replace_path(config, name.split("."), value)
        return config

    def changes(self) -> str:
        """The fields that differ from the defaults (after resolving both), as KernelConfig.parse reads them."""
        base, this = dataclasses.asdict(KernelConfig(backend=self.backend).resolved()), dataclasses.asdict(self)
        out = []

        def walk(a, b, prefix):
            for k in b:
                if k == "xla_options":
                    out.extend(f"xla_options.{n}={v}" for n, v in b[k] if (n, v) not in a[k])
                elif isinstance(b[k], dict) and isinstance(a.get(k), dict):
                    walk(a[k], b[k], f"{prefix}{k}.")
                elif a.get(k) != b[k]:
                    out.append(f"{prefix}{k}={b[k]}")
        walk(base, this, "")
        return " ".join(out)

    def check(self, cfg: ModelConfig, layout: Layout, page_size: int):
        """Refuse, before anything is compiled, a model whose shapes this configuration's kernels cannot run."""
        backend = self.resolved().backend
        if backend == "reference":
            return
        problems = []
        for name, d in (("linear_key_head_dim", cfg.linear_key_head_dim),
                        ("linear_value_head_dim", cfg.linear_value_head_dim)):
            if d < 16 or d & (d - 1):
                problems.append(f"{name}={d} is not a power of two >= 16 (the GDN kernels' tiles)")
        if self.decode_attention is not None:
            for name, d in (("head_dim", cfg.head_dim), ("page_size", page_size)):
                if d & (d - 1):
                    problems.append(f"{name}={d} is not a power of two (the decode attention kernel's tiles)")
        if self.prefill_attention is not None and (cfg.head_dim & (cfg.head_dim - 1) or cfg.head_dim < 16):
            problems.append(f"head_dim={cfg.head_dim} is not a power of two >= 16 (the prefill attention kernel's "
                            "tiles)")
        if cfg.moe and self.expert_gemm is not None:
            g = self.expert_gemm
            tiles = sorted({g.block_n, g.block_k, g.copy_block_n, g.copy_block_k})    # the shared expert rides
            for name, d, ts in (("hidden_size", cfg.hidden_size, tiles),                  # both kernel pairs
                                ("moe_intermediate_size", cfg.moe_intermediate_size, tiles),
                                ("shared_expert_intermediate_size per rank", layout.shared_ffn, tiles)):
                fit = [min(t, d) for t in ts]               # the kernels' tiles shrink to a narrower width
                if d < 16 or any(f & (f - 1) or d % f for f in fit):
                    problems.append(f"{name}={d} does not split into the expert kernels' tiles {ts} (a power "
                                    "of two >= 16, or a multiple of the largest)")
        if cfg.conv_kernel < 2 or cfg.conv_kernel > self.conv.bt + 1:
            problems.append(f"linear_conv_kernel_dim={cfg.conv_kernel} is outside [2, {self.conv.bt + 1}] "
                            "(the conv kernel's tile)")
        if problems:
            raise ValueError(f"kernel backend {backend!r} cannot run this model: {'; '.join(problems)}. The "
                             "'reference' backend runs any shape (kernel_config=KernelConfig(backend='reference'), "
                             "--kernel-backend reference)")


def _coerce(text: str, current, hint: str):
    if text.lower() == "none":
        return None
    if isinstance(current, bool) or "bool" in hint:
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{text!r} is not a boolean")
        return text.lower() in ("true", "1")
    if isinstance(current, int) or "int" in hint:
        return int(text)
    if isinstance(current, float) or "float" in hint:
        return float(text)
    return text


def _replace_path(obj, path: list[str], value: str):
    """obj with the field at `path` set from the text `value` (nested frozen dataclasses are rebuilt)."""
    name, rest = path[0], path[1:]
    if name == "xla_options" and len(rest) == 1:
        low = value.lower()
        v = low == "true" if low in ("true", "false") else int(value) if value.lstrip("-").isdigit() else value
        return dataclasses.replace(obj, xla_options={**dict(obj.xla_options), rest[0]: v})
    fields = {f.name: f for f in dataclasses.fields(obj)}
    if name not in fields:
        raise ValueError(f"{type(obj).__name__} has no field {name!r} (fields: {', '.join(fields)})")
    current = getattr(obj, name)
    if rest:
        if current is None:      # a configuration that is off: its defaults, from the field's declared type
            kinds = typing.get_args(typing.get_type_hints(type(obj))[name])
            current = next((k() for k in kinds if dataclasses.is_dataclass(k)), None)
        if not dataclasses.is_dataclass(current):
            raise ValueError(f"{type(obj).__name__}.{name} has no fields")
        return dataclasses.replace(obj, **{name: _replace_path(current, rest, value)})
    if dataclasses.is_dataclass(current) and value.lower() != "none":
        raise ValueError(f"{type(obj).__name__}.{name} is a configuration: set its fields ({name}.<field>=...)")
    return dataclasses.replace(obj, **{name: _coerce(value, current, str(fields[name].type))})


def _reference(config: KernelConfig) -> Kernels:
    return Kernels(gdn_prefill=gdn_reference.gdn_prefill, gdn_decode=gdn_reference.gdn_decode_packed,
                   gdn_tokens=gdn_reference.gdn_decode_tokens_packed,
                   conv_prefill=conv1d_reference.conv_prefill, conv_decode=conv1d_reference.conv_decode,
                   attention_decode=decode_attention, gate_up_rounds_from=config.gate_up_rounds_from,
                   split_k=config.decode_split_k, split_k_from=config.decode_split_k_from)


def _pallas(config: KernelConfig, interpret: bool) -> Kernels:
    # Each kernel under its own jit: every layer calls it with the same shapes, so JAX traces and lowers it once
    # per executable instead of once per layer.
    p = lambda f, static=(), **kw: jax.jit(functools.partial(f, interpret=interpret, **kw), static_argnames=static)
    attention, prologue, tiles, prefill = decode_attention, None, None, prefill_attention_reference
    if config.prefill_attention is not None:
        prefill = p(prefill_attention.paged_prefill_attention, config=config.prefill_attention)
    if config.decode_attention is not None:
        attention = p(paged_attention.paged_decode_attention, config=config.decode_attention)
    if config.attention_prologue:
        tiles = jax.jit(functools.partial(paged_attention.attend_tiles, config=config.decode_attention,
                                          interpret=interpret), static_argnums=1)
        prologue = jax.jit(functools.partial(paged_attention.decode_prologue, interpret=interpret),
                           static_argnames=("q_heads", "rotary_dim", "theta", "eps"))
    experts, top_k = expert_gemm.routed_experts_reference, expert_gemm.router_top_k_reference
    if config.expert_gemm is not None:
        top_k = p(expert_gemm.router_top_k, static=("k",), num_warps=config.expert_gemm.router_num_warps)
        experts = functools.partial(_routed, per_copy=p(expert_gemm.routed_experts, config=config.expert_gemm),
                                    grouped=p(expert_gemm.sorted_experts, config=config.expert_gemm),
                                    copies_max=config.expert_gemm.copies_max)
    return Kernels(gdn_prefill=p(gdn.gdn_prefill, config=config.gdn_prefill),
                   gdn_decode=p(gdn.gdn_decode_packed, config=config.gdn_decode),
                   gdn_tokens=p(gdn.gdn_decode_tokens_packed, static=("write",), config=config.gdn_decode),
                   conv_prefill=p(conv1d.conv_prefill, static=("split",), config=config.conv),
                   conv_decode=p(conv1d.conv_decode),
                   attention_decode=attention, attention_prefill=prefill,
                   gate_up_rounds_from=config.gate_up_rounds_from,
                   split_k=config.decode_split_k, split_k_from=config.decode_split_k_from,
                   attention_prologue=prologue, attention_tiles=tiles, routed_experts=experts,
                   router_top_k=top_k,
                   prefill_head=None if config.gemv is None else p(gemv.gemv, static=("out_dtype",),
                                                                   config=config.gemv))


def _routed(x, experts, weights, w_gate_up, w_down, shared, *, per_copy, grouped, copies_max):
    """An MoE layer's experts by their static count of token copies: the per-copy kernels up to copies_max (small
    decode batches), the sorted grouped kernels past them (larger decode batches, verify, mixed and prefill
    steps)."""
    if experts.size <= copies_max:
        return per_copy(x, experts, weights, w_gate_up, w_down, shared)
    return grouped(x, experts, weights, w_gate_up, w_down, shared)


_MAKERS: dict[str, typing.Callable[[KernelConfig], Kernels]] = {
    "reference": _reference,
    "pallas": functools.partial(_pallas, interpret=False),
    "pallas_interpret": functools.partial(_pallas, interpret=True),
}


def make_kernels(config: KernelConfig) -> Kernels:
    """The model's operations for a resolved configuration (KernelConfig.resolved)."""
    return _MAKERS[config.backend](config)
