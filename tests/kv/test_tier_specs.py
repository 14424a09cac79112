"""Tier configuration: CLI specs, YAML files, the offline API's dicts, sizes."""

from __future__ import annotations

import argparse

import pytest

from kvserve.config import EngineConfig, add_dataclass_args, from_args
from kvserve.kv.backends.storage import load_tier_specs, parse_size, parse_tier_spec


def test_cli_spec_with_url_and_options() -> None:
    spec = parse_tier_spec("redis:url=redis://:pw@10.0.0.5:6379/0?ssl=1,ttl=600,watermark=2GiB")
    assert spec.type == "redis"
    assert spec.options == {"url": "redis://:pw@10.0.0.5:6379/0?ssl=1", "ttl": "600",
                            "watermark": "2GiB"}  # fmt: skip
    assert "pw" not in spec.describe() and "10.0.0.5:6379" in spec.describe()
    assert parse_tier_spec({"type": "disk", "path": "/x", "size": 2}).options == {
        "path": "/x", "size": 2,
    }  # fmt: skip
    with pytest.raises(ValueError, match="key=value"):
        parse_tier_spec("disk:/var/kv")
    with pytest.raises(ValueError, match="no 'type'"):
        parse_tier_spec({"path": "/x"})


def test_sizes() -> None:
    assert parse_size(2) == 2 << 30
    assert parse_size("0.5") == 1 << 29
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("2TB") == 2 * 10**12
    assert parse_size("4096B") == 4096


def test_yaml_then_cli_order(tmp_path) -> None:
    f = tmp_path / "tiers.yaml"
    f.write_text("tiers:\n  - {type: disk, path: /d, size: 64}\n  - type: fs\n    path: /mnt/kv\n")
    specs = load_tier_specs(["redis:url=redis://127.0.0.1:6379"], str(f))
    assert [s.type for s in specs] == ["disk", "fs", "redis"]
    assert specs[1].options == {"path": "/mnt/kv"}


def test_repeatable_flag_and_validation() -> None:
    p = argparse.ArgumentParser()
    add_dataclass_args(p, EngineConfig)
    args = p.parse_args(
        ["--kv-offload-size", "1", "--kv-tier", "disk:path=/d,size=4", "--kv-tier", "fs:path=/f"]
    )
    cfg = from_args(EngineConfig, args)
    assert cfg.kv_tier == ["disk:path=/d,size=4", "fs:path=/f"]
    assert from_args(EngineConfig, p.parse_args([])).kv_tier == []
    with pytest.raises(ValueError, match="kv_offload_size"):
        EngineConfig(kv_tier=["fs:path=/f"])


def test_write_options_from_cli_yaml_and_api(tmp_path) -> None:
    """Write duty, policy, pause, queue bound and the writer process: flags, the YAML file's
    ``write:`` mapping (an explicit flag wins) and ``LLM(...)``'s keyword arguments."""
    p = argparse.ArgumentParser()
    add_dataclass_args(p, EngineConfig)
    args = p.parse_args(
        ["--kv-offload-size", "1", "--kv-tier", "fs:path=/f", "--no-kv-tier-write-process",
         "--kv-tier-write-duty", "0.5", "--kv-tier-write-policy", "nice",
         "--kv-tier-write-pause", "--kv-tier-max-pending-writes", "64"]
    )  # fmt: skip
    cfg = from_args(EngineConfig, args)
    assert (cfg.kv_tier_write_process, cfg.kv_tier_write_duty, cfg.kv_tier_write_policy) == (
        False, 0.5, "nice",
    )  # fmt: skip
    assert cfg.kv_tier_write_pause and cfg.kv_tier_max_pending_writes == 64
    f = tmp_path / "tiers.yaml"
    f.write_text(
        "tiers:\n  - {type: fs, path: /f}\nwrite: {duty: 0.25, policy: normal, pause: true,"
        " max_pending: 32, threads: 3, batch: 2, process: false}\n"
    )
    cfg = EngineConfig(kv_offload_size=1, kv_tiers_config=str(f), kv_tier_write_policy="nice")
    assert cfg.kv_tier_write_duty == 0.25 and cfg.kv_tier_write_policy == "nice"  # flag wins
    assert cfg.kv_tier_write_pause and not cfg.kv_tier_write_process
    assert (cfg.kv_tier_max_pending_writes, cfg.kv_tier_write_threads) == (32, 3)
    assert cfg.kv_tier_write_batch == 2
    f.write_text("tiers: []\nwrite: {dutty: 0.5}\n")
    with pytest.raises(ValueError, match="unknown write option 'dutty'"):
        EngineConfig(kv_offload_size=1, kv_tiers_config=str(f))
    with pytest.raises(ValueError, match="kv_tier_write_duty"):
        EngineConfig(kv_tier_write_duty=0)
    with pytest.raises(ValueError, match="kv_tier_write_policy"):
        EngineConfig(kv_tier_write_policy="fast")
