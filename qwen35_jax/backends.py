"""Which implementation of the GDN / conv operations the model runs (`kernel_backend`)."""
from __future__ import annotations

import logging

import jax

from pallas_kernels import conv1d_reference, gdn_reference
from qwen35_jax.model import Kernels

log = logging.getLogger(__name__)
BACKENDS = ("reference", "pallas", "pallas_interpret")


def reference_kernels() -> Kernels:
    return Kernels(gdn_prefill=gdn_reference.gdn_prefill, gdn_decode=gdn_reference.gdn_decode,
                   conv_prefill=conv1d_reference.conv_prefill, conv_decode=conv1d_reference.conv_decode)


def default_backend() -> str:
    return "reference"


def get_kernels(name: str | None) -> tuple[str, Kernels]:
    name = name or default_backend()
    if name not in BACKENDS:
        raise ValueError(f"kernel_backend must be one of {BACKENDS}, got {name!r}")
    if name == "reference":
        return name, reference_kernels()
    raise ValueError(f"kernel_backend {name!r} is not available yet")
