"""The one place where messages become bytes and bytes become messages.

Frame layout (all integers big-endian)::

    b"DP" | version:u8 | flags:u8 | msgpack([tag, [field, ...]]) | hmac-sha256 (32 bytes, if flags & 1)

Decoding never raises for bad input: it returns a :class:`DecodeError` that
says what was wrong, which the caller logs (as a ``rejected`` event) and drops.
Every field is checked against the dataclass annotation, sizes are bounded
before msgpack sees the bytes, and no pickle is ever involved.
"""

from __future__ import annotations

import dataclasses
import enum
import hmac
import itertools
import operator
import types
import typing
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Union

import msgpack

from deadpool.protocol.messages import PROTOCOL_VERSION, REGISTRY, REPEATED, TAGS, Message
from deadpool.protocol.view import View

MAGIC = b"DP"
FLAG_HMAC = 0x01
HEADER_BYTES = 4
MAC_BYTES = 32
DEFAULT_MAX_FRAME_BYTES = 1 << 20  # control messages are small; snapshots travel as raw frames


@dataclass(frozen=True, slots=True)
class DecodeError:
    """Why a frame was refused; never raised, returned for the caller to log."""

    reason: str  # short machine-readable kind: too_large, bad_magic, bad_version, bad_mac, ...
    detail: str  # human-readable explanation

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


class _FieldError(Exception):
    """Internal: a field failed validation (turned into a DecodeError at the top)."""


Checker = Callable[[Any], Any]


def _checker_for(annotation: Any) -> Checker:
    """Build a function that validates (and converts) a decoded value for `annotation`."""
    origin = typing.get_origin(annotation)
    if annotation is int:
        def check_int(value: Any) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise _FieldError(f"expected int, got {type(value).__name__}")
            return value
        return check_int
    if annotation is float:
        def check_float(value: Any) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise _FieldError(f"expected float, got {type(value).__name__}")
            return float(value)
        return check_float
    if annotation in (str, bool, bytes):
        def check_exact(value: Any) -> Any:
            if type(value) is not annotation:
                raise _FieldError(f"expected {annotation.__name__}, got {type(value).__name__}")
            return value
        return check_exact
    if isinstance(annotation, type) and issubclass(annotation, enum.StrEnum):
        members = {member.value: member for member in annotation}

        def check_enum(value: Any) -> Any:
            if type(value) is not str or value not in members:
                raise _FieldError(f"expected one of {', '.join(members)}, got {value!r}")
            return members[value]
        return check_enum
    if annotation is type(None):
        def check_none(value: Any) -> None:
            if value is not None:
                raise _FieldError(f"expected None, got {type(value).__name__}")
        return check_none
    if origin in (Union, types.UnionType):
        options = [_checker_for(arg) for arg in typing.get_args(annotation)]

        def check_union(value: Any) -> Any:
            for option in options:
                try:
                    return option(value)
                except _FieldError:
                    continue
            raise _FieldError(f"value of type {type(value).__name__} matches no option of {annotation}")
        return check_union
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        check_item = _checker_for(item_type)
        items_exact = _all_exactly(item_type)  # the columns of a HostHeartbeat or an AckBatch: a few C passes

        def check_list(value: Any) -> list[Any]:
            if not isinstance(value, list):
                raise _FieldError(f"expected list, got {type(value).__name__}")
            if items_exact is not None and type(value) is list and items_exact(value):
                return value
            return [check_item(item) for item in value]  # raises for the first bad item (an int becomes a float)
        return check_list
    if origin is dict:
        key_type, value_type = typing.get_args(annotation)
        check_key, check_value = _checker_for(key_type), _checker_for(value_type)
        exact = _all_exactly(annotation)  # a PrepareAck's ward steps, a view's addresses

        def check_dict(value: Any) -> dict[Any, Any]:
            if not isinstance(value, dict):
                raise _FieldError(f"expected map, got {type(value).__name__}")
            if exact is not None and exact([value]):
                return value
            return {check_key(k): check_value(v) for k, v in value.items()}
        return check_dict
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        return _struct_checker(annotation)
    raise TypeError(f"codec cannot validate annotation {annotation!r}")


_LISTS = frozenset({list})
_DICTS = frozenset({dict})
_EXACT = (str, int, float, bool)  # the scalars a column test takes exactly


