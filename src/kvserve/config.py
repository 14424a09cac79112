"""Every configuration dataclass of kvserve, and the CLI flags derived from them.

Each field becomes a flag ``--field-name`` (its docstring comment is the help text), so the
offline API (``LLM(**kwargs)``), the CLI and the server share one definition.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

GiB = 1 << 30

# Default offload chunk (tokens). The per-chunk bookkeeping (lookup, pinning, headers, events)
# is paid once per chunk; copies merge consecutive chunks into long runs whatever their size;
# only full chunks are stored, so a prompt's last partial chunk is recomputed. 64 tokens (4
# blocks of 16) measured ~0.1% of prefill throughput above 256-token chunks on the tiny preset,
# while a 2000-token prompt's TTFT from the tier was 19 ms instead of 55 ms. For reference,
# LMCache's default chunk is 256 tokens; vLLM's offloading connector defaults its offloaded
# block size to the engine block size ("block_size" in kv_connector_extra_config).
DEFAULT_OFFLOAD_BLOCK_SIZE = 64


@dataclass
class EngineConfig:
    """One engine instance."""

    model: str = ""  # local Hugging Face-format model directory
    tokenizer: str | None = None  # defaults to the model directory
    served_model_name: str | None = None  # name in the API; defaults to the directory name
    # auto: bf16 on CUDA; on CPU bf16 with native bf16 (AVX512_BF16/AMX) unless the checkpoint
    # is fp32, else fp32
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    attention_backend: str = "auto"  # auto | native | torch (auto: native on AVX-512 CPUs)
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # primary pool size in blocks (overrides kv_cache_memory)
    kv_cache_memory: float = 1.0  # primary pool size in GiB when num_kv_blocks is unset
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    max_num_seqs: int = 64  # running requests at once
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill splits)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # KV cache groups per attention type (hybrid / sliding-window models): sliding-window
    # layers keep only their window's blocks; off: every layer keeps every token's KV
    kv_groups: bool = True  # one KV cache group per attention type (--no-kv-groups: one group)
    prefix_hash_seed: str = "kvserve"  # seed of the block hash chain (same on every instance)
    seed: int = 0  # default sampling seed
    # torch intra-op threads on CPU (default: the usable cores minus one for the server's own
    # threads, at most torch's own default; see engine/model_runner.configure_threads)
    num_threads: int | None = None
    # torch threads for heavy steps (at least heavy_step_min_tokens tokens: their compute
    # dwarfs the server's work per step). None: every thread torch has by default (the core
    # left to the server is lent back for the step) unless num_threads is given or storage
    # tiers are attached, then num_threads; heavy_step_min_tokens None: the tokens whose
    # projections take HEAVY_STEP_GFLOP on this model (see model_runner.heavy_step_threads)
    heavy_step_threads: int | None = None
    heavy_step_min_tokens: int | None = None
    debug: bool = False  # check pool integrity after every step
    # KV connector (offloading, P/D transfer); None disables.
    kv_connector: str | None = None
    kv_offload_size: float = 0.0  # GiB of host memory for the offload tier (0: off)
    kv_offload_policy: str = "lru"  # lru | arc
    # tokens per offload chunk, a multiple of block_size (default for the offload connector:
    # DEFAULT_OFFLOAD_BLOCK_SIZE = 64, or block_size if larger)
    kv_offload_block_size: int | None = None
    # Storage tiers below host memory, in lookup order (repeatable):
    # disk:path=DIR,size=GiB | fs:path=DIR,size=GiB | redis:url=redis://HOST:PORT/0[,...]
    kv_tier: list[str] = field(default_factory=list)
    kv_tiers_config: str | None = None  # YAML file: a list of tiers ({type: disk, path: ...})
    kv_tier_lookup_timeout: float = 0.5  # s; a storage lookup slower than this is a miss
    kv_tier_io_threads: int = 4  # threads reading storage tiers (lookups, loads)
    kv_tier_max_pending_writes: int = 256  # chunks queued for storage; more are dropped
    # Writes to the storage tiers (the cascade of host stores). In a writer process of their
    # own by default (the host tier in shared memory; checksums and kernel copies off the
    # engine's GIL and process); --no-kv-tier-write-process: writer threads in the engine.
    kv_tier_write_process: bool = True
    kv_tier_write_threads: int = 2  # concurrent writes (threads of the writer)
    kv_tier_write_batch: int = 4  # chunks per tier call (one pipeline, one pacing step)
    kv_tier_write_duty: float = 1.0  # fraction of time writers may write, in (0, 1]
    kv_tier_write_policy: str = "idle"  # writers' CPU scheduling: idle (SCHED_IDLE) | nice | normal
    kv_tier_write_pause: bool = False  # hold writes while a step's forward computes
    # KV events publishing (ZMQ PUB, vLLM wire format).
    kv_events_endpoint: str | None = None  # e.g. tcp://*:5557
    kv_events_replay_endpoint: str | None = None  # e.g. tcp://*:5558
    kv_events_topic: str | None = None  # default kv@<host>:<port>@<model>
    kv_events_buffer: int = 10000  # batches kept for replay
    # CURVE on the event and replay sockets (ZeroMQ key files; events carry prompt tokens)
    kv_events_curve_secret_key: str | None = None  # this engine's .key_secret file
    kv_events_curve_allowed_clients: str | None = None  # dir of admitted subscribers' .key
    enable_kv_cache_events: bool = False  # record events (implied by kv_events_endpoint)
    # Prefill/decode disaggregation (kv/pd): this engine serves its KV to decode engines
    # (producer), pulls KV from prefill engines (consumer), or both. vLLM's spellings
    # kv_producer | kv_consumer | kv_both are accepted.
    kv_role: str | None = None  # producer | consumer | both
    # vLLM-style JSON, e.g. '{"kv_connector":"pd","kv_role":"kv_both","kv_port":14579}'
    # (kv_ip, kv_port, engine_id, kv_connector_extra_config.{lease,transfer}_timeout map too)
    kv_transfer_config: str | None = None
    kv_transfer_host: str = "127.0.0.1"  # the producer's block server address (advertised)
    kv_transfer_port: int = 0  # the producer's block server port (0: a free one)
    kv_lease_timeout: float = 30.0  # s; blocks held for a decode side that never pulls are freed
    kv_transfer_timeout: float = 10.0  # s without progress before a pull is given up (recompute)
    kv_engine_id: str | None = None  # names this engine in kv_transfer_params (default: random)

    def __post_init__(self) -> None:
        if self.attention_backend not in ("auto", "native", "torch"):
            raise ValueError(
                f"attention_backend must be auto, native or torch, got {self.attention_backend!r}"
            )
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if (self.num_threads or 0) < 0 or (self.heavy_step_threads or 0) < 0:
            raise ValueError("num_threads and heavy_step_threads must be >= 0")
        if self.heavy_step_min_tokens is not None and self.heavy_step_min_tokens < 1:
            raise ValueError("heavy_step_min_tokens must be >= 1")
        if (self.kv_tier or self.kv_tiers_config) and self.kv_offload_size <= 0:
            raise ValueError(
                "storage tiers (kv_tier / kv_tiers_config) are staged through the host-memory "
                "tier: set kv_offload_size > 0 (GiB) too"
            )
        if self.kv_tiers_config:
            _apply_tier_write_options(self, self.kv_tiers_config)
        if not 0.0 < self.kv_tier_write_duty <= 1.0:
            raise ValueError(f"kv_tier_write_duty must be in (0, 1], got {self.kv_tier_write_duty}")
        if (policy := self.kv_tier_write_policy) not in ("idle", "nice", "normal"):
            raise ValueError(f"kv_tier_write_policy must be idle, nice or normal, got {policy!r}")
        if min(self.kv_tier_write_threads, self.kv_tier_write_batch) < 1:
            raise ValueError("kv_tier_write_threads and kv_tier_write_batch must be >= 1")
        if self.kv_tier_max_pending_writes < 1:
            raise ValueError("kv_tier_max_pending_writes must be >= 1")
        if self.kv_transfer_config:
            _apply_kv_transfer_config(self, self.kv_transfer_config)
        if self.kv_role is not None:
            self.kv_role = _kv_role(self.kv_role)
            if self.kv_connector not in (None, "pd"):
                raise ValueError(f"kv_role needs the pd connector, not {self.kv_connector!r}")
            self.kv_connector = "pd"  # chained with offloading when kv_offload_size > 0
        elif self.kv_connector == "pd":
            self.kv_role = "both"
        if self.kv_lease_timeout <= 0 or self.kv_transfer_timeout <= 0:
            raise ValueError("kv_lease_timeout and kv_transfer_timeout must be > 0")
        if not 0 <= self.kv_transfer_port < 65536:
            raise ValueError(f"kv_transfer_port must be in [0, 65535], got {self.kv_transfer_port}")
        if self.kv_offload_size and not self.kv_connector:
            self.kv_connector = "offload"
        chained = self.kv_connector == "pd" and self.kv_offload_size > 0  # pd + offload
        if (self.kv_connector == "offload" or chained) and self.kv_offload_block_size is None:
            self.kv_offload_block_size = max(DEFAULT_OFFLOAD_BLOCK_SIZE, self.block_size)
        if self.kv_offload_block_size is not None and (
            self.kv_offload_block_size % self.block_size
        ):
            raise ValueError("kv_offload_block_size must be a multiple of block_size")


_KV_ROLES = {
    "producer": "producer", "kv_producer": "producer",
    "consumer": "consumer", "kv_consumer": "consumer",
    "both": "both", "kv_both": "both",
}  # fmt: skip
# vLLM connectors whose kv_transfer_params contract the pd connector speaks.
_PD_CONNECTOR_NAMES = ("pd", "NixlConnector")


def _kv_role(role: str) -> str:
    if not isinstance(role, str) or role not in _KV_ROLES:
        raise ValueError(f"kv_role must be one of {sorted(_KV_ROLES)}, got {role!r}")
    return _KV_ROLES[role]


def _apply_kv_transfer_config(cfg: EngineConfig, text: str) -> None:
    """Fill the P/D fields from vLLM's ``--kv-transfer-config`` JSON (unknown keys of vLLM's
    config are ignored; a field given both ways must agree)."""
    import json

    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"kv_transfer_config is not valid JSON: {e}") from e
    if not isinstance(d, dict):
        raise ValueError("kv_transfer_config must be a JSON object")
    name = d.get("kv_connector")
    if name is not None and name not in _PD_CONNECTOR_NAMES:
        raise ValueError(
            f"kv_transfer_config: kv_connector {name!r} is not supported; use one of "
            f"{list(_PD_CONNECTOR_NAMES)} (kvserve's TCP transport speaks their contract)"
        )
    extra = d.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError("kv_transfer_config: kv_connector_extra_config must be an object")
    given = {  # field: (JSON key, value)
        "kv_role": ("kv_role", _kv_role(d["kv_role"]) if "kv_role" in d else None),
        "kv_transfer_host": ("kv_ip", d.get("kv_ip")),
        "kv_transfer_port": ("kv_port", d.get("kv_port")),
        "kv_engine_id": ("engine_id", d.get("engine_id")),
        "kv_lease_timeout": ("lease_timeout", extra.get("lease_timeout")),
        "kv_transfer_timeout": ("transfer_timeout", extra.get("transfer_timeout")),
    }
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    for key, (json_key, value) in given.items():
        if value is None:
            continue
        want = type(defaults[key]) if defaults[key] is not None else str
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, want) or isinstance(value, bool):
            raise ValueError(f"kv_transfer_config: {json_key} must be of type {want.__name__}")
        current = getattr(cfg, key)
        if key == "kv_role" and current is not None:
            current = _kv_role(current)
        if current not in (defaults[key], value):
            raise ValueError(f"kv_transfer_config sets {key}={value!r}, the flag {current!r}")
        setattr(cfg, key, value)


def _apply_tier_write_options(cfg: EngineConfig, path: str) -> None:
    """The tier YAML file's ``write:`` mapping (``process``, ``threads``, ``batch``, ``duty``,
    ``policy``, ``pause``, ``max_pending``) sets ``kv_tier_write_*`` (``max_pending``:
    ``kv_tier_max_pending_writes``) where the flag or argument left the default."""
    from kvserve.kv.backends.storage import load_tier_write_options

    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    for key, value in load_tier_write_options(path).items():
        name = "kv_tier_max_pending_writes" if key == "max_pending" else f"kv_tier_write_{key}"
        if name not in defaults:
            raise ValueError(f"{path}: unknown write option {key!r}")
        want = type(defaults[name])
        if want is bool and not isinstance(value, bool):
            raise ValueError(f"{path}: write option {key} must be true or false")
        if getattr(cfg, name) == defaults[name]:
            setattr(cfg, name, want(value))


@dataclass
class ServerConfig:
    """The OpenAI-compatible HTTP server of one engine."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_n: int = 16  # largest accepted `n`
    log_level: str = "warning"
    # Authentication (kvserve.server.auth). `kvserve serve` also reads VLLM_API_KEY and
    # KVSERVE_API_KEY when no --api-key is given.
    api_key: list[str] = field(default_factory=list)  # bearer key for /v1/* (repeatable)
    api_key_all_endpoints: bool = False  # the key guards /metrics, /version, docs too (not /health)
    # Limits (kvserve.server.limits): each refused with a 4xx naming the limit.
    max_request_body_bytes: int = 8 << 20  # larger bodies: 413
    max_seqs_per_request: int = 256  # prompts x n of one request
    max_prompts_per_request: int = 256  # entries of a completions prompt list
    max_stop_strings: int = 64  # stop strings of a request (and, separately, stop_token_ids)
    max_stop_chars: int = 4096  # total characters of a request's stop strings
    max_messages: int = 2048  # messages of a chat request
    # Admission: sequences in the engine beyond max_num_seqs; more get 429 with Retry-After.
    max_waiting_requests: int = 2048
    timeout_keep_alive: float = 5.0  # seconds an idle keep-alive connection stays open
    timeout_request_header: float = 10.0  # seconds a request's header may take to arrive
    tokenizer_workers: int = 1  # processes tokenizing large prompts off the loop (0: inline)
    # The engine steps in a process of its own (vLLM v1's EngineCore), not on a thread of the
    # HTTP server's process: no step waits for the event loop's GIL. Data-parallel ranks are
    # processes already and keep the thread.
    engine_process: bool = True


