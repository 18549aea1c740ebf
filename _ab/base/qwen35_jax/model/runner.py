"""Owns the device side: mesh, weights, state pools, and the jitted SPMD forward (state donated every call)."""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from qwen35_jax.model.config import ModelConfig
from qwen35_jax.model.forward import Batch, Kernels, make_forward
from qwen35_jax.model.sharding import Layout
from qwen35_jax.model.state import State, abstract_state, init_state, state_specs
from qwen35_jax.model.weights import abstract_weights, weight_specs

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, cfg: ModelConfig, mesh: Mesh, layout: Layout, weights, dtype, kernels: Kernels, *,
                 num_slots: int, num_pages: int, page_size: int):
        self.cfg, self.mesh, self.layout, self.weights, self.dtype = cfg, mesh, layout, weights, dtype
        self.page_size, self.num_slots, self.num_pages = page_size, num_slots, num_pages
        self.kernels = kernels
        self.abstract_state = abstract_state(cfg, self.layout, num_slots, num_pages, page_size, dtype)
        self.state: State = init_state(self.abstract_state, mesh)
        self._w_specs = weight_specs(abstract_weights(cfg, self.layout, dtype))
        self._s_specs = state_specs(self.abstract_state)
        self._forward = {}

    def forward_fn(self, all_logits: bool):
        if all_logits not in self._forward:
            fn = make_forward(self.cfg, self.layout, self.mesh, self.kernels, self._w_specs, self._s_specs, all_logits)
            self._forward[all_logits] = jax.jit(fn, donate_argnums=(1,))
        return self._forward[all_logits]

    def run(self, batch: Batch, all_logits: bool = False):
        """One forward over the batch; the state is replaced by the new state. Returns the global logits array
        ([N, T, V'] or [N, V'], vocab padding masked to -inf)."""
        logits, self.state = self.forward_fn(all_logits)(self.weights, self.state, batch)
        return logits


def make_batch(tokens, start, lens, slots, pages) -> Batch:
    as_i32 = lambda x: jnp.asarray(np.asarray(x, np.int32))
    return Batch(tokens=as_i32(tokens), start=as_i32(start), lens=as_i32(lens), slots=as_i32(slots),
                 pages=as_i32(pages))