def _all_exactly(annotation: Any) -> Callable[[Iterable[Any]], bool] | None:
    """A test that every item of a list is exactly of type `annotation`, in C passes (None: no such test).

    For scalars and lists and maps of them, at any depth: a column of ints, of lists of ints, of maps of
    ints to lists of ints. Exactly: a bool is no int here, an int no float; a value the test refuses
    takes its checker's full path, which converts it or names what is wrong. A test of scalars reads its
    items once, so it takes them as they come; a deeper one reads them twice and takes a list.
    """
    if annotation in _EXACT:
        kinds = frozenset({annotation})
        return lambda items: kinds.issuperset(map(type, items))
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    chain = itertools.chain.from_iterable
    if origin is list and (inner := _all_exactly(args[0])) is not None:
        if args[0] in _EXACT:  # lists of scalars: their items read once, as they come
            return lambda items: _LISTS.issuperset(map(type, items)) and inner(chain(items))
        return lambda items: _LISTS.issuperset(map(type, items)) and inner(list(chain(items)))
    if origin is dict and (keys := _all_exactly(args[0])) is not None and (values := _all_exactly(args[1])) is not None:
        if args[1] in _EXACT:
            return lambda items: (_DICTS.issuperset(map(type, items)) and keys(chain(items))
                                  and values(chain(map(dict.values, items))))
        return lambda items: (_DICTS.issuperset(map(type, items)) and keys(chain(items))
                              and values(list(chain(map(dict.values, items)))))
    return None


def _struct_checker(cls: type[Any]) -> Checker:
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    checks = [_checker_for(hints[f.name]) for f in fields]
    required = sum(
        1 for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
    name = cls.__name__
    # The fast path, for a message with every field present: a field of an exact type (str, int, ...) costs a
    # type comparison instead of a call, a column of them (or of lists or maps of them) a few C passes
    # (_all_exactly); the others go through their checkers. Anything the comparisons do not accept exactly
    # (an int for a float, a bool for an int) takes the full path, which converts or names the field that
    # failed. A HostHeartbeat decodes in about 6 us instead of 7-10 here.
    exact: list[tuple[int, type[Any]]] = []
    columns: list[tuple[int, frozenset[type[Any]]]] = []  # of scalars: the test inline (a HostHeartbeat's six)
    nested: list[tuple[int, Callable[[list[Any]], bool]]] = []  # of lists or maps of scalars (an AckBatch's)
    others: list[tuple[int, Checker]] = []
    for i, f in enumerate(fields):
        hint = hints[f.name]
        item = typing.get_args(hint)[0] if typing.get_origin(hint) is list else None
        if hint in (str, int, float, bool, bytes):
            exact.append((i, hint))
        elif item in _EXACT:
            columns.append((i, frozenset({item})))
        elif (test := _all_exactly(item)) is not None:
            nested.append((i, test))
        else:
            others.append((i, checks[i]))

    def check_all(value: list[Any]) -> Any:
        try:  # fields in declaration order, so positional; trailing defaults may be absent
            return cls(*[check(item) for check, item in zip(checks, value, strict=False)])
        except _FieldError:
            for f, check, item in zip(fields, checks, value, strict=False):  # the error path only: name the field
                try:
                    check(item)
                except _FieldError as err:
                    raise _FieldError(f"{name}.{f.name}: {err}") from None
            raise

    def check_struct(value: Any) -> Any:
        if type(value) is not list:
            raise _FieldError(f"{name}: expected a field list, got {type(value).__name__}")
        if len(value) != len(checks):
            if not required <= len(value) <= len(checks):
                raise _FieldError(f"{name}: expected {required}..{len(checks)} fields, got {len(value)}")
            return check_all(value)
        for i, kind in exact:
            if type(value[i]) is not kind:
                return check_all(value)
        for i, allowed in columns:
            column = value[i]
            if type(column) is not list or not allowed.issuperset(map(type, column)):
                return check_all(value)
        for i, test in nested:
            column = value[i]
            if type(column) is not list or not test(column):
                return check_all(value)
        if others:
            value = list(value)
            for i, check in others:
                try:
                    value[i] = check(value[i])
                except _FieldError as err:
                    raise _FieldError(f"{name}.{fields[i].name}: {err}") from None
        return cls(*value)
    return check_struct


_CHECKERS: dict[int, Checker] = {tag: _struct_checker(cls) for tag, cls in REGISTRY.items()}


_SCALARS = frozenset({str, int, float, bool, bytes, type(None)})
_FIELD_NAMES: dict[type[Any], tuple[str, ...]] = {}  # dataclass -> its field names, looked up once per class


def _to_wire(value: Any) -> Any:
    cls = type(value)
    if cls in _SCALARS:  # most fields: skip the dataclass checks below (encode runs for every message)
        return value
    names = _FIELD_NAMES.get(cls)
    if names is None and dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(value))
    if names is not None:
        return [_to_wire(getattr(value, name)) for name in names]
    if isinstance(value, list):  # a list or map of scalars (a view's seats, its hosts) goes as it is: one C pass
        return value if _SCALARS.issuperset(map(type, value)) else [_to_wire(item) for item in value]
    if isinstance(value, dict):
        if _SCALARS.issuperset(map(type, value.values())) and _SCALARS.issuperset(map(type, value)):
            return value
        return {k: _to_wire(v) for k, v in value.items()}
    return value


