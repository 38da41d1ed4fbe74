"""Split tracked state into a small skeleton and a list of tensors, and join it back.

A snapshot is "everything needed to continue": the ``state_dict()`` of every
tracked object plus RNG states.  Those are nested dicts, lists and tuples of
plain values with tensors inside.  The skeleton is the structure with every
tensor replaced by its index, encoded with msgpack (tuples and tensor
references as extension types); the tensors go into a flat arena.  No pickle
anywhere: a skeleton holding something else is refused with a clear error.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from deadpool.errors import MisuseError

_EXT_TENSOR = 1
_EXT_TUPLE = 2
ALIGN = 64  # every tensor starts on a cache line in the arena

_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
        torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    )
}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Where one tensor lives in the arena."""

    dtype: str  # torch dtype name, e.g. "float32"
    shape: tuple[int, ...]  # tensor shape
    offset: int  # byte offset in the arena
    nbytes: int  # byte length


@dataclass(frozen=True, slots=True)
class Manifest:
    """The layout of a snapshot: its skeleton and where each tensor sits."""

    skeleton: bytes  # msgpack structure with tensor references
    tensors: tuple[TensorSpec, ...]  # one entry per referenced tensor, by index
    nbytes: int  # arena size

    def encode(self) -> bytes:
        specs = [[t.dtype, list(t.shape), t.offset, t.nbytes] for t in self.tensors]
        packed: bytes = msgpack.packb([self.skeleton, specs, self.nbytes], use_bin_type=True)
        return packed

    @classmethod
    def decode(cls, data: bytes, max_nbytes: int) -> Manifest:
        """Parse and bounds-check a manifest received from a peer.

        Raises:
            ValueError: malformed, an unknown dtype, or a tensor outside the arena.
        """
        try:
            skeleton, specs, nbytes = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as err:
            raise ValueError(f"malformed manifest: {err}") from None
        if not isinstance(skeleton, bytes) or not isinstance(specs, list) or not isinstance(nbytes, int):
            raise ValueError("malformed manifest: wrong field types")
        if not 0 <= nbytes <= max_nbytes:
            raise ValueError(f"manifest declares {nbytes} bytes, limit is {max_nbytes}")
        tensors = []
        for spec in specs:
            if not (isinstance(spec, list) and len(spec) == 4):
                raise ValueError("malformed tensor spec")
            dtype, shape, offset, size = spec
            if dtype not in _DTYPES:
                raise ValueError(f"unknown dtype {dtype!r}")
            if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
                raise ValueError("bad tensor shape")
            if not (isinstance(offset, int) and isinstance(size, int) and offset >= 0 and offset + size <= nbytes):
                raise ValueError("tensor lies outside the arena")
            numel = 1
            for d in shape:
                numel *= d
            if numel * _DTYPES[dtype].itemsize != size:
                raise ValueError("tensor size does not match its shape")
            tensors.append(TensorSpec(dtype, tuple(shape), offset, size))
        return cls(skeleton, tuple(tensors), nbytes)


_TENSOR_REFS: list[msgpack.ExtType] = []  # the reference to tensor i, made once (flatten runs every step)


def _tensor_ref(index: int) -> msgpack.ExtType:
    global _TENSOR_REFS
    refs = _TENSOR_REFS
    if index >= len(refs):  # grow by rebinding, so a concurrent reader never sees a half-built list
        refs = refs + [msgpack.ExtType(_EXT_TENSOR, msgpack.packb(i)) for i in range(len(refs), 2 * index + 16)]
        _TENSOR_REFS = refs
    return refs[index]


def flatten(state: Any) -> tuple[bytes, list[torch.Tensor]]:
    """Encode `state`'s structure; return it with the tensors it references, in order.

    Raises:
        MisuseError: the state holds a value that is not plain data or a tensor.
    """
    tensors: list[torch.Tensor] = []

    def default(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
            return _tensor_ref(len(tensors) - 1)
        if isinstance(obj, tuple):
            return msgpack.ExtType(_EXT_TUPLE, msgpack.packb(list(obj), default=default, strict_types=True))
        if isinstance(obj, bool):
            return bool(obj)
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, float):
            return float(obj)
        if isinstance(obj, str):
            return str(obj)
        if isinstance(obj, dict):
            return dict(obj)
        if isinstance(obj, list):
            return list(obj)
        raise MisuseError(
            f"cannot snapshot a value of type {type(obj).__name__}: tracked state_dict()s may hold only "
            "tensors, numbers, strings, None and lists/tuples/dicts of them"
        )

    skeleton: bytes = msgpack.packb(state, default=default, strict_types=True, use_bin_type=True)
    return skeleton, tensors


def unflatten(skeleton: bytes, tensors: Sequence[torch.Tensor]) -> Any:
    """Rebuild the structure, putting `tensors` back where they were referenced."""

    def ext_hook(code: int, data: bytes) -> Any:
        if code == _EXT_TENSOR:
            return tensors[msgpack.unpackb(data)]
        if code == _EXT_TUPLE:
            return tuple(msgpack.unpackb(data, ext_hook=ext_hook, raw=False, strict_map_key=False))
        raise ValueError(f"unknown extension type {code} in snapshot skeleton")

    return msgpack.unpackb(skeleton, ext_hook=ext_hook, raw=False, strict_map_key=False)


def layout(tensors: Sequence[torch.Tensor], skeleton: bytes) -> Manifest:
    """Place `tensors` in an arena, each aligned to ALIGN bytes."""
    specs = []
    offset = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        specs.append(TensorSpec(str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, nbytes))
        offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return Manifest(skeleton, tuple(specs), offset)


def view_tensor(arena: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The arena bytes of one tensor, viewed with its dtype and shape (no copy)."""
    return arena[spec.offset : spec.offset + spec.nbytes].view(_DTYPES[spec.dtype]).view(spec.shape)


def materialize(manifest: Manifest, arena: torch.Tensor) -> Any:
    """The state a manifest describes, with fresh tensors cloned out of the arena."""
    return unflatten(manifest.skeleton, [view_tensor(arena, spec).clone() for spec in manifest.tensors])


def digest(manifest: Manifest, arena: torch.Tensor) -> str:
    """SHA-256 over the structure and every tensor's bytes (padding excluded)."""
    hasher = hashlib.sha256(manifest.skeleton)
    for spec in manifest.tensors:
        hasher.update(str(spec.shape).encode())
        hasher.update(arena[spec.offset : spec.offset + spec.nbytes].numpy().tobytes())
    return hasher.hexdigest()
