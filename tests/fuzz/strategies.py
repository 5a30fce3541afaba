"""Hypothesis strategies that build protobuf messages from their descriptors.

`messages(descriptor)` walks any message type: scalars at their extremes (NaN and
infinities, the ends of every integer range, -1 where a field is unsigned is impossible on
the wire so the top of the range stands in), long, empty, unicode and path-like strings,
repeated fields of varying length (duplicates included), nested messages, maps, oneofs,
and enums with unknown values. `mutations(seed)` changes one or two fields of a valid
request, recursively, so the fuzzing also reaches past the first validation.

Strings may be *tokens*: `TOKEN + name` stands for an id of the fuzzed cluster that only
exists at run time (a job id, an event id); `resolve` replaces them before the call, so a
strategy (and an `@example`) can name "the running job" without knowing its id."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any, Literal, TypeVar

from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

TOKEN = "\x1e"
_TOKEN_RE = re.compile(TOKEN + r"([a-z_]+)")
# Names of the run-time ids that tokens may stand for (see the fixtures' `known`).
TOKENS = ("job", "job_name", "done_job", "event", "command", "incident", "node", "node2")

MAX_DEPTH = 4

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}

ADVERSARIAL_STRINGS = [
    "",
    " ",
    "a",
    "-",
    "0",
    "0-0",
    "1-1",
    "$",
    "+",
    "*",
    "?",
    "[",
    "%s%n",
    "../..",
    "../../etc/passwd",
    "a/b",
    "/",
    "x:y",
    "unicron:jobs",
    "unicron:job:x",
    "job-20250101-00000000",
    "inc-0000000000",
    "127.0.0.1:1",
    ":",
    "\x00",
    "a\x00b",
    "\n",
    "\t\r",
    "é",
    "名前",
    "🙂",
    "\u202e",
    "' OR 1=1 --",
    "A" * 64,
    "a" * 1000,
    "x" * 70_000,
    "18446744073709551615-18446744073709551615",
]

_FLOAT_EXTREMES = [0.0, -0.0, 1.0, -1.0, math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, 1e-9, 3600.0]


def token(name: str) -> str:
    return TOKEN + name


def _tokens() -> st.SearchStrategy[str]:
    """Run-time ids, as they are and dressed up as keys or paths."""
    names = st.sampled_from(TOKENS).map(token)
    return st.one_of(
        names,
        st.tuples(
            names, st.sampled_from([":events", ":progress", ":heartbeat", ":commands", ":incidents", "/..", " "])
        ).map("".join),
        st.tuples(st.sampled_from(["../", "unicron:job:", "unicron:node:", " "]), names).map("".join),
        st.just(token("event") + "0"),
    )


def strings() -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(ADVERSARIAL_STRINGS),
        _tokens(),
        st.text(max_size=40),
        st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-:./_", max_size=80),
    )


def _integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted(
        {v for v in (lo, lo + 1, hi, hi - 1, 0, 1, 2, -1, 2**31 - 1, 2**31, 2**32 - 1, 2**53 + 1) if lo <= v <= hi}
    )
    return st.one_of(st.sampled_from(edges), st.integers(0, 8).filter(lambda v: lo <= v <= hi), st.integers(lo, hi))


def _floats(width: Literal[32, 64]) -> st.SearchStrategy[float]:
    extremes = _FLOAT_EXTREMES if width == 64 else [v for v in _FLOAT_EXTREMES if abs(v) < 3e38 and v != 5e-324]
    return st.one_of(
        st.sampled_from(extremes),
        st.floats(min_value=0, max_value=1000, width=width),
        st.floats(allow_nan=True, allow_infinity=True, width=width),
    )


def _enum_values(field: Any) -> st.SearchStrategy[int]:
    known = [value.number for value in field.enum_type.values]
    return st.one_of(st.sampled_from(known), st.sampled_from([-1, max(known) + 1, 2**31 - 1, -(2**31)]))


def _is_map(field: Any) -> bool:
    return field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _is_repeated(field: Any) -> bool:
    return bool(field.label == FieldDescriptor.LABEL_REPEATED)


def scalar(field: Any, depth: int) -> st.SearchStrategy[Any]:
    """One value of the field's type (a message for message fields)."""
    kind = field.type
    if kind in _INT_RANGES:
        return _integers(*_INT_RANGES[kind])
    if kind == FieldDescriptor.TYPE_DOUBLE:
        return _floats(64)
    if kind == FieldDescriptor.TYPE_FLOAT:
        return _floats(32)
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_STRING:
        return strings()
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if kind == FieldDescriptor.TYPE_ENUM:
        return _enum_values(field)
    if kind == FieldDescriptor.TYPE_MESSAGE:
        return messages(field.message_type, depth + 1)
    raise TypeError(f"unsupported field type {kind} of {field.full_name}")


def field_values(field: Any, depth: int) -> st.SearchStrategy[Any]:
    """A whole field's value: a list for repeated fields, a dict for maps."""
    if _is_map(field):
        entry = field.message_type
        key = scalar(entry.fields_by_name["key"], depth)
        value = scalar(entry.fields_by_name["value"], depth)
        return st.dictionaries(key, value, max_size=4)
    if _is_repeated(field):
        element = scalar(field, depth)
        return st.one_of(
            st.lists(element, max_size=4),
            # Many copies of one entry: duplicates, and a longer list, cheaply.
            st.tuples(element, st.integers(2, 40)).map(lambda pair: [pair[0]] * pair[1]),
        )
    return scalar(field, depth)


