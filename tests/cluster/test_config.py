"""Router config: YAML schema, validation errors, CLI flags, the example file."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvserve.cluster.cli import add_arguments, config_from_args, parse_endpoint_flag
from kvserve.cluster.config import (
    ConfigError,
    RouterConfig,
    load_router_config,
    parse_endpoints,
    router_config_from_dict,
)
from kvserve.cluster.endpoints import parse_prometheus_text

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "router.yaml"


def test_example_config_loads_and_builds_a_router() -> None:
    from kvserve.cluster.gateway import Router

    cfg = load_router_config(str(EXAMPLE))
    assert cfg.endpoints and cfg.endpoints[0].kv_events
    assert {s.name for s in cfg.scheduler.scorers} >= {"precise_prefix", "load"}
    Router(cfg)  # every scorer/picker/filter name in it is known


def test_defaults_and_nested_values() -> None:
    cfg = router_config_from_dict(
        {
            "endpoints": ["http://a:1/", {"url": "http://b:1", "kv_events": "tcp://b:2"}],
            "health": {"interval_s": 2},
            "scheduler": {"scorers": ["load", {"name": "precise_prefix", "weight": 5}]},
            "index": {"tier_weights": {"CPU": 0.7}},
        }
    ).validate()
    assert cfg.endpoints[0].url == "http://a:1" and cfg.endpoints[0].key == "http://a:1"
    assert cfg.health.interval_s == 2.0 and cfg.health.unhealthy_after == 2
    assert [(s.name, s.weight) for s in cfg.scheduler.scorers] == [
        ("load", 1.0),
        ("precise_prefix", 5.0),
    ]
    assert cfg.scheduler.picker.name == "max_score" and cfg.port == 8080


@pytest.mark.parametrize(
    "data, msg",
    [
        ({"endpoints": ["http://a:1"], "prot": 1}, "unknown key"),
        ({"endpoints": ["http://a:1"], "health": {"interval": 1}}, "health: unknown key"),
        ({"endpoints": ["ftp://a"]}, "http://"),
        ({"endpoints": ["http://a:1"], "port": "x"}, "port: expected int"),
        ({"endpoints": [{"url": "http://a:1", "kv_events_replay": "tcp://a:2"}]}, "replay"),
        ({}, "no endpoints"),
        ({"endpoints": ["http://a:1", "http://a:1/"]}, "duplicate"),
    ],
)
def test_bad_configs_name_the_problem(data: dict, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        router_config_from_dict(data).validate()


def test_unknown_scorer_fails_at_startup() -> None:
    from kvserve.cluster.gateway import Router

    cfg = router_config_from_dict(
        {"endpoints": ["http://a:1"], "scheduler": {"scorers": ["clairvoyance"]}}
    )
    with pytest.raises(ValueError, match="unknown scorer"):
        Router(cfg)


def test_config_file_errors_and_relative_endpoints_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("endpoints: [\n")
    with pytest.raises(ConfigError, match="cannot read"):
        load_router_config(str(bad))
    (tmp_path / "r.yaml").write_text("endpoints_file: eps.json\n")
    cfg = load_router_config(str(tmp_path / "r.yaml"))
    assert cfg.endpoints_file == str(tmp_path / "eps.json")
    assert parse_endpoints({"endpoints": [{"url": "http://x:1", "model": "m"}]})[0].model == "m"
    assert parse_endpoints(None) == []


def test_cli_flags_override_the_file() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--config", str(EXAMPLE),
            "--port", "9999",
            "--endpoint", "http://127.0.0.1:1,events=tcp://127.0.0.1:2,replay=tcp://127.0.0.1:3",
            "--scorer", "precise_prefix=3",
            "--scorer", "load",
            "--picker", "weighted_random",
        ]
    )  # fmt: skip
    cfg = config_from_args(args)
    assert cfg.port == 9999 and cfg.scheduler.picker.name == "weighted_random"
    assert [(s.name, s.weight) for s in cfg.scheduler.scorers] == [
        ("precise_prefix", 3.0),
        ("load", 1.0),
    ]
    assert cfg.endpoints[-1].kv_events_replay == "tcp://127.0.0.1:3"
    with pytest.raises(ConfigError, match="bad option"):
        parse_endpoint_flag("http://a:1,evnts=x")
    args = parser.parse_args([])
    with pytest.raises(ConfigError, match="no endpoints"):
        config_from_args(args)
    assert RouterConfig().block_size == 16


def test_pd_roles_and_flags() -> None:
    cfg = router_config_from_dict(
        {
            "endpoints": [
                {"url": "http://p:1", "role": "prefill"},
                {"url": "http://d:1", "role": "kv_consumer"},
                "http://b:1",
            ],
            "pd": {"threshold": 256, "prefill_scorers": ["load"], "prefill_timeout_s": 5},
        }
    ).validate()
    assert [e.role for e in cfg.endpoints] == ["prefill", "decode", "both"]
    assert cfg.pd.enabled and cfg.pd.prefill_timeout_s == 5.0
    assert [s.name for s in cfg.pd.prefill_scorers] == ["load"]
    with pytest.raises(ConfigError, match="pd: unknown key"):
        router_config_from_dict({"endpoints": ["http://a:1"], "pd": {"treshold": 1}})
    with pytest.raises(ConfigError, match="pd.threshold"):
        router_config_from_dict({"endpoints": ["http://a:1"], "pd": {"threshold": -5}}).validate()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--endpoint", "http://127.0.0.1:1,role=prefill",
            "--endpoint", "http://127.0.0.1:2,role=decode,name=d",
            "--pd-threshold", "512",
            "--pd-prefill-timeout", "7.5",
            "--pd-prefill-max-active", "3",
        ]
    )  # fmt: skip
    cfg = config_from_args(args)
    assert [e.role for e in cfg.endpoints] == ["prefill", "decode"]
    assert (cfg.pd.threshold, cfg.pd.prefill_timeout_s, cfg.pd.prefill_max_active) == (512, 7.5, 3)
    with pytest.raises(ConfigError, match="role"):
        parse_endpoint_flag("http://a:1,role=prefil")
    assert load_router_config(str(EXAMPLE)).pd.threshold == 0  # the example: P/D off


def test_prometheus_text_parsing() -> None:
    text = (
        "# HELP vllm:num_requests_running x\n"
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="a",engine="0"} 3.0\n'
        'vllm:num_requests_running{model_name="a",engine="1"} 2\n'
        "vllm:num_requests_waiting 4 1700000000000\n"
        'vllm:kv_cache_usage_perc{model_name="a"} 0.5\n'
        "vllm:num_requests_running_total 99\n"
        "garbage line\n"
        'vllm:kv_cache_usage_perc{x="}"} nan-ish\n'
    )
    assert parse_prometheus_text(text) == {
        "vllm:num_requests_running": 5.0,
        "vllm:num_requests_waiting": 4.0,
        "vllm:kv_cache_usage_perc": 0.5,
    }