def _flat_fields(cls: type[Any]) -> Callable[[Any], tuple[Any, ...]] | None:
    """For a message of scalar fields only (a Welcome, a Rejoin): its fields in order, read in one C call.

    msgpack packs the tuple as it packs the list :func:`_to_wire` makes, byte for byte, in half the time.
    """
    names = [f.name for f in dataclasses.fields(cls)]
    scalars = (str, int, float, bool, bytes, type(None))

    def scalar(hint: Any) -> bool:
        if typing.get_origin(hint) in (Union, types.UnionType):
            return all(scalar(arg) for arg in typing.get_args(hint))
        return hint in scalars or (isinstance(hint, type) and issubclass(hint, enum.StrEnum))

    if len(names) < 2 or not all(map(scalar, typing.get_type_hints(cls).values())):
        return None
    return operator.attrgetter(*names)


_FLAT = {cls: flat for cls in REGISTRY.values() if (flat := _flat_fields(cls)) is not None}
_HEADERS = {flags: MAGIC + bytes((PROTOCOL_VERSION, flags)) for flags in (0, FLAG_HMAC)}


def encode(message: Message, secret: bytes | None = None) -> bytes:
    """Encode a message into one frame, authenticated when a secret is given.

    Raises:
        TypeError: `message` is not a registered message type (a programming error).
    """
    cls = type(message)
    tag = TAGS.get(cls)
    if tag is None:
        raise TypeError(f"{cls.__name__} is not a registered message type")
    flat = _FLAT.get(cls)
    payload: bytes = msgpack.packb([tag, flat(message) if flat is not None else _to_wire(message)], use_bin_type=True)
    body = _HEADERS[FLAG_HMAC if secret else 0] + payload
    if secret:
        body += hmac.digest(secret, body, "sha256")  # one C call; same MAC as hmac.new(...).digest()
    return body


