"""Which implementation of the GDN / conv operations the model runs (`kernel_backend`).

"reference": the pure-jnp references (any platform); "pallas": the Pallas-Triton kernels, compiled (GPU only);
"pallas_interpret": the same kernels in Pallas interpret mode (any platform; slow, for tests).
"""
from __future__ import annotations

import functools
import logging

import jax

from pallas_kernels import conv1d, conv1d_reference, gdn, gdn_reference
from qwen35_jax.model import Kernels

log = logging.getLogger(__name__)
BACKENDS = ("reference", "pallas", "pallas_interpret")


def reference_kernels() -> Kernels:
    return Kernels(gdn_prefill=gdn_reference.gdn_prefill, gdn_decode=gdn_reference.gdn_decode,
                   conv_prefill=conv1d_reference.conv_prefill, conv_decode=conv1d_reference.conv_decode)


def pallas_kernels(interpret: bool) -> Kernels:
    p = lambda f: functools.partial(f, interpret=interpret)
    return Kernels(gdn_prefill=p(gdn.gdn_prefill), gdn_decode=p(gdn.gdn_decode),
                   conv_prefill=p(conv1d.conv_prefill), conv_decode=p(conv1d.conv_decode))


def default_backend() -> str:
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
