"""DTensor's sharding decisions, carried in a seat's snapshot so that a spare's first step is not a cold one.

DTensor decides, per op and per placements and global shapes of its arguments, how to run it on
the shards (sharding propagation), and keeps each decision for the life of the process: a fresh
process makes all of them in its first step, about 0.4 s of the sharded demo's first step here
(its gradient clipping and optimizer step most). The decisions are the same on every seat (every
seat must issue the same collectives) and hold no seat's coordinates, only the mesh. So every
seat records those it makes, its snapshots carry them (msgpack of torch's few plain types, a
mesh as its dimension names; never pickle), and a process that loads a snapshot takes the ones
it lacks: a spare's first step uses its seat's old member's. A decision that does not encode (a
placement holding data, a mesh from elsewhere) is left out and made again where needed.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from typing import Any

import msgpack
import torch
from torch.distributed.device_mesh import DeviceMesh

from deadpool.worker.patches import PATCHES, SHARDING_CACHE, SHARDING_DECISIONS

log = logging.getLogger("deadpool")

MAX_ENTRIES = 8192  # decisions carried; a script with ever-new shapes keeps the first ones
MAX_BYTES = 16 << 20  # the encoded decisions in one snapshot


class Unencodable(ValueError):
    """A decision holds a value outside the types this module carries."""


_MESH = 8  # a mesh, as its dimension names (the other extension codes: _table)


class Decisions:
    """This process's record of DTensor's decisions, and those taken from a snapshot, over one mesh."""

    def __init__(self, root: DeviceMesh) -> None:
        from torch.distributed.tensor._sharding_prop import LocalLRUCache

        self._root = root
        self._meshes: dict[tuple[str, ...], DeviceMesh] = {}  # the root and its slices, by dimension names
        self._recorded: dict[Any, Any] = {}  # OpSchema -> OutputSharding, made or used here
        self._taken: dict[Any, Any] = {}  # from a snapshot, not yet used here
        self._encoded: list[bytes] = []  # self._recorded's entries, encoded, in order (those that encode)
        self._seen = 0  # entries of self._recorded looked at for encoding
        self.taken = 0  # decisions taken from snapshots in this process's life
        self._loads_made = False
        self._blob: torch.Tensor | None = None
        self._compute: Callable[[Any], Any] = PATCHES.original(SHARDING_DECISIONS)
        # DTensor's C++ dispatch calls the uncached method on its own cache's misses; the Python cache wraps it.
        # The newest mesh's decisions are the process's.
        PATCHES.install(SHARDING_DECISIONS, lambda original: self._decide, renew=True)
        PATCHES.install(SHARDING_CACHE, lambda original: LocalLRUCache(self._decide), renew=True)

    def _decide(self, schema: Any) -> Any:
        from torch.distributed._functional_collectives import _are_we_tracing

        if _are_we_tracing():  # symbolic shapes: torch does not cache these either
            return self._compute(schema)
        decision = self._taken.pop(schema, None)
        if decision is None:
            decision = self._compute(schema)
        if len(self._recorded) < MAX_ENTRIES:
            self._recorded[schema] = decision
        return decision

    def snapshot_entry(self) -> dict[str, Any] | None:
        """What a snapshot carries: the number of decisions and their encoding (re-encoded only when new ones
        were made); None before the first."""
        if self._seen < len(self._recorded):
            for schema, decision in list(self._recorded.items())[self._seen:]:
                try:
                    self._encoded.append(msgpack.packb([self._encode(schema), self._encode(decision)]))
                except Unencodable as err:
                    log.debug("a DTensor decision is not carried in snapshots: %s", err)
            self._seen = len(self._recorded)
            blob = msgpack.packb(self._encoded)
            self._blob = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if len(blob) <= MAX_BYTES else None
        if self._blob is None:
            return None
        return {"torch": str(torch.__version__), "entries": len(self._encoded), "msgpack": self._blob}

    def make_load_decisions(self, objects: Iterable[object]) -> None:
        """Once: the decisions a restore's ``load_state_dict`` will ask of DTensor (a copy into each layout of the
        modules' DTensors), made by copying one DTensor of each layout onto itself (its data untouched), so that a
        spare's restore takes them with the rest instead of making them while the survivors wait for it."""
        if self._loads_made:
            return
        self._loads_made = True
        from torch.distributed.tensor import DTensor

        layouts = set()
        with torch.no_grad():
            for obj in objects:
                if isinstance(obj, torch.nn.Module):
                    for value in obj.state_dict().values():
                        if isinstance(value, DTensor) and value._spec not in layouts:
                            layouts.add(value._spec)
                            value.copy_(value)

    def take(self, entry: dict[str, Any] | None) -> int:
        """Take the decisions of a snapshot's entry that this process has not made; return how many."""
        if entry is None or entry["entries"] <= len(self._recorded):
            return 0  # a survivor's own snapshot: it made these already
        if entry.get("torch") != str(torch.__version__):
            return 0  # another torch's rules (a checkpoint resumed after an upgrade): made again
        taken = 0
        try:
            items = msgpack.unpackb(entry["msgpack"].numpy().tobytes())
            if not isinstance(items, list):
                raise Unencodable(f"a {type(items).__name__}, not a list")
        except ValueError as err:  # msgpack's errors are ValueErrors
            log.warning("the DTensor decisions in a snapshot do not decode (%s): they will be made again", err)
            return 0
        for item in items:
            try:
                schema, decision = (msgpack.unpackb(part, ext_hook=self._ext_hook, strict_map_key=True)
                                    for part in msgpack.unpackb(item))
            except (ValueError, TypeError, KeyError, AttributeError) as err:
                log.debug("a DTensor decision in the snapshot is not taken: %s", err)
                continue
            if schema not in self._recorded:
                self._taken[schema] = decision
                taken += 1
        self.taken += taken
        return taken

    # ----- encoding: a whitelist of torch's plain types -----

    def _encode(self, obj: Any) -> bytes:
        encoded: bytes = msgpack.packb(obj, default=self._default, strict_types=True, use_bin_type=True)
        return encoded

    def _default(self, obj: Any) -> msgpack.ExtType:
        if type(obj) is DeviceMesh:
            if obj.mesh_dim_names is None or obj._get_root_mesh() is not self._root:
                raise Unencodable("a mesh other than rt.device_mesh's or its dimensions'")
            return msgpack.ExtType(_MESH, self._encode(list(obj.mesh_dim_names)))
        known = _codecs().get(type(obj))
        if known is None:
            raise Unencodable(f"a value of type {type(obj).__qualname__}")
        return msgpack.ExtType(known[0], self._encode(known[1](obj)))

    def _ext_hook(self, code: int, data: bytes) -> Any:
        fields = msgpack.unpackb(data, ext_hook=self._ext_hook, strict_map_key=True)
        if code == _MESH:
            names = tuple(fields)
            if names not in self._meshes:  # slicing a mesh builds a new one: 0.3 ms each
                self._meshes[names] = self._root if names == self._root.mesh_dim_names else self._root[names]
            return self._meshes[names]
        decode = _decoders().get(code)
        if decode is None:
            raise Unencodable(f"msgpack extension type {code}")
        return decode(fields)


