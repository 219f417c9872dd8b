"""The schema stays loadable: a v1.0 log with every event type (required fields only, frozen
in tests/data) must decode with every later 1.x schema; fields added later need defaults."""

from pathlib import Path

import msgspec

from kvdiag.events.eventlog import read_log
from kvdiag.events.schema import EVENT_TYPES, SCHEMA_MAJOR, TAGS, event_tag, parse_version

FROZEN_V1_0 = Path(__file__).parent.parent / "data" / "schema_v1_0" / "all_types_required_fields.kvlog"


def test_a_frozen_v1_0_log_loads_with_every_event_type():
    log = read_log(FROZEN_V1_0, strict=True)
    assert parse_version(log.header.schema_version) == (1, 0)
    frozen_tags = {line.split('"type": "')[1].split('"')[0]
                   for line in FROZEN_V1_0.read_text().splitlines()[1:]}
    assert set(log.frames) == frozen_tags
    for tag, frame in log.frames.items():
        assert len(frame) == 1, tag


def test_fields_added_since_v1_0_have_defaults():
    frozen = {}
    for line in FROZEN_V1_0.read_text().splitlines()[1:]:
        obj = msgspec.json.decode(line)
        frozen[obj["type"]] = set(obj)
    for cls in EVENT_TYPES:
        tag = event_tag(cls)
        if tag not in frozen:
            continue  # an event type added later: old logs simply have none
        for field in msgspec.structs.fields(cls):
            if field.required:
                assert field.encode_name in frozen[tag], (
                    f"{cls.__name__}.{field.name} was added without a default: "
                    f"logs written by kvdiag 1.0 would no longer load")


def test_tags_are_unique_and_major_matches():
    assert len(TAGS) == len(EVENT_TYPES)
    assert SCHEMA_MAJOR == 1