@dataclass
class ParallelConfig:
    """Data-parallel ranks of one server (kvserve.server.data_parallel) and expert parallelism
    across them (kvserve.engine.parallel)."""

    data_parallel_size: int = 1  # engine ranks, one process each, on ports port..port+N-1
    enable_expert_parallel: bool = False  # shard MoE experts over the ranks (torch.distributed)
    data_parallel_rank: int | None = None  # set by the supervisor in each rank's process
    data_parallel_master_port: int = 0  # torch.distributed rendezvous port (0: a free one)
    data_parallel_backend: str = "auto"  # auto | gloo | nccl (auto: nccl on CUDA, gloo on CPU)


# ---------------------------------------------------------------------------------------------
# CLI derivation


def _base_type(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return tp


def add_dataclass_args(
    parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()
) -> None:
    """Add ``--field-name`` for every field of dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        tp = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        if typing.get_origin(tp) is list:  # repeatable flag
            (item,) = typing.get_args(tp)
            parser.add_argument(flag, type=item, action="append", default=None)
        elif tp is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            parser.add_argument(flag, type=tp, default=default)


def from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    kwargs = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(cls)
        if hasattr(args, f.name)
        # a repeatable flag never given: the field's default_factory applies
        and not (getattr(args, f.name) is None and f.default_factory is not dataclasses.MISSING)
    }
    kwargs.update(overrides)
    return cls(**kwargs)


def replace(cfg: Any, **changes: Any) -> Any:
    return dataclasses.replace(cfg, **changes)


__all__ = [
    "EngineConfig",
    "ServerConfig",
    "ParallelConfig",
    "GiB",
    "add_dataclass_args",
    "from_args",
    "replace",
    "field",
]