def decode(
    frame: bytes | memoryview, secret: bytes | None = None, max_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> Message | DecodeError:
    """Decode and validate one frame; bad input gives a DecodeError, never an exception."""
    size = len(frame)
    if size > max_bytes:
        return DecodeError("too_large", f"frame of {size} bytes exceeds the limit of {max_bytes}")
    data = bytes(frame)
    if size < HEADER_BYTES + 1:
        return DecodeError("truncated", f"frame of {size} bytes is shorter than a header")
    if data[:2] != MAGIC:
        return DecodeError("bad_magic", f"frame starts with {data[:2]!r}, not {MAGIC!r}")
    if data[2] != PROTOCOL_VERSION:
        return DecodeError("bad_version", f"protocol version {data[2]}, this build speaks {PROTOCOL_VERSION}")
    flags = data[3]
    if flags & ~FLAG_HMAC:
        return DecodeError("bad_flags", f"unknown flag bits {flags:#04x}")
    if secret:
        if not flags & FLAG_HMAC:
            return DecodeError("unauthenticated", "frame carries no HMAC but this endpoint requires one")
        if size < HEADER_BYTES + MAC_BYTES + 1:
            return DecodeError("truncated", "frame too short to hold its HMAC")
        expected = hmac.digest(secret, memoryview(data)[:-MAC_BYTES], "sha256")
        if not hmac.compare_digest(expected, data[-MAC_BYTES:]):
            return DecodeError("bad_mac", "HMAC does not match: wrong shared secret or tampered frame")
        payload = data[HEADER_BYTES:-MAC_BYTES]
    elif flags & FLAG_HMAC:
        return DecodeError("unexpected_mac", "frame is authenticated but this endpoint has no secret to check it")
    else:
        payload = data[HEADER_BYTES:]
    decoded = _unpack(payload)
    if isinstance(decoded, DecodeError):
        return decoded
    if not isinstance(decoded, list) or len(decoded) != 2:
        return DecodeError("malformed", "payload is not a [tag, fields] pair")
    tag, fields = decoded
    if isinstance(tag, bool) or not isinstance(tag, int):
        return DecodeError("malformed", f"tag is a {type(tag).__name__}, not an int")
    checker = _CHECKERS.get(tag)
    if checker is None:
        return DecodeError("unknown_tag", f"message tag {tag} is not known to protocol version {PROTOCOL_VERSION}")
    message: Message | DecodeError = _check(checker, fields)
    return message


RECENT_FRAME_BYTES = 2048  # a host heartbeat of 8 workers is about 450 bytes


class Recent:
    """:func:`decode` for a stream of frames that repeat: a frame byte for byte equal to one decoded lately is the
    same message, returned again without being parsed.

    A host agent's ``HostHeartbeat`` repeats its last one until one of its workers finishes a step (a step
    of seconds, a heartbeat every half second), and its hello comes every second: at 131,072 members the
    coordinator reads about 50,000 of them a second, most of them repeats. Only messages of the `kinds`
    given (``messages.REPEATED``), in frames of at most :data:`RECENT_FRAME_BYTES`, are kept; two
    generations of at most `entries` each, so memory is bounded and a frame seen within the last
    generation or two is found. The default holds a second of a 131,072-member job's distinct frames
    (16,384 hellos and about 33,000 heartbeats) in one generation: with half of it, a hello came back
    mostly from the older generation (a second lookup and a move) and one in ten was decoded again.
    Decoding is a pure function of the bytes (and the secret, fixed here):
    nothing can tell a returned message from a fresh decode, as nothing changes a message (they are
    immutable to the type checker).
    """

    def __init__(self, secret: bytes | None = None, max_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 kinds: tuple[type[Message], ...] = REPEATED, entries: int = 65536) -> None:
        self._kinds, self._secret, self._max_bytes, self._entries = kinds, secret, max_bytes, entries
        self._new: dict[bytes, Message] = {}
        self._old: dict[bytes, Message] = {}

    def decode(self, frame: bytes | memoryview) -> Message | DecodeError:
        if len(frame) > RECENT_FRAME_BYTES:
            return decode(frame, self._secret, self._max_bytes)
        data = bytes(frame)
        message = self._new.get(data)
        if message is None:
            message = self._old.get(data)
            if message is None:
                decoded = decode(data, self._secret, self._max_bytes)
                if not isinstance(decoded, self._kinds):
                    return decoded
                message = decoded
            if len(self._new) >= self._entries:
                self._old, self._new = self._new, {}
            self._new[data] = message
        return message


def _unpack(payload: bytes) -> Any:
    """msgpack to Python values, or a DecodeError for bytes that are not msgpack."""
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except msgpack.StackError:  # its message is empty; say what it means
        return DecodeError("malformed", "payload nests deeper than msgpack's stack limit")
    except (ValueError, TypeError, OverflowError, msgpack.ExtraData, msgpack.FormatError) as err:
        return DecodeError("malformed", f"not valid msgpack: {err}")


def _check(checker: Checker, value: Any) -> Any:
    """The validated value, or a DecodeError naming the field that failed."""
    try:
        return checker(value)
    except _FieldError as err:
        return DecodeError("bad_field", str(err))
    except RecursionError:
        return DecodeError("malformed", "payload nests too deeply")


@dataclass(frozen=True, slots=True)
class _PackedView:
    """A view as a whole view in pieces carries it: each member id once, its address and host in columns.

    The view's maps hold every member id as a key twice more; here the columns follow the seats and then the
    spares (an empty string where a member has no entry, its index listed as missing), and only entries for
    keys that are no member go as maps. At 131,072 members: 8.4 MB instead of 15.6 MB, 1.7 MB compressed.
    """

    epoch: int
    seats: list[str]
    spares: list[str]
    resume_step: int
    store_prefix: str
    store_addr: str
    bulk: list[str]  # per member of seats + spares
    bulk_missing: list[int]  # indices (into seats + spares) of members with no bulk address
    bulk_others: dict[str, str]  # entries for keys that are no member
    hosts: list[str]
    hosts_missing: list[int]
    hosts_others: dict[str, str]
    buddies: list[int]
    restore_from: dict[int, str]
    rebuild_groups: list[str]


_VIEW_CHECKER = _struct_checker(_PackedView)
PACKED_VIEW_LEVEL = 1  # zlib's: the columns 4.8x smaller at 131,072 members, in 0.05 s (6: 9% smaller, 4x slower)


def view_bytes(view: View) -> int:
    """The size of the view's own encoding, as a ``CommitView`` carries it."""
    return len(msgpack.packb(_to_wire(view), use_bin_type=True))


def _column(entries: dict[str, str], members: list[str]) -> tuple[list[str], list[int], dict[str, str]]:
    """`entries` as a column over `members`, the indices of those without one, and the entries of others."""
    values = list(map(entries.get, members))
    missing: list[int] = []
    if None in values:
        missing = [i for i, value in enumerate(values) if value is None]
        for i in missing:
            values[i] = ""
    others: dict[str, str] = {}
    if len(members) - len(missing) != len(entries):  # a key that is no member (or members listed twice)
        listed = set(members)
        others = {key: value for key, value in entries.items() if key not in listed}
    return values, missing, others  # type: ignore[return-value]  # no None is left


def _map(members: list[str], values: list[str], missing: list[int], others: dict[str, str]) -> dict[str, str]:
    """The inverse of :func:`_column`.

    Raises:
        _FieldError: the column does not follow the members, or a missing index is out of range.
    """
    if len(values) != len(members):
        raise _FieldError(f"a column of {len(values)} entries for {len(members)} members")
    entries = dict(zip(members, values, strict=True))
    for i in missing:
        if not 0 <= i < len(members):
            raise _FieldError(f"missing entry {i} of {len(members)} members")
        entries.pop(members[i], None)
    entries.update(others)
    return entries


def pack_view(view: View) -> bytes:
    """A view alone (no frame), as a whole view in pieces carries it: :class:`_PackedView`, compressed."""
    members = [*view.seats, *view.spares]
    bulk, hosts = _column(view.bulk_addrs, members), _column(view.hosts, members)
    packed = _PackedView(view.epoch, view.seats, view.spares, view.resume_step, view.store_prefix, view.store_addr,
                         *bulk, *hosts, view.buddies, view.restore_from, view.rebuild_groups)
    return zlib.compress(msgpack.packb(_to_wire(packed), use_bin_type=True), PACKED_VIEW_LEVEL)


def unpack_view(data: bytes, max_bytes: int) -> View | DecodeError:
    """The inverse of :func:`pack_view`, validated field by field; bad input (or more than `max_bytes` once
    decompressed) gives a DecodeError."""
    inflate = zlib.decompressobj()
    try:
        raw = inflate.decompress(data, max_bytes)
    except zlib.error as err:
        return DecodeError("malformed", f"packed view does not decompress: {err}")
    if inflate.unconsumed_tail:
        return DecodeError("too_large", f"packed view decompresses to more than {max_bytes} bytes")
    if not inflate.eof or inflate.unused_data:
        return DecodeError("malformed", "packed view is truncated or followed by other bytes")
    decoded = _unpack(raw)
    if isinstance(decoded, DecodeError):
        return decoded
    packed = _check(_VIEW_CHECKER, decoded)
    if isinstance(packed, DecodeError):
        return packed
    members = [*packed.seats, *packed.spares]
    try:
        bulk = _map(members, packed.bulk, packed.bulk_missing, packed.bulk_others)
        hosts = _map(members, packed.hosts, packed.hosts_missing, packed.hosts_others)
    except _FieldError as err:
        return DecodeError("bad_field", f"packed view: {err}")
    return View(packed.epoch, packed.seats, packed.spares, packed.resume_step, packed.store_prefix,
                packed.store_addr, bulk, hosts, packed.buddies, packed.restore_from, packed.rebuild_groups)
