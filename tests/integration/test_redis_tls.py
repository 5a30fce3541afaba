"""The coordinator's Redis over mutual TLS (rediss://): a real redis-server that serves TLS
alone and asks every client for a certificate of the cluster's CA. The coordinator's store
and lease work through it; a plaintext client, a client without a certificate and one whose
certificate another CA signed are refused."""

from __future__ import annotations

import dataclasses
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from services.coordinator.__main__ import CoordinatorConfig, redis_tls
from services.coordinator.lease import Lease, lease_client
from services.coordinator.redis_store import RedisStore
from unicron import certs, redisutil
from unicron.errors import FailedPrecondition, InvalidArgument
from unicron.v1 import common_pb2

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> certs.DevPKI:
    return certs.create_dev_pki(tmp_path_factory.mktemp("pki"), nodes=[])


def tls_of(pki: certs.DevPKI, name: str) -> redisutil.RedisTLS:
    leaf = pki.backends[name] if name in pki.backends else pki.services[name]
    return redisutil.RedisTLS(str(pki.ca), str(leaf.cert), str(leaf.key))


@pytest.fixture(scope="module")
def server(pki: certs.DevPKI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[redisutil.LocalRedis]:
    with redisutil.LocalRedis(tmp_path_factory.mktemp("redis"), tls=tls_of(pki, "redis")) as local:
        yield local


def coordinator_config(pki: certs.DevPKI, url: str) -> CoordinatorConfig:
    leaf = pki.services["coordinator"]
    return CoordinatorConfig(
        tls_ca=str(pki.ca),
        tls_cert=str(leaf.cert),
        tls_key=str(leaf.key),
        tokens_file=str(pki.tokens_file),
        redis_url=url,
    )


def test_the_coordinators_store_and_lease_work_over_tls(pki: certs.DevPKI, server: redisutil.LocalRedis) -> None:
    assert server.url.startswith("rediss://")
    config = coordinator_config(pki, server.url)
    tls = redis_tls(config)
    assert tls == tls_of(pki, "coordinator")
    store = RedisStore(redisutil.connect(config.redis_url, tls))
    job = common_pb2.Job(job_id="j1", spec=common_pb2.JobSpec(name="over-tls"), state=common_pb2.JOB_STATE_PENDING)
    store.create_job(job, common_pb2.JobEvent(job_id="j1", message="submitted"))
    assert store.get_job("over-tls").job_id == "j1"
    lease = Lease(lease_client(config.redis_url, 3.0, tls), "coordinator-a", ttl_s=3.0)
    assert lease.try_acquire()


def test_a_client_without_the_clusters_certificate_is_refused(
    pki: certs.DevPKI, server: redisutil.LocalRedis, tmp_path: Path
) -> None:
    plain = redis.Redis.from_url(server.url.replace("rediss://", "redis://"), socket_timeout=2.0)
    with pytest.raises(redis.RedisError):
        plain.ping()
    anonymous = redis.Redis.from_url(server.url, socket_timeout=2.0, ssl_ca_certs=str(pki.ca), ssl_cert_reqs="required")
    with pytest.raises((redis.RedisError, ssl.SSLError)):
        anonymous.ping()
    stranger = certs.create_dev_pki(tmp_path / "other", nodes=[])
    with pytest.raises((redis.RedisError, ssl.SSLError)):
        redisutil.connect(server.url, dataclasses.replace(tls_of(stranger, "coordinator"), ca=str(pki.ca))).ping()
    assert not redisutil.reachable(server.url, tls_of(stranger, "coordinator"))  # nor the server to it
    with pytest.raises(FailedPrecondition, match="needs a CA"):
        redisutil.connect(server.url)


def test_rediss_needs_the_coordinators_tls_files(pki: certs.DevPKI) -> None:
    with pytest.raises(InvalidArgument) as refused:
        CoordinatorConfig(plaintext=True, redis_url="rediss://127.0.0.1:6379/0")
    assert refused.value.field == "redis_url"
    with pytest.raises(InvalidArgument, match="must be redis://") as refused:
        coordinator_config(pki, "http://127.0.0.1:6379")
    assert refused.value.field == "redis_url"
    assert redis_tls(coordinator_config(pki, "redis://127.0.0.1:6379/0")) is None