def assign(message: Message, field: Any, value: Any) -> None:
    """Sets a field, replacing what it held."""
    name = field.name
    if _is_map(field):
        target = getattr(message, name)
        target.clear()
        for key, item in value.items():
            if isinstance(item, Message):
                target[key].CopyFrom(item)
            else:
                target[key] = item
    elif _is_repeated(field):
        message.ClearField(name)
        getattr(message, name).extend(value)
    elif field.type == FieldDescriptor.TYPE_MESSAGE:
        getattr(message, name).CopyFrom(value)
    else:
        setattr(message, name, value)


def _groups(descriptor: Any) -> list[list[Any]]:
    """Fields that may be set together: every field alone, except a real oneof's members,
    of which at most one is set (a proto3 `optional` is a synthetic oneof of one field)."""
    groups: list[list[Any]] = []
    seen: set[str] = set()
    for field in descriptor.fields:
        oneof = field.containing_oneof
        if oneof is None or len(oneof.fields) == 1:
            groups.append([field])
        elif oneof.name not in seen:
            seen.add(oneof.name)
            groups.append(list(oneof.fields))
    return groups


def _group_value(group: list[Any], depth: int) -> st.SearchStrategy[tuple[Any, Any]]:
    def tagged(field: Any) -> st.SearchStrategy[tuple[Any, Any]]:
        return field_values(field, depth).map(lambda value: (field, value))

    return st.one_of(*[tagged(f) for f in group])


@cache
def messages(descriptor: Any, depth: int = 0) -> st.SearchStrategy[Message]:
    """Any message of this type; below MAX_DEPTH nested messages are left unset."""
    cls = message_factory.GetMessageClass(descriptor)
    groups = [g for g in _groups(descriptor) if depth < MAX_DEPTH or g[0].type != FieldDescriptor.TYPE_MESSAGE]
    if not groups:
        return st.builds(cls)
    optional = {i: _group_value(group, depth) for i, group in enumerate(groups)}

    def build(chosen: Mapping[int, tuple[Any, Any]]) -> Message:
        out = cls()
        for field, value in chosen.values():
            assign(out, field, value)
        return out

    return st.fixed_dictionaries({}, optional=optional).map(build)


def mutations(seed: Message, depth: int = 0) -> st.SearchStrategy[Message]:
    """The seed with one or two of its fields replaced by fuzzed values, or, for a nested
    message it holds, mutated in turn; a mutation can also clear a field."""
    descriptor = seed.DESCRIPTOR
    fields = list(descriptor.fields)
    if not fields:
        return st.just(seed)

    def one(field: Any) -> st.SearchStrategy[Callable[[Message], None]]:
        options: list[st.SearchStrategy[Callable[[Message], None]]] = [
            field_values(field, depth).map(lambda v: lambda m: assign(m, field, v)),
            st.just(lambda m: m.ClearField(field.name)),
        ]
        nested_set = (
            field.type == FieldDescriptor.TYPE_MESSAGE
            and not _is_repeated(field)
            and seed.HasField(field.name)
            and depth < MAX_DEPTH
        )
        if nested_set:
            options.append(
                mutations(getattr(seed, field.name), depth + 1).map(
                    lambda sub: lambda m: getattr(m, field.name).CopyFrom(sub)
                )
            )
        return st.one_of(*options)

    def apply(edits: list[Callable[[Message], None]]) -> Message:
        out = type(seed)()
        out.CopyFrom(seed)
        for edit in edits:
            edit(out)
        return out

    return st.lists(st.sampled_from(fields).flatmap(one), min_size=1, max_size=2).map(apply)


def requests(descriptor: Any, seeds: list[Message]) -> st.SearchStrategy[Message]:
    """Random messages of the type, mutations of valid ones, and the valid ones as they are."""
    options = [messages(descriptor)]
    if seeds:
        options += [st.sampled_from(seeds).flatmap(mutations), st.sampled_from(seeds)]
    return st.one_of(*options)


M = TypeVar("M", bound=Message)


def resolve(message: M, known: Mapping[str, str]) -> M:
    """A copy with every token in its strings (nested, repeated, map keys and values)
    replaced by the run-time id it names; unknown tokens are left as they are."""
    out = type(message)()
    out.CopyFrom(message)
    _resolve_in(out, known)
    return out


def _sub(text: str, known: Mapping[str, str]) -> str:
    if TOKEN not in text:
        return text
    return _TOKEN_RE.sub(lambda m: known.get(m.group(1), m.group(0)), text)


def _resolve_in(message: Message, known: Mapping[str, str]) -> None:
    for field, value in message.ListFields():
        if _is_map(field):
            entry: Any = field.message_type
            key_is_str = entry.fields_by_name["key"].type == FieldDescriptor.TYPE_STRING
            value_field = entry.fields_by_name["value"]
            items = list(value.items())
            if key_is_str or value_field.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_MESSAGE):
                rebuilt: dict[Any, Any] = {}
                for key, item in items:
                    new_key = _sub(key, known) if key_is_str else key
                    if value_field.type == FieldDescriptor.TYPE_STRING:
                        item = _sub(item, known)
                    elif value_field.type == FieldDescriptor.TYPE_MESSAGE:
                        copy = type(item)()
                        copy.CopyFrom(item)
                        _resolve_in(copy, known)
                        item = copy
                    rebuilt[new_key] = item
                assign(message, field, rebuilt)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            for item in value if _is_repeated(field) else [value]:
                _resolve_in(item, known)
        elif field.type == FieldDescriptor.TYPE_STRING:
            if _is_repeated(field):
                assign(message, field, [_sub(v, known) for v in value])
            else:
                setattr(message, field.name, _sub(value, known))
