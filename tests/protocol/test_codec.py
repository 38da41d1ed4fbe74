"""Codec tests: every message survives the wire, and no input can make decode() raise.

The codec is the trust boundary of every process (DESIGN invariant 4: malformed,
oversized or unauthenticated messages are dropped and logged, no crash).  So
the properties here are of two kinds:

- round trip: for every registered message type, with field values generated
  from the dataclass annotations themselves (so a new message or field is
  covered without touching this file), ``decode(encode(m)) == m``;
- hostility: random bytes, truncation, bit flips, wrong versions, unknown
  tags, wrong field types and counts, oversized frames and every HMAC
  mismatch give back a ``DecodeError`` with a known reason and a readable
  detail, never an exception.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from typing import Any, Union

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deadpool.protocol import codec
from deadpool.protocol.codec import FLAG_HMAC, HEADER_BYTES, MAC_BYTES, MAGIC, DecodeError, decode, encode
from deadpool.protocol.messages import (
    PROTOCOL_VERSION,
    REGISTRY,
    TAGS,
    AckBatch,
    CommitView,
    Finished,
    Heartbeat,
    HostHeartbeat,
    Message,
    PrepareAck,
    RestoreReply,
    SnapshotHeader,
    StepReport,
)
from deadpool.protocol.view import View

# Modest settings: the whole file should run in a few seconds on 2 cores.
PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PER_TYPE = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SECRET = b"s3cret-shared-by-the-job"

# Every reason decode() may give.  A new reason is fine, but it must be added
# here on purpose: callers log and count by reason.
REASONS = {
    "too_large",
    "truncated",
    "bad_magic",
    "bad_version",
    "bad_flags",
    "unauthenticated",
    "unexpected_mac",
    "bad_mac",
    "malformed",
    "unknown_tag",
    "bad_field",
}

# msgpack carries integers in [-2**63, 2**64 - 1]; the codec must take all of them.
WIRE_INTS = st.integers(min_value=-(2**63), max_value=2**64 - 1)


# --- strategies derived from the annotations ------------------------------------------------


def strategy_for(annotation: Any) -> st.SearchStrategy[Any]:
    """A strategy for any value the annotation admits (the mirror of codec._checker_for)."""
    origin = typing.get_origin(annotation)
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        return WIRE_INTS
    if annotation is float:
        return st.floats()  # NaN and infinities included: msgpack carries them
    if annotation is str:
        return st.text(max_size=20)
    if annotation is bytes:
        return st.binary(max_size=40)
    if annotation is type(None):
        return st.none()
    if isinstance(annotation, type) and issubclass(annotation, enum.StrEnum):
        return st.sampled_from(list(annotation))
    if origin in (Union, types.UnionType):
        return st.one_of([strategy_for(arg) for arg in typing.get_args(annotation)])
    if origin is list:
        (item,) = typing.get_args(annotation)
        return st.lists(strategy_for(item), max_size=4)
    if origin is dict:
        key, value = typing.get_args(annotation)
        return st.dictionaries(strategy_for(key), strategy_for(value), max_size=3)
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        hints = typing.get_type_hints(annotation)
        fields = {f.name: strategy_for(hints[f.name]) for f in dataclasses.fields(annotation)}
        return st.builds(annotation, **fields)
    raise TypeError(f"no strategy for annotation {annotation!r}: extend strategy_for")


MESSAGE_TYPES = sorted(REGISTRY.items())
ANY_MESSAGE: st.SearchStrategy[Message] = st.one_of([strategy_for(cls) for _, cls in MESSAGE_TYPES])

# Any value msgpack can carry, to put where a field (or the whole payload) should be.
WIRE_VALUES = st.recursive(
    st.none() | st.booleans() | WIRE_INTS | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.integers(-5, 5) | st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=12,
)


def same(a: Any, b: Any) -> bool:
    """Structural equality in which NaN equals NaN (dataclass == would say no)."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def refused(result: Message | DecodeError) -> DecodeError:
    """Assert that decode refused the frame with a known reason and a readable detail."""
    assert isinstance(result, DecodeError), f"expected a DecodeError, got {result!r}"
    assert result.reason in REASONS, f"unknown reason {result.reason!r}"
    assert result.detail.strip(), f"{result.reason} without a detail"
    return result


