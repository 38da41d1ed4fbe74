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
from collections.abc import Mapping, Sequence
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


@dataclass(slots=True)
class SpecCache:
    """The tensor-spec section of the last manifest validated for one peer, with its result.

    Why: a peer's layout (dtypes, shapes, offsets) is the same from snapshot to
    snapshot while its skeleton (scheduler state, RNG) changes, and validating a
    few hundred specs in Python every step was most of the cost of receiving a
    snapshot header.  Reuse is exact: the section is compared byte for byte with
    the one validated before (and under the same arena size and limit), so
    anything that changed is parsed and validated again.
    """

    specs: bytes = b""  # the msgpack bytes of the validated spec list
    nbytes: int = -1  # the arena size they were checked against
    max_nbytes: int = -1  # the limit that arena size was checked against
    tensors: tuple[TensorSpec, ...] = ()  # what those bytes decoded to


# Manifest.encode of an unchanged layout: (the specs tuple, its msgpack bytes).  The snapshot store
# reuses one specs tuple while dtypes and shapes stay the same, so identity finds it; the entry holds
# a reference to the tuple (fully immutable), so no other tuple can take its id meanwhile.
_ENCODED_SPECS: tuple[tuple[TensorSpec, ...], bytes] | None = None
_ARRAY4 = b"\x94"  # msgpack header of a 4-element array: [skeleton, specs, nbytes, replicated]


def _encode_specs(tensors: tuple[TensorSpec, ...]) -> bytes:
    global _ENCODED_SPECS
    cached = _ENCODED_SPECS  # one read: another thread may rebind it, never mutate it
    if cached is not None and cached[0] is tensors:
        return cached[1]
    packed: bytes = msgpack.packb([[t.dtype, list(t.shape), t.offset, t.nbytes] for t in tensors], use_bin_type=True)
    _ENCODED_SPECS = (tensors, packed)
    return packed


def _check_specs(specs: Any, nbytes: int) -> tuple[TensorSpec, ...]:
    """Validate decoded tensor specs against an arena of `nbytes`.

    Raises:
        ValueError: malformed, an unknown dtype, or a tensor outside the arena.
    """
    if not isinstance(specs, list):
        raise ValueError("malformed manifest: wrong field types")
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
    return tuple(tensors)


