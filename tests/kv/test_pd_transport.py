"""The P/D TCP transport on its own: a real block server and puller over loopback sockets and
real KV tensors (no engine). Block bytes arrive intact between scattered source and
destination blocks; hostile or mismatched peers are refused without taking the server down;
leases end exactly once."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.kv.connector import create_connector
from kvserve.kv.multi_connector import MultiConnector
from kvserve.kv.pd.block_memory import BlockMemory, block_runs
from kvserve.kv.pd.connector import PDConnector
from kvserve.kv.pd.leases import LeaseState, LeaseTable
from kvserve.kv.pd.transfer_client import TcpPuller
from kvserve.kv.pd.transfer_server import TcpBlockServer
from kvserve.kv.pd.transport import PullJob

SHAPE = (4, 2, 16, 2, 8)  # layers, K/V, block size, heads, head dim: 4 KiB per block (fp32)


def kv(num_blocks: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((num_blocks, *SHAPE), generator=g)


class Pair:
    """A producer (server + leases) and a consumer (puller) on separate KV pools."""

    def __init__(self, fingerprint_c: str = "fp", timeout: float = 5.0, **server_kw) -> None:
        self.src = kv(64, seed=1)
        self.dst = torch.zeros((64, *SHAPE))
        self.leases = LeaseTable(timeout=60.0)
        self.server = TcpBlockServer(
            BlockMemory(self.src), self.leases, "fp", timeout=timeout, **server_kw
        )
        self.puller = TcpPuller(BlockMemory(self.dst), fingerprint_c, timeout=timeout)
        self._ids = iter(range(1, 1 << 30))

    def lease(self, block_ids: list[int]):
        hashes = [bytes([i % 256]) * 32 for i in range(len(block_ids))]
        lease = self.leases.add("req", block_ids, hashes)
        self.server.seal(lease)
        return lease

    def pull(self, lease, start: int, end: int, dst: list[int], hashes=None) -> PullJob:
        host, port = self.server.address
        job = PullJob(
            next(self._ids), "req", host, port, lease.lease_id, start, end, dst,
            hashes if hashes is not None else lease.block_hashes[start:end],
        )  # fmt: skip
        self.puller.submit(job)
        deadline = time.monotonic() + 60
        while True:
            done = self.puller.poll()
            if done:
                assert done == [job]
                return job
            assert time.monotonic() < deadline
            time.sleep(0.005)

    def close(self) -> None:
        self.puller.close()
        self.server.close()


@pytest.fixture
def pair():
    made: list[Pair] = []

    def make(**kw) -> Pair:
        p = Pair(**kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def test_block_runs() -> None:
    assert block_runs([]) == []
    assert block_runs([3, 4, 5, 9, 1, 2]) == [(3, 3, 0), (9, 1, 3), (1, 2, 4)]


def test_scattered_blocks_arrive_intact(pair) -> None:
    p = pair()
    src_ids = [7, 8, 9, 30, 2, 3, 50, 51, 52, 53]
    dst_ids = [40, 12, 13, 14, 60, 61, 62, 5, 6, 33]
    lease = p.lease(src_ids)
    job = p.pull(lease, 2, 10, dst_ids[2:])  # the first two are held by the consumer
    assert job.error is None and job.good_blocks == 8
    for s, d in zip(src_ids[2:], dst_ids[2:], strict=True):
        assert torch.equal(p.src[s], p.dst[d])
    assert torch.count_nonzero(p.dst[dst_ids[0]]) == 0  # never asked for
    assert lease.state == LeaseState.RELEASED
    assert p.leases.take_released() == ["req"]
    assert p.server.counts.pulls_ok == 1 and p.server.counts.blocks_sent == 8


def test_lease_serves_one_pull_and_refusals_release_it(pair) -> None:
    p = pair(fingerprint_c="another-model")
    lease = p.lease([1, 2, 3])
    job = p.pull(lease, 0, 3, [10, 11, 12])
    assert job.good_blocks == 0 and "mismatch" in (job.error or "")
    assert lease.state == LeaseState.RELEASED  # refused pulls end the lease too
    job = p.pull(lease, 0, 3, [10, 11, 12])
    assert job.good_blocks == 0 and "unknown" in (job.error or "")
    assert p.leases.take_released() == ["req"]  # once


def test_chain_hash_mismatch_stops_the_pull(pair) -> None:
    p = pair()
    lease = p.lease([1, 2, 3, 4])
    hashes = list(lease.block_hashes)
    hashes[2] = b"\xff" * 32
    job = p.pull(lease, 0, 4, [10, 11, 12, 13], hashes)
    assert job.good_blocks == 2 and "chain hash" in (job.error or "")
    assert torch.equal(p.src[2], p.dst[11])


def test_hostile_clients_do_not_hurt_the_server(pair) -> None:
    p = pair(timeout=1.0)
    lease = p.lease([1, 2])
    host, port = p.server.address
    with socket.create_connection((host, port)) as s:  # a huge length prefix
        s.sendall(struct.pack(">I", 1 << 31))
        assert s.recv(10) == b""  # closed
    with socket.create_connection((host, port)) as s:  # garbage msgpack
        s.sendall(struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1")
        assert s.recv(10) == b""
    with socket.create_connection((host, port)) as s:  # silence: cut after the timeout
        s.settimeout(30)
        assert s.recv(10) == b""
    assert lease.state == LeaseState.WAITING  # no pull named it
    job = p.pull(lease, 0, 2, [5, 6])
    assert job.good_blocks == 2


def test_pulls_beyond_the_limit_wait_for_a_server_thread(pair) -> None:
    """With every serving thread busy (a silent client), a pull waits in the backlog and is
    served once the silent client is cut (server timeout), within the consumer's timeout."""
    p = pair(max_connections=1, timeout=1.0)
    p.puller.timeout = 30.0
    lease = p.lease([1, 2])
    host, port = p.server.address
    idle = socket.create_connection((host, port))  # takes the only serving thread
    try:
        time.sleep(0.3)
        t0 = time.monotonic()
        job = p.pull(lease, 0, 2, [5, 6])
        assert job.good_blocks == 2 and time.monotonic() - t0 >= 0.5
        assert idle.recv(10) == b""  # the silent client was cut
    finally:
        idle.close()


