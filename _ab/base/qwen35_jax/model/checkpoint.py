"""Read tensor slices from HF safetensors checkpoints without loading whole files.

safetensors' numpy backend cannot slice bf16 tensors, so this reads the (tiny, documented) header itself and
memory-maps exactly the slice asked for: a rank that needs rows [a, b) of a tensor touches only those bytes.
Keys are normalised to the text decoder's names (`embed_tokens.weight`, `layers.N...`, `norm.weight`,
`lm_head.weight`, the MTP head's `mtp.*` as they are); the vision tower (`model.visual.*`) is skipped.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import struct

import ml_dtypes
import numpy as np

DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
          "I32": np.int32, "I64": np.int64, "U8": np.uint8, "I8": np.int8, "BOOL": np.bool_}
PREFIXES = ("model.language_model.", "model.")
SKIPPED = ("model.visual.", "visual.")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    path: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int          # absolute byte offset of the tensor data in the file


def _read_header(path: str) -> dict[str, TensorInfo]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    out = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        if meta["dtype"] not in DTYPES:
            raise ValueError(f"{path}: tensor {key!r} has unsupported dtype {meta['dtype']}")
        out[key] = TensorInfo(path, np.dtype(DTYPES[meta["dtype"]]), tuple(meta["shape"]),
                              8 + n + meta["data_offsets"][0])
    return out


def normalize_key(key: str) -> str | None:
    """Checkpoint key -> text-decoder key, or None for tensors that are not part of the language model."""
    if key.startswith(SKIPPED):
        return None
    for prefix in PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


class Checkpoint:
    """The tensors of a model directory: `model.safetensors`, or shards listed in `model.safetensors.index.json`.
    MoE experts stored one by one (`mlp.experts.{j}.{gate,up,down}_proj.weight`) are also seen as the fused
    tensors of the other layout, `mlp.experts.gate_up_proj` [E, 2 Im, H] and `mlp.experts.down_proj` [E, H, Im],
    read expert by expert."""

    def __init__(self, model_dir: str):
        index = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(p for p in os.listdir(model_dir) if p.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {model_dir!r}")
        self.tensors: dict[str, TensorInfo] = {}
        for name in files:
            path = os.path.join(model_dir, name)
            if not os.path.exists(path):
                raise FileNotFoundError(f"{path} is listed in model.safetensors.index.json but missing")
            for key, info in _read_header(path).items():
                norm = normalize_key(key)
                if norm is not None:
                    self.tensors[norm] = info
        self.fused: dict[str, tuple[int, int, int]] = {}     # fused key -> its [E, rows, cols] from per-expert keys
        experts: dict[str, set] = {}
        for key in self.tensors:
            m = EXPERT.match(key)
            if m:
                experts.setdefault(m.group(1), set()).add(int(m.group(2)))
        for prefix, ids in experts.items():
            e = len(ids)
            if ids != set(range(e)):
                raise ValueError(f"{prefix}: expert indices are not 0..{e - 1}")
            im, h = self.tensors[f"{prefix}.0.gate_proj.weight"].shape
            self.fused[f"{prefix}.gate_up_proj"] = (e, 2 * im, h)
            self.fused[f"{prefix}.down_proj"] = (e, h, im)

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.fused

    def shape(self, key: str) -> tuple[int, ...]:
        return self.fused[key] if key in self.fused else self.tensors[key].shape

    def read(self, key: str, axis: int = 0, start: int = 0, stop: int | None = None) -> np.ndarray:
        """A copy of tensor[..., start:stop, ...] along `axis`, in the file's dtype (fused experts: along the
        expert axis, each expert read on its own)."""
        if key in self.fused:
            if axis != 0:
                raise ValueError(f"{key}: experts stored one by one are read along the expert axis only")
            prefix, e = key.rsplit(".", 1)[0], self.fused[key][0]
            parts = [[f"{prefix}.{j}.gate_proj.weight", f"{prefix}.{j}.up_proj.weight"]
                     if key.endswith("gate_up_proj") else [f"{prefix}.{j}.down_proj.weight"]
                     for j in range(*slice(start, stop).indices(e))]
            return np.stack([np.concatenate([self.read(k) for k in ks], axis=0) for ks in parts])
        info = self.tensors[key]
        mm = np.memmap(info.path, dtype=info.dtype, mode="r", offset=info.offset, shape=info.shape)
        index = [slice(None)] * len(info.shape)
        index[axis] = slice(start, stop)
        out = np.array(mm[tuple(index)])
        del mm
        return out


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None):
    """Write numpy arrays (bf16 via ml_dtypes included) in the safetensors format."""
    names = {np.dtype(v): k for k, v in DTYPES.items()}
    header, offset = {}, 0
    for key, arr in tensors.items():
        n = arr.nbytes
        header[key] = {"dtype": names[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())