@dataclass(frozen=True, slots=True)
class Manifest:
    """The layout of a snapshot: its skeleton and where each tensor sits."""

    skeleton: bytes  # msgpack structure with tensor references
    tensors: tuple[TensorSpec, ...]  # one entry per referenced tensor, by index
    nbytes: int  # arena size
    # The last `replicated` bytes of the arena hold tensors that are the same on every seat (data-parallel
    # parameters and their optimizer state).  Each seat's snapshot holds only its own 1/world slice of them
    # (``replicated_slice``); a restore gathers the slices from every seat.  0: every byte is this seat's.
    replicated: int = 0

    @property
    def replicated_at(self) -> int:
        """Where the replicated region starts in the arena."""
        return self.nbytes - self.replicated

    def encode(self) -> bytes:
        """msgpack ``[skeleton, specs, nbytes, replicated]``; the specs of an unchanged layout are packed once."""
        skeleton: bytes = msgpack.packb(self.skeleton, use_bin_type=True)
        tail: bytes = msgpack.packb(self.nbytes) + msgpack.packb(self.replicated)
        return b"".join((_ARRAY4, skeleton, _encode_specs(self.tensors), tail))

    @classmethod
    def decode(cls, data: bytes, max_nbytes: int, cache: SpecCache | None = None) -> Manifest:
        """Parse and bounds-check a manifest received from a peer.

        With `cache` (one per peer), a spec section byte-identical to the one
        validated last time for that peer is not parsed again (see ``SpecCache``);
        the cache then holds this manifest's section.

        Raises:
            ValueError: malformed, an unknown dtype, or a tensor outside the arena.
        """
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(1, len(data)))
        try:
            unpacker.feed(data)
            fields = unpacker.read_array_header()
            if fields not in (3, 4):  # 3: written before replicated regions existed (disk checkpoints)
                raise ValueError("malformed manifest: expected [skeleton, specs, nbytes, replicated]")
            skeleton = unpacker.unpack()
            start = unpacker.tell()
            unpacker.skip()  # the specs: located here, parsed below only when not validated before
            end = unpacker.tell()
            nbytes = unpacker.unpack()
            replicated = unpacker.unpack() if fields == 4 else 0
            if unpacker.tell() != len(data):
                raise ValueError("malformed manifest: trailing bytes")
        except (ValueError, TypeError, msgpack.UnpackException) as err:
            raise ValueError(f"malformed manifest: {err or type(err).__name__}") from None
        if not isinstance(skeleton, bytes) or not isinstance(nbytes, int) or not isinstance(replicated, int):
            raise ValueError("malformed manifest: wrong field types")
        if not 0 <= nbytes <= max_nbytes:
            raise ValueError(f"manifest declares {nbytes} bytes, limit is {max_nbytes}")
        if not 0 <= replicated <= nbytes:
            raise ValueError(f"manifest declares a replicated region of {replicated} bytes in an arena of {nbytes}")
        section = data[start:end]
        if cache is not None and cache.specs == section and cache.nbytes == nbytes \
                and cache.max_nbytes == max_nbytes:
            return cls(skeleton, cache.tensors, nbytes, replicated)
        try:
            specs = msgpack.unpackb(section, raw=False, strict_map_key=False)
        except (ValueError, TypeError, msgpack.UnpackException) as err:
            raise ValueError(f"malformed manifest: {err or type(err).__name__}") from None
        tensors = _check_specs(specs, nbytes)
        if cache is not None:
            cache.specs, cache.nbytes, cache.max_nbytes, cache.tensors = section, nbytes, max_nbytes, tensors
        return cls(skeleton, tensors, nbytes, replicated)


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