def survived(result: Message | DecodeError) -> None:
    """Assert that decode gave back something well-formed (a message or a proper refusal)."""
    if isinstance(result, DecodeError):
        refused(result)
    else:
        assert type(result) in TAGS


def frame(payload: Any, *, version: int = PROTOCOL_VERSION, flags: int = 0) -> bytes:
    """Hand-build a frame around an arbitrary msgpack payload (no HMAC)."""
    packed: bytes = msgpack.packb(payload, use_bin_type=True)
    return MAGIC + bytes((version, flags)) + packed


def wire_fields(message: Message) -> list[Any]:
    """The message's field list as it travels (nested dataclasses become lists)."""
    decoded = msgpack.unpackb(encode(message)[HEADER_BYTES:], raw=False, strict_map_key=False)
    return list(decoded[1])


def wrong_value_for(annotation: Any) -> Any:
    """A msgpack value that the annotation never admits."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (Union, types.UnionType) else ()
    return 1.5 if annotation is str or str in options else "wrong"


# --- round trips ----------------------------------------------------------------------------


def test_registry_tags_are_small_positive_and_unique() -> None:
    assert len(set(REGISTRY.values())) == len(REGISTRY)
    assert all(isinstance(tag, int) and tag > 0 for tag in REGISTRY)
    assert all(TAGS[cls] == tag for tag, cls in REGISTRY.items())


@pytest.mark.parametrize("cls", [cls for _, cls in MESSAGE_TYPES], ids=lambda cls: cls.__name__)
@PER_TYPE
@given(data=st.data())
def test_round_trip_every_message_type(cls: type[Message], data: st.DataObject) -> None:
    message = data.draw(strategy_for(cls))
    for secret in (None, SECRET):
        result = decode(encode(message, secret), secret, max_bytes=1 << 24)
        assert not isinstance(result, DecodeError), str(result)
        assert same(result, message)


@PROPERTY
@given(message=ANY_MESSAGE)
def test_round_trip_from_memoryview(message: Message) -> None:
    """Receivers hand decode() zero-copy memoryviews, not bytes."""
    result = decode(memoryview(encode(message, SECRET)), SECRET, max_bytes=1 << 24)
    assert same(result, message)


def test_round_trip_nested_view_and_optional_header() -> None:
    view = View(
        epoch=3,
        seats=["a:1:x", "b:2:y"],
        spares=["c:3:z"],
        resume_step=41,
        store_prefix="epoch-3",
        store_addr="127.0.0.1:29500",
        bulk_addrs={"a:1:x": "tcp://127.0.0.1:5001", "b:2:y": "tcp://127.0.0.1:5002"},
        hosts={"a:1:x": "h1", "b:2:y": "h2"},
        buddies=[1, 0],
        restore_from={1: "a:1:x"},
    )
    assert decode(encode(CommitView(view=view))) == CommitView(view=view)
    header = SnapshotHeader("a:1:x", 3, 0, 41, 1 << 30, b"\x00manifest", b"")
    for optional in (header, None):
        reply = RestoreReply("a:1:x", 3, 0, 41, True, "", optional)
        assert decode(encode(reply)) == reply


def test_trailing_defaulted_fields_may_be_omitted() -> None:
    """An older peer that predates a defaulted field still decodes (fields append-only)."""
    result = decode(frame([TAGS[StepReport], ["m", 2, 7]]))
    assert isinstance(result, StepReport)
    assert (result.sender, result.epoch, result.step) == ("m", 2, 7)
    assert math.isnan(result.loss)


def test_a_finished_without_the_untracked_loader_fields_decodes_as_none_was_left() -> None:
    result = decode(frame([TAGS[Finished], ["m", 2, 1, 11, "ab" * 32]]))
    assert result == Finished("m", 2, 1, 11, "ab" * 32, "", "", 0)
    told = Finished("m", 2, 1, 11, "ab" * 32, "DataLoader", "train.py:40", 2)
    assert decode(encode(told)) == told


def test_int_is_accepted_for_float_and_becomes_float() -> None:
    result = decode(frame([TAGS[Heartbeat], ["m", 1, 2, 3, 4, 0, ""]]))
    assert isinstance(result, Heartbeat)
    assert type(result.stall_p99_s) is float


def test_a_full_message_whose_columns_need_converting_or_refusing_is_judged_like_any_other() -> None:
    """Messages with every field present take a fast path of type comparisons; what it does not accept
    exactly is converted (an int where a float goes) or refused with the field named, as on the full path."""
    beat = ["agent", ["m0", "m1"], [1, 1], [5, 5], [4, 4], [3, 3], ["tcp://a", "tcp://b"], [0, 0.5]]
    result = decode(frame([TAGS[HostHeartbeat], beat]))
    assert isinstance(result, HostHeartbeat) and [type(x) for x in result.stall_p99_s] == [float, float]
    bad_column = refused(decode(frame([TAGS[HostHeartbeat], [*beat[:3], [5, True], *beat[4:]]])))
    assert bad_column.reason == "bad_field" and "HostHeartbeat.steps" in bad_column.detail
    answers = ["agent", ["m0", "m1"], [2, 2], [7, 7], [[6, 7], [7]], [{3: [6, 7]}, {}], [[], []], [[], ["tp0"]],
               [False, True]]
    good = decode(frame([TAGS[AckBatch], answers]))
    assert isinstance(good, AckBatch) and good.answers()[0].ward_steps == {3: [6, 7]}
    assert good.answers()[1] == PrepareAck("m1", 2, 7, [7], {}, [], ["tp0"], True)
    for i, column in [(5, [{3: ["six"]}, {}]), (4, [[6, 7], [True]]), (8, [False, 1]), (7, [[], [0]]),
                      (4, [[6, 7], 7]), (5, [{3: [6]}, []])]:
        bad = refused(decode(frame([TAGS[AckBatch], [*answers[:i], column, *answers[i + 1:]]])))
        assert bad.reason == "bad_field" and f"AckBatch.{dataclasses.fields(AckBatch)[i].name}" in bad.detail, column


def test_encode_refuses_unregistered_types() -> None:
    with pytest.raises(TypeError, match="not a registered message type"):
        encode(View(0, [], [], -1, "", "", {}, {}, [], {}))  # type: ignore[arg-type]


# --- hostile input --------------------------------------------------------------------------


@PROPERTY
@given(data=st.binary(max_size=200))
def test_random_bytes_never_raise(data: bytes) -> None:
    for secret in (None, SECRET):
        survived(decode(data, secret))


@PROPERTY
@given(payload=WIRE_VALUES)
def test_random_msgpack_payloads_never_raise(payload: Any) -> None:
    survived(decode(frame(payload)))


@PROPERTY
@given(tag=st.sampled_from(sorted(REGISTRY)), fields=WIRE_VALUES)
def test_random_fields_under_known_tags_never_raise(tag: int, fields: Any) -> None:
    survived(decode(frame([tag, fields])))


@PROPERTY
@given(tail=st.binary(max_size=60))
def test_random_bytes_after_a_valid_header_never_raise(tail: bytes) -> None:
    survived(decode(MAGIC + bytes((PROTOCOL_VERSION, 0)) + tail))


@PROPERTY
@given(message=ANY_MESSAGE, data=st.data())
def test_truncated_frames_are_refused(message: Message, data: st.DataObject) -> None:
    for secret in (None, SECRET):
        whole = encode(message, secret)
        cut = data.draw(st.integers(0, len(whole) - 1), label="cut")
        refused(decode(whole[:cut], secret))


@PROPERTY
@given(message=ANY_MESSAGE, data=st.data())
def test_flipped_bytes_never_raise_and_never_pass_the_mac(message: Message, data: st.DataObject) -> None:
    whole = bytearray(encode(message, SECRET))
    index = data.draw(st.integers(0, len(whole) - 1), label="index")
    whole[index] ^= data.draw(st.integers(1, 255), label="xor")
    refused(decode(bytes(whole), SECRET))
    survived(decode(bytes(whole)))  # without a secret a flip may go unnoticed, but never crashes


@PROPERTY
@given(message=ANY_MESSAGE, version=st.integers(0, 255).filter(lambda v: v != PROTOCOL_VERSION))
def test_wrong_version_byte_is_refused(message: Message, version: int) -> None:
    whole = bytearray(encode(message))
    whole[2] = version
    assert refused(decode(bytes(whole))).reason == "bad_version"


@PROPERTY
@given(tag=WIRE_INTS.filter(lambda t: t not in REGISTRY), fields=WIRE_VALUES)
def test_unknown_tags_are_refused(tag: int, fields: Any) -> None:
    result = refused(decode(frame([tag, fields])))
    assert result.reason == "unknown_tag"
    assert str(tag) in result.detail


@pytest.mark.parametrize("tag", ["2", 2.0, True, None, [2], b"\x02"], ids=repr)
def test_non_integer_tags_are_malformed(tag: Any) -> None:
    assert refused(decode(frame([tag, []]))).reason == "malformed"


@pytest.mark.parametrize("payload", [[], [2], [2, [], 3], {"tag": 2}, 2, "x", None], ids=repr)
def test_payload_that_is_not_a_tag_fields_pair_is_malformed(payload: Any) -> None:
    assert refused(decode(frame(payload))).reason == "malformed"


@PROPERTY
@given(message=ANY_MESSAGE, data=st.data())
def test_wrong_field_types_are_refused(message: Message, data: st.DataObject) -> None:
    cls = type(message)
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    index = data.draw(st.integers(0, len(fields) - 1), label="field")
    wire = wire_fields(message)
    wire[index] = wrong_value_for(hints[fields[index].name])
    result = refused(decode(frame([TAGS[cls], wire])))
    assert result.reason == "bad_field"
    assert f"{cls.__name__}.{fields[index].name}" in result.detail


@PROPERTY
@given(message=ANY_MESSAGE, data=st.data())
def test_wrong_field_counts_are_refused(message: Message, data: st.DataObject) -> None:
    cls = type(message)
    fields = dataclasses.fields(cls)
    required = sum(1 for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    wire = wire_fields(message)
    count = data.draw(st.integers(0, required - 1) | st.integers(len(fields) + 1, len(fields) + 5), label="n")
    wire = (wire + [0] * count)[:count]
    result = refused(decode(frame([TAGS[cls], wire])))
    assert result.reason == "bad_field"
    assert "fields" in result.detail


def test_wrong_type_deep_inside_a_nested_view_is_refused_with_its_path() -> None:
    view_fields = [1, [7], [], 0, "", "", {}, {}, [], {}]  # seats must be strings
    result = refused(decode(frame([4, [view_fields]])))
    assert result.reason == "bad_field"
    assert "CommitView.view" in result.detail and "View.seats" in result.detail


def test_bool_is_not_an_int_and_int_is_not_a_bool() -> None:
    assert refused(decode(frame([TAGS[Heartbeat], ["m", True, 2, 3, 4, 0.0]]))).reason == "bad_field"
    assert refused(decode(frame([10, [1, "done"]]))).reason == "bad_field"  # Stop.ok must be a bool


def test_deep_nesting_is_refused_with_a_readable_detail() -> None:
    for nested in (b"\x91" * 100_000 + b"\x00", b"\x81\x00" * 100_000 + b"\x00"):
        result = refused(decode(MAGIC + bytes((PROTOCOL_VERSION, 0)) + nested))
        assert result.reason == "malformed"
        assert "nest" in result.detail


@pytest.mark.parametrize(
    "payload",
    [
        b"\xdd\xff\xff\xff\xff",  # array claiming 4 G items
        b"\xc6\xff\xff\xff\xff",  # bin claiming 4 GB
        b"\xd4\xff\x00",  # timestamp ext of a bad length
        b"\x92\x02\x96\xa2\xff\xfe",  # invalid UTF-8 in a str
        b"\x92\x06\x95\xa1a\x01\x01\x90\x81\x91\x00\x90",  # map with a list as key (unhashable)
        b"\xc1",  # the one never-used msgpack byte
    ],
    ids=["huge-array", "huge-bin", "bad-timestamp", "bad-utf8", "unhashable-key", "reserved-byte"],
)
def test_hostile_msgpack_is_malformed(payload: bytes) -> None:
    assert refused(decode(MAGIC + bytes((PROTOCOL_VERSION, 0)) + payload)).reason == "malformed"


def test_trailing_bytes_after_the_payload_are_malformed() -> None:
    assert refused(decode(encode(Heartbeat("m", 1, 2, 3, 4, 0.5, "tcp://h:1")) + b"\x00")).reason == "malformed"


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "truncated"),
        (b"DP" + bytes((PROTOCOL_VERSION, 0)), "truncated"),
        (b"XX" + bytes((PROTOCOL_VERSION, 0)) + b"\x90", "bad_magic"),
        (b"DP" + bytes((PROTOCOL_VERSION, 2)) + b"\x90", "bad_flags"),
        (b"DP" + bytes((PROTOCOL_VERSION, 0x80)) + b"\x90", "bad_flags"),
        (b"DP\x01\x00\x90", "bad_version"),  # protocol 1: before Heartbeat carried its control address
    ],
)
def test_header_errors(data: bytes, reason: str) -> None:
    assert refused(decode(data)).reason == reason


# --- size limits ----------------------------------------------------------------------------


@PROPERTY
@given(message=ANY_MESSAGE, slack=st.integers(1, 64))
def test_oversized_frames_are_refused_before_parsing(message: Message, slack: int) -> None:
    whole = encode(message)
    result = refused(decode(whole, max_bytes=len(whole) - slack))
    assert result.reason == "too_large"
    assert str(len(whole)) in result.detail
    assert not isinstance(decode(whole, max_bytes=len(whole)), DecodeError)  # the limit is inclusive


def test_default_limit_refuses_a_megabyte_string() -> None:
    big = StepReport("m" * codec.DEFAULT_MAX_FRAME_BYTES, 0, 0, 0.0)
    assert refused(decode(encode(big))).reason == "too_large"


# --- HMAC -----------------------------------------------------------------------------------


@PROPERTY
@given(message=ANY_MESSAGE, other=st.binary(min_size=1, max_size=64).filter(lambda s: s != SECRET))
def test_wrong_secret_is_refused(message: Message, other: bytes) -> None:
    assert refused(decode(encode(message, SECRET), other)).reason == "bad_mac"


@PROPERTY
@given(message=ANY_MESSAGE)
def test_missing_and_unexpected_macs_are_refused(message: Message) -> None:
    assert refused(decode(encode(message), SECRET)).reason == "unauthenticated"
    assert refused(decode(encode(message, SECRET))).reason == "unexpected_mac"


def test_mac_flag_with_the_mac_stripped_is_refused() -> None:
    signed = encode(Heartbeat("m", 1, 2, 3, 4, 0.5, "tcp://h:1"), SECRET)
    assert refused(decode(signed[:-MAC_BYTES], SECRET)).reason in {"bad_mac", "truncated"}
    assert refused(decode(signed[: HEADER_BYTES + MAC_BYTES], SECRET)).reason == "truncated"


def test_clearing_the_mac_flag_does_not_bypass_authentication() -> None:
    signed = bytearray(encode(Heartbeat("m", 1, 2, 3, 4, 0.5, "tcp://h:1"), SECRET))
    signed[3] &= ~FLAG_HMAC
    assert refused(decode(bytes(signed), SECRET)).reason == "unauthenticated"


def test_a_mac_over_a_different_message_is_refused() -> None:
    """Splicing a valid MAC onto another body (replay of a tag) must not pass."""
    first = encode(Heartbeat("m", 1, 2, 3, 4, 0.5, "tcp://h:1"), SECRET)
    second = encode(Heartbeat("m", 9, 2, 3, 4, 0.5, "tcp://h:1"), SECRET)
    spliced = second[:-MAC_BYTES] + first[-MAC_BYTES:]
    assert refused(decode(spliced, SECRET)).reason == "bad_mac"


def test_decode_error_str_names_reason_and_detail() -> None:
    error = refused(decode(b"nope!"))
    assert str(error) == f"{error.reason}: {error.detail}"


def test_an_enum_field_takes_only_its_members() -> None:
    from deadpool.protocol.messages import Join, Role

    join = Join("m", Role.SPARE, -1, 4, 1, "h", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2")
    decoded = decode(encode(join, SECRET), SECRET)
    assert isinstance(decoded, Join) and decoded.role is Role.SPARE
    forged = msgpack.packb([TAGS[Join], ["m", "leader", -1, 4, 1, "h", "a", "b"]], use_bin_type=True)
    result = decode(b"DP" + bytes((PROTOCOL_VERSION, 0)) + forged)
    assert isinstance(result, DecodeError) and result.reason == "bad_field" and "leader" in result.detail


def test_a_map_of_columns_is_refused_for_a_key_or_item_of_another_type_however_it_is_checked() -> None:
    """Ward steps (seat -> steps) pass in C when every key and item has its exact type; a bool or a string
    anywhere takes the field-by-field path and is refused there, the field named."""
    ack = ["m0", 2, 7, [6, 7], {3: [6, 7], 5: []}, [], [], False]
    good = decode(frame([TAGS[PrepareAck], ack]))
    assert isinstance(good, PrepareAck) and good.ward_steps == {3: [6, 7], 5: []}
    for wards in ({True: [6]}, {3: [6, True]}, {3: 6}, {"3": [6]}, {3: [6.0]}):
        bad = refused(decode(frame([TAGS[PrepareAck], [*ack[:4], wards, *ack[5:]]])))
        assert bad.reason == "bad_field" and "PrepareAck.ward_steps" in bad.detail, wards
        column = refused(decode(frame([TAGS[AckBatch], ["agent", ["m0"], [2], [7], [[6, 7]], [wards], [[]], [[]],
                                                                 [False]]])))
        assert column.reason == "bad_field" and "AckBatch.ward_steps" in column.detail, wards


def test_a_repeated_frame_of_a_repeating_kind_is_decoded_once_and_nothing_else_is_kept() -> None:
    recent = codec.Recent(SECRET, entries=2)
    beat = HostHeartbeat("agent", ["m0"], [1], [5], [4], [3], ["tcp://a"], [0.5])
    frame = encode(beat, SECRET)
    first = recent.decode(frame)
    assert first == beat and recent.decode(bytearray(frame)) is first, "the same bytes: the same message"
    step = encode(Heartbeat("m0", 1, 5, 4, 3, 0.5, "tcp://a"), SECRET)
    assert recent.decode(step) is not recent.decode(step), "a member's own heartbeat is not kept"
    tampered = frame[:-1] + bytes([frame[-1] ^ 1])
    assert refused(recent.decode(tampered)).reason == "bad_mac"
    assert refused(recent.decode(tampered)).reason == "bad_mac", "a refused frame is judged again"
    others = [encode(dataclasses.replace(beat, steps=[6 + i]), SECRET) for i in range(4)]
    for other in others:
        recent.decode(other)
    assert recent.decode(frame) is not first and recent.decode(frame) == beat, "two generations of two: forgotten"


@PROPERTY
@given(message=ANY_MESSAGE)
def test_a_message_of_scalar_fields_encodes_to_the_same_bytes_through_its_shortcut(message: Message) -> None:
    """Messages of scalar fields only are packed from a tuple of their fields: the same bytes as the general way."""
    general = msgpack.packb([TAGS[type(message)], codec._to_wire(message)], use_bin_type=True)
    assert encode(message) == MAGIC + bytes((PROTOCOL_VERSION, 0)) + general
