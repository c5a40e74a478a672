"""Hypothesis strategies for any protobuf request message, built from its descriptor.

Every field of every message can be drawn (scalars over their whole range with the edges weighted
in, repeated fields, nested messages, oneofs, proto3 `optional` presence, enums including numbers
outside the enum). `hints` add values that mean something to the server under test (small batch
ids that collide, ranks of the cluster, token ids around the vocabulary's end), drawn besides the
full range, so the fuzz reaches the success paths and not only the parsers:

    requests = request_strategy(pb.PrefillRequest.DESCRIPTOR, hints={"id": st.integers(0, 3)})
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor, ServiceDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

# By field name, or "Message.field" for one message; for a repeated field, the hint draws one element.
Hints = Mapping[str, st.SearchStrategy[Any]]

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
MAX_DEPTH = 3
MAX_REPEATED = 5


def _integers(low: int, high: int) -> st.SearchStrategy[int]:
    edges = sorted({low, high, max(low, -1), 0 if low <= 0 else low, min(high, 1), min(high, 2**31 - 1)})
    return st.one_of(st.integers(max(low, -2), min(high, 8)), st.sampled_from(edges), st.integers(low, high))


def _floats(width: Literal[32, 64]) -> st.SearchStrategy[float]:
    return st.one_of(
        st.sampled_from([0.0, 1.0, 0.5, -1.0, 2.0, 1e-45, 3.5e38]),
        st.floats(width=width, allow_nan=True, allow_infinity=True),
    )


def _enum(descriptor: EnumDescriptor) -> st.SearchStrategy[int]:
    numbers = [value.number for value in descriptor.values]
    return st.one_of(st.sampled_from(numbers), st.integers(-1, max(numbers) + 3))  # proto3 enums are open


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind in _INT_RANGES:
        return _integers(*_INT_RANGES[kind])
    if kind == FieldDescriptor.TYPE_FLOAT:
        return _floats(32)
    if kind == FieldDescriptor.TYPE_DOUBLE:
        return _floats(64)
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_STRING:
        return st.text(max_size=24)
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=24)
    if kind == FieldDescriptor.TYPE_ENUM:
        return _enum(field.enum_type)
    raise TypeError(f"no strategy for field {field.full_name} of type {kind}")


def _hint(field: FieldDescriptor, hints: Hints) -> st.SearchStrategy[Any] | None:
    return hints.get(f"{field.containing_type.name}.{field.name}", hints.get(field.name))


def _is_repeated(field: FieldDescriptor) -> bool:
    return bool(field.is_repeated)


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == FieldDescriptor.TYPE_MESSAGE and bool(field.message_type.GetOptions().map_entry)


def field_strategy(field: FieldDescriptor, hints: Hints, depth: int) -> st.SearchStrategy[Any]:
    """Values of one field (a list for repeated fields; a message for message fields)."""
    hinted = _hint(field, hints)
    if _is_map(field):
        key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        return st.dictionaries(field_strategy(key, hints, depth), field_strategy(value, hints, depth),
                               max_size=MAX_REPEATED)
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        one: st.SearchStrategy[Any] = message_strategy(field.message_type, hints, depth + 1)
    else:
        one = _scalar(field)
    if _is_repeated(field):  # a hint is for each element; a list is all hinted or all free
        lists = st.lists(one, max_size=MAX_REPEATED)
        return lists if hinted is None else st.one_of(st.lists(hinted, max_size=MAX_REPEATED), lists)
    return one if hinted is None else st.one_of(hinted, one)


def _message_class(descriptor: Descriptor) -> type[Message]:
    return message_factory.GetMessageClass(descriptor)


def message_strategy(descriptor: Descriptor, hints: Hints, depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of `descriptor`: each field set or left unset; one member per oneof at most."""
    cls = _message_class(descriptor)
    if depth > MAX_DEPTH:
        return st.just(cls())
    in_oneof = {f.name for oneof in descriptor.oneofs for f in oneof.fields}
    free = [f for f in descriptor.fields if f.name not in in_oneof]
    parts: dict[str, st.SearchStrategy[Any]] = {
        f.name: st.one_of(st.none(), field_strategy(f, hints, depth)) for f in free
    }
    for oneof in descriptor.oneofs:
        members = [st.tuples(st.just(f.name), field_strategy(f, hints, depth)) for f in oneof.fields]
        parts[f"__oneof_{oneof.name}"] = st.one_of(st.none(), *members)
    return st.fixed_dictionaries(parts).map(lambda values: _build(cls, values))


def _build(cls: type[Message], values: dict[str, Any]) -> Message:
    msg = cls()
    for name, value in values.items():
        if value is None:
            continue
        if name.startswith("__oneof_"):
            name, value = value
        _assign(msg, name, value)
    return msg


def _assign(msg: Message, name: str, value: Any) -> None:
    field = msg.DESCRIPTOR.fields_by_name[name]
    if _is_map(field):
        target = getattr(msg, name)
        for key, item in value.items():
            if isinstance(item, Message):
                target[key].CopyFrom(item)
            else:
                target[key] = item
    elif _is_repeated(field):
        target = getattr(msg, name)
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            for item in value:
                target.add().CopyFrom(item)
        else:
            target.extend(value)
    elif field.type == FieldDescriptor.TYPE_MESSAGE:
        getattr(msg, name).CopyFrom(value)
    else:
        setattr(msg, name, value)


def request_strategy(descriptor: Descriptor, hints: Hints | None = None) -> st.SearchStrategy[Message]:
    """Request messages of `descriptor` (see the module docstring for `hints`)."""
    return message_strategy(descriptor, hints or {})


def rpc_requests(
    service: ServiceDescriptor, hints: Hints | None = None
) -> dict[str, st.SearchStrategy[Message]]:
    """One request strategy per RPC of `service`, by method name."""
    return {m.name: request_strategy(m.input_type, hints) for m in service.methods}


def every_field(descriptor: Descriptor, seen: set[str] | None = None) -> set[str]:
    """Full names of every field reachable from `descriptor` (what the strategies must be able to set)."""
    seen = set() if seen is None else seen
    for field in descriptor.fields:
        if field.full_name in seen:
            continue
        seen.add(field.full_name)
        if field.type == FieldDescriptor.TYPE_MESSAGE and not _is_map(field):
            every_field(field.message_type, seen)
    return seen


def fields_set(msg: Message, into: set[str]) -> None:
    """Add the full names of the fields `msg` sets (recursively) to `into`."""
    for field, value in msg.ListFields():
        into.add(field.full_name)
        if field.type != FieldDescriptor.TYPE_MESSAGE or _is_map(field):
            continue
        for item in value if _is_repeated(field) else [value]:
            fields_set(item, into)