def _align(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def layout(
    tensors: Sequence[torch.Tensor], skeleton: bytes, replicated: Sequence[bool] = (), world: int = 1,
) -> Manifest:
    """Place `tensors` in an arena, each aligned to ALIGN bytes.

    Tensors flagged in `replicated` go last, in one region padded to `world` equal,
    aligned slices (see ``replicated_slice``).
    """
    flags = list(replicated) or [False] * len(tensors)
    specs: dict[int, TensorSpec] = {}
    offset = 0

    def place(indices: list[int]) -> None:
        nonlocal offset
        for index in indices:
            tensor = tensors[index]
            nbytes = tensor.numel() * tensor.element_size()
            specs[index] = TensorSpec(str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, nbytes)
            offset += _align(nbytes)

    place([i for i, flag in enumerate(flags) if not flag])
    region_start = offset
    place([i for i, flag in enumerate(flags) if flag])
    region = _align(-(-(offset - region_start) // world)) * world if offset > region_start else 0
    return Manifest(skeleton, tuple(specs[i] for i in range(len(tensors))), region_start + region, region)


def replicated_slice(manifest: Manifest, seat: int, world: int) -> tuple[int, int]:
    """The arena byte range of the replicated region that `seat`'s snapshot holds."""
    chunk = manifest.replicated // world
    start = manifest.replicated_at + seat * chunk
    return start, start + chunk


def replicated_layout(manifest: Manifest) -> tuple[int, tuple[tuple[str, tuple[int, ...], int], ...]]:
    """The replicated region's size and its tensors (dtype, shape, offset in the region): the same on every seat
    of a job, though the region starts at another offset where the seats' own states differ in size (ZeRO)."""
    start = manifest.replicated_at
    inside = sorted((t.offset - start, t.dtype, t.shape) for t in manifest.tensors if t.offset >= start and t.nbytes)
    return manifest.replicated, tuple((dtype, shape, offset) for offset, dtype, shape in inside)


def held_ranges(manifest: Manifest, seat: int, world: int) -> list[tuple[int, int]]:
    """The arena byte ranges `seat`'s snapshot holds, in order: all of it, or, with a replicated
    region, the seat's own state and then its slice of the region (empty ranges left out).
    What a buddy is streamed, and where a restore puts those bytes back."""
    if not manifest.replicated or world < 2:
        return [(0, manifest.nbytes)]
    ranges = [(0, manifest.replicated_at), replicated_slice(manifest, seat, world)]
    return [(start, end) for start, end in ranges if end > start]


def held_nbytes(manifest: Manifest, seat: int, world: int) -> int:
    """The size of what `seat`'s snapshot holds: its arena is exactly this (the held ranges, packed)."""
    return sum(end - start for start, end in held_ranges(manifest, seat, world))


def scatter(frames: Sequence[memoryview], places: list[tuple[int, int]], target: memoryview) -> None:
    """Copy the bytes of `frames`, in order, into the `places` (non-empty byte ranges) of `target`, in order.

    Raises:
        ValueError: the frames hold more bytes than the places.
    """
    ranges = iter(places)
    position, end = next(ranges, (0, 0))
    for frame in frames:
        done = 0
        while done < len(frame):
            count = min(len(frame) - done, end - position)
            if count <= 0:
                raise ValueError("more bytes than places to put them")
            target[position : position + count] = frame[done : done + count]
            position, done = position + count, done + count
            if position == end:
                position, end = next(ranges, (end, end))


def expand(manifest: Manifest, frames: Sequence[memoryview], seat: int, world: int) -> torch.Tensor:
    """A full arena (``manifest.nbytes``) with what `seat`'s snapshot holds put back in place.

    The other seats' slices of the replicated region are left unset: a restore gathers them.

    Raises:
        LookupError: the frames are not the size of what the seat's snapshot holds.
    """
    places = held_ranges(manifest, seat, world)
    total, expected = sum(len(frame) for frame in frames), sum(end - start for start, end in places)
    if total != expected:
        raise LookupError(f"seat {seat}'s snapshot: {total} bytes where it holds {expected}")
    arena = torch.empty(max(manifest.nbytes, 1), dtype=torch.uint8)
    scatter(frames, places, arena.numpy().data.cast("B"))
    return arena


def view_tensor(arena: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The arena bytes of one tensor, viewed with its dtype and shape (no copy)."""
    return arena[spec.offset : spec.offset + spec.nbytes].view(_DTYPES[spec.dtype]).view(spec.shape)


def materialize(manifest: Manifest, arena: torch.Tensor, keep: Mapping[int, torch.Tensor] | None = None) -> Any:
    """The state a manifest describes, with fresh tensors cloned out of the arena.

    `keep`: tensors, by index, that are taken as they are instead (live tensors known to hold
    the snapshot's values); the arena's bytes for them are not read.
    """
    keep = keep or {}
    return unflatten(manifest.skeleton, [keep[i] if i in keep else view_tensor(arena, spec).clone()
                                         for i, spec in enumerate(manifest.tensors)])


def same_layout(manifest: Manifest, tensors: Sequence[torch.Tensor], ignore: torch.Tensor | None = None) -> bool:
    """`tensors` (a flattened state) have the dtypes and shapes the manifest's tensors have, in order, but for
    `ignore`, one of them whose shape may differ."""
    return len(tensors) == len(manifest.tensors) and all(
        t is ignore or (str(t.dtype).removeprefix("torch.") == spec.dtype and tuple(t.shape) == spec.shape)
        for t, spec in zip(tensors, manifest.tensors, strict=True))


def state_digest(state: Any) -> str:
    """SHA-256 over a state's structure and the bytes of every tensor in it."""
    skeleton, tensors = flatten(state)
    hasher = hashlib.sha256(skeleton)
    for tensor in tensors:
        data = tensor.detach().cpu().contiguous()
        hasher.update(str(tuple(data.shape)).encode())
        hasher.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()