def _named(module: Any, kind: type) -> Callable[[str], Any]:
    """Decode a torch constant by its name (``torch.float32``), refusing any other attribute."""
    def decode(name: str) -> Any:
        value = getattr(module, name)
        if not isinstance(value, kind):
            raise Unencodable(f"{name} is not a {kind.__name__}")
        return value
    return decode


def _operator(fields: list[str]) -> Any:
    namespace, name = fields[0].split("::")
    op = getattr(getattr(getattr(torch.ops, namespace), name), fields[1])
    if not isinstance(op, torch._ops.OpOverload):
        raise Unencodable(f"torch.ops.{namespace}.{name}.{fields[1]} is not an operator")
    return op


@functools.cache
def _table() -> list[tuple[type, int, Callable[[Any], Any], Callable[[Any], Any]]]:
    """Each carried type: its extension code, its fields, and how to build it from them."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema, OutputSharding, RuntimeSchemaInfo
    from torch.distributed.tensor._ops._math_ops import _NormPartial
    from torch.distributed.tensor.placement_types import _StridedShard

    def name(obj: Any) -> str:
        return str(obj).removeprefix("torch.")

    return [
        (tuple, 1, list, tuple),
        (torch.Size, 2, list, torch.Size),
        (torch.dtype, 3, name, _named(torch, torch.dtype)),
        (torch.device, 4, str, torch.device),
        (torch.memory_format, 5, name, _named(torch, torch.memory_format)),
        (torch.layout, 6, name, _named(torch, torch.layout)),
        (torch._ops.OpOverload, 7, lambda op: [op._schema.name, op._overloadname], _operator),
        (DTensorSpec, 9, lambda s: [s.mesh, s.placements, s.tensor_meta, s.shard_order,
                                    s.use_strided_shard_as_shard_order],
         lambda f: DTensorSpec(f[0], f[1], tensor_meta=f[2], shard_order=f[3],
                               use_strided_shard_as_shard_order=f[4])),
        (TensorMeta, 10, lambda m: [m.shape, tuple(m.stride), m.dtype], lambda f: TensorMeta(*f)),
        (Shard, 11, lambda p: p.dim, Shard),
        (_StridedShard, 12, lambda p: [p.dim, p.split_factor], lambda f: _StridedShard(f[0], split_factor=f[1])),
        (Replicate, 13, lambda p: None, lambda f: Replicate()),
        (Partial, 14, lambda p: p.reduce_op, Partial),
        (_NormPartial, 15, lambda p: p.norm_type, _NormPartial),
        (ShardOrderEntry, 16, lambda e: [e.tensor_dim, tuple(e.mesh_dims)], lambda f: ShardOrderEntry(*f)),
        (OpSchema, 17, lambda s: [s.op, s.args_schema, s.kwargs_schema, s.schema_info],
         lambda f: OpSchema(f[0], f[1], f[2], schema_info=f[3])),
        (RuntimeSchemaInfo, 18, lambda i: [i.static_argnum, i.static_kwargkey, i.needs_pytree],
         lambda f: RuntimeSchemaInfo(*f)),
        (OutputSharding, 19, lambda o: [o.output_spec, o.redistribute_schema, o.needs_redistribute,
                                        o.use_val_from_redistribute_schema], lambda f: OutputSharding(*f)),
    ]


@functools.cache
def _codecs() -> dict[type, tuple[int, Callable[[Any], Any]]]:
    return {kind: (code, fields) for kind, code, fields, _ in _table()}


@functools.cache
def _decoders() -> dict[int, Callable[[Any], Any]]:
    return {code: build for _, code, _, build in _table()}