def test_cancelled_pull_wakes_at_once(pair) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    p = pair(timeout=300.0)
    job = PullJob(1, "req", "127.0.0.1", srv.getsockname()[1], "lease", 0, 2, [5, 6], [b"", b""])
    p.puller.submit(job)
    conn, _ = srv.accept()
    time.sleep(0.2)
    t0 = time.monotonic()
    p.puller.cancel(job)
    while not p.puller.poll():
        assert time.monotonic() - t0 < 10
        time.sleep(0.005)
    assert job.cancelled and job.good_blocks == 0
    conn.close()
    srv.close()


def test_expiry_skips_taken_leases() -> None:
    wakeup = threading.Event()
    table = LeaseTable(timeout=0.05, wakeup=wakeup)
    a, b, c = (table.add(f"r{i}", [i], [b"h" * 32]) for i in range(3))
    assert table.take(a.lease_id) is a and table.take(b.lease_id) is b
    time.sleep(0.1)
    assert table.expire() == 1  # c; a and b end with their pulls
    assert wakeup.is_set() and table.take_released() == ["r2"]
    assert table.take(c.lease_id) is None
    table.release(a)
    table.release(a)
    table.release(b)
    assert table.take_released() == ["r0", "r1"] and table.num_active == 0


def test_role_spellings_and_vllm_transfer_config(tiny_model_dir) -> None:
    for role, want in (("kv_producer", "producer"), ("consumer", "consumer"), ("kv_both", "both")):
        cfg = EngineConfig(kv_role=role)
        assert cfg.kv_role == want and cfg.kv_connector == "pd"
    cfg = EngineConfig(
        kv_transfer_config='{"kv_connector":"NixlConnector","kv_role":"kv_consumer",'
        '"kv_ip":"0.0.0.0","kv_port":14579,"engine_id":"e1",'
        '"kv_connector_extra_config":{"lease_timeout":5,"transfer_timeout":2.5}}'
    )
    assert (cfg.kv_role, cfg.kv_transfer_host, cfg.kv_transfer_port) == (
        "consumer",
        "0.0.0.0",
        14579,
    )
    assert (cfg.kv_engine_id, cfg.kv_lease_timeout, cfg.kv_transfer_timeout) == ("e1", 5.0, 2.5)
    assert EngineConfig(kv_connector="pd").kv_role == "both"
    bad = [
        dict(kv_role="decoder"),
        dict(kv_transfer_config="{"),
        dict(kv_transfer_config='{"kv_connector":"LMCacheConnectorV1"}'),
        dict(kv_transfer_config='{"kv_port":"80"}'),
        dict(kv_role="producer", kv_transfer_config='{"kv_role":"kv_consumer"}'),
        dict(kv_role="producer", kv_connector="offload"),
        dict(kv_role="producer", kv_lease_timeout=0),
    ]
    for kw in bad:
        with pytest.raises(ValueError):
            EngineConfig(**kw)
    pd = create_connector(EngineConfig(model=str(tiny_model_dir), kv_role="both"))
    assert isinstance(pd, PDConnector)
    chained = create_connector(
        EngineConfig(model=str(tiny_model_dir), kv_role="both", kv_offload_size=0.01)
    )
    assert isinstance(chained, MultiConnector) and isinstance(chained.connectors[0], PDConnector)
    assert type(chained.connectors[1]).__name__ == "OffloadingConnector"
