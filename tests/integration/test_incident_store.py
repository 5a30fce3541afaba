"""Incidents in the real Redis: many upserted in one transaction behave as one by one."""

from __future__ import annotations

import pytest
import redis

from services.coordinator.store import Store
from unicron.v1 import common_pb2

pytestmark = pytest.mark.integration


def opens(incident_id: str, summary: str):  # type: ignore[no-untyped-def]
    def update(current: common_pb2.Incident | None) -> common_pb2.Incident:
        if current is not None:
            current.summary += f"; {summary}"
            return current
        return common_pb2.Incident(incident_id=incident_id, summary=summary)

    return update


def test_many_incidents_in_one_write_create_and_extend(redis_client: redis.Redis) -> None:
    store = Store(redis_client)
    store.upsert_incident("node:a", opens("inc-a", "a lost"))
    recorded = store.upsert_incidents({"node:b": opens("inc-b", "b lost"), "node:a": opens("inc-x", "a again")})
    assert [(incident.incident_id, created) for incident, created in recorded] == [("inc-b", True), ("inc-a", False)]
    assert store.get_incident("inc-a").summary == "a lost; a again"  # type: ignore[union-attr]
    assert sorted(i.incident_id for i in store.list_incidents()) == ["inc-a", "inc-b"]
    assert store.upsert_incidents({}) == []


def test_a_failing_update_writes_none_of_them(redis_client: redis.Redis) -> None:
    store = Store(redis_client)

    def refuse(_current: common_pb2.Incident | None) -> common_pb2.Incident:
        raise ValueError("no")

    with pytest.raises(ValueError):
        store.upsert_incidents({"node:b": opens("inc-b", "b lost"), "node:c": refuse})
    assert store.list_incidents() == []
