"""Typed settings (msgspec Structs): defaults in default.toml, then a TOML file, then the
environment (PAGEDSERVE_<SECTION>_<KEY>), then command-line flags. Unknown keys are errors
that name them."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path

import msgspec

DEFAULT_TOML = Path(__file__).with_name("default.toml")
ENV_PREFIX = "PAGEDSERVE_"


class ConfigError(ValueError):
    """A setting is unknown or has a bad value (the message names it)."""


# the proposer names config, CLI and docs all read; "prediction" needs none (a request's own field)
SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")


class SpeculativeConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What drafts and how much (vLLM's keys); the engine's policy decides per step how much of it pays."""

    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: the most drafts one sequence verifies in one step
    prompt_lookup_min: int = 1  # ngram: the shortest suffix looked up
    prompt_lookup_max: int = 4  # ngram: the longest suffix looked up (tried first)
    # suffix: past answers per cache scope (vLLM's keys and defaults, but for the request bound)
    suffix_decoding_max_tree_depth: int = 24  # the longest substring counted: match plus drafts
    suffix_decoding_max_cached_requests: int = 1000  # answers kept over all scopes (0: only the own prompt)
    suffix_decoding_max_spec_factor: float = 1.0  # drafts <= this × the match length
    suffix_decoding_min_token_prob: float = 0.1  # stop drafting where the path's frequency falls below this
    # draft_model: a checkpoint with the target's tokenizer (HF folder or GGUF), and its own KV pages. Their
    # memory is its own budget, on top of the target's (engine.kv_cache_memory_bytes), never taken from it
    model: str | None = None
    draft_kv_cache_memory_bytes: int = 64 * 1024 * 1024
    draft_num_blocks: int | None = None  # pages for the draft's KV; None: as many as its memory budget holds
    # the step-cost model's prior: one more token in a step costs this fraction of a one-token step,
    # until the engine has timed steps of different sizes (then its own fit of the clock decides)
    draft_token_cost: float = 0.02
    prior_acceptance: float = 0.5  # a sequence's acceptance estimate before it has verified drafts

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")
        if not self.num_speculative_tokens < self.suffix_decoding_max_tree_depth <= 64:
            raise ConfigError("suffix_decoding_max_tree_depth must be in (num_speculative_tokens, 64], got "
                              f"{self.suffix_decoding_max_tree_depth}")
        if not 0 <= self.suffix_decoding_max_cached_requests <= 1_000_000:
            raise ConfigError("suffix_decoding_max_cached_requests must be in [0, 1000000], got "
                              f"{self.suffix_decoding_max_cached_requests}")
        if not self.suffix_decoding_max_spec_factor > 0:
            raise ConfigError(f"suffix_decoding_max_spec_factor must be > 0, got {self.suffix_decoding_max_spec_factor}")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ConfigError(f"suffix_decoding_min_token_prob must be in [0, 1], got {self.suffix_decoding_min_token_prob}")
        if self.method == "draft_model" and not self.model:
            raise ConfigError("speculative method 'draft_model' needs `model`: the draft checkpoint's path")
        if self.method != "draft_model" and self.model is not None:
            raise ConfigError(f"speculative `model` is for method 'draft_model', not {self.method!r}")
        if self.draft_kv_cache_memory_bytes < 1:
            raise ConfigError(f"draft_kv_cache_memory_bytes must be positive, got {self.draft_kv_cache_memory_bytes}")
        if self.draft_num_blocks is not None and self.draft_num_blocks < 1:
            raise ConfigError(f"draft_num_blocks must be >= 1, got {self.draft_num_blocks}")
        if not self.draft_token_cost >= 0:
            raise ConfigError(f"draft_token_cost must be >= 0, got {self.draft_token_cost}")
        if not 0 < self.prior_acceptance < 1:
            raise ConfigError(f"prior_acceptance must be in (0, 1), got {self.prior_acceptance}")


def parse_speculative_config(value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """A JSON string (the CLI's), a dict (TOML, keyword arguments) or a config; None stays None."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    try:
        if isinstance(value, str):
            return msgspec.json.decode(value, type=SpeculativeConfig)
        return msgspec.convert(value, SpeculativeConfig)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ConfigError(f"speculative config: {exc}") from None


# engine.scheduling: runtime/scheduling_policy.py registers a policy under each name
SCHEDULING_NAMES = ("fcfs", "fair")


class EngineSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How the engine sizes its KV cache and batches."""

    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = 256 * 1024 * 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    seed: int = 0
    kernel_backend: str = "auto"
    pinned_block_budget: int = 64  # pages that pinned prefixes may hold in all
    quantization: str = "auto"  # matmul weights: auto (a GGUF keeps its quantized groups), none, int8, int4
    speculative_config: SpeculativeConfig | None = None  # None: no method (a request's `prediction` still drafts)
    # who is admitted next: "fcfs" (arrival order) or "fair" (virtual token counters per tenant, runtime/fairness.py)
    scheduling: str = "fair"  # measured: BENCHMARKS section 19
    fair_input_weight: float = 1.0  # a computed prompt token's weight in a tenant's counter (the VTC paper's w_p)
    fair_output_weight: float = 2.0  # a generated token's (w_q): a decode costs about twice a prompt token
    # under "fair", while more than one tenant is active: prompt tokens per step at most (0: the step budget);
    # shorter steps bound what a light tenant's first token waits for (BENCHMARKS section 27: 256 halved its
    # p99 under a flood; the flood's throughput cost 0-7% against no cap, 128 cost ~13%)
    fair_prompt_tokens_per_step: int = 256

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"engine.block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"engine.num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_bytes < 1:
            raise ConfigError("engine.kv_cache_memory_bytes must be positive")
        if self.max_num_seqs < 1:
            raise ConfigError(f"engine.max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"engine.max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.quantization not in ("auto", "none", "int8", "int4"):
            raise ConfigError(f"engine.quantization must be auto, none, int8 or int4, got {self.quantization!r}")
        if self.scheduling not in SCHEDULING_NAMES:
            raise ConfigError(f"engine.scheduling must be one of {', '.join(SCHEDULING_NAMES)}, got {self.scheduling!r}")
        if self.fair_input_weight < 0 or self.fair_output_weight < 0 or \
                self.fair_input_weight + self.fair_output_weight <= 0:
            raise ConfigError("engine.fair_input_weight and fair_output_weight must be >= 0, not both 0")
        if self.fair_prompt_tokens_per_step < 0:
            raise ConfigError("engine.fair_prompt_tokens_per_step must be >= 0 (0: no cap)")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ConfigError(f"engine.dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")


TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json")


class ServerSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The HTTP side: where it listens, what it serves, how much it queues."""

    model: str = "demo"  # a Hugging Face checkpoint folder, a GGUF file, or "demo" (random weights)
    served_model_name: str | None = None  # the id clients send; defaults to the folder name
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 1024 * 1024
    max_queued_requests: int = 256  # requests waiting beyond max_num_seqs; past it: wait for a place, then 429
    responses_retention_s: float = 30 * 86400.0  # stored Responses API responses are deleted after this (OpenAI: 30 days)
    admission_wait_s: float = 10.0  # how long a request waits for a place in flight (fair across tenants); 0: 429 at once
    shutdown_timeout_s: float = 30.0
    log_level: str = "info"
    log_json: bool | None = None  # None: JSON unless stderr is a terminal
    tenants_file: str | None = None  # TOML of tenants, keys, plans, limits; None: open, tenant "default"
    redis_url: str | None = None  # None: embedded (SQLite ledger, in-process index and limits)
    data_dir: str = "data"  # the SQLite ledger, the usage journal and the pin registry live here
    reply_after_usage_on_disk: bool = True  # a request's last message waits for its usage record's fsync
    usage_write_timeout_s: float = 10.0  # ... this long at most (then 503; the record stays queued)
    cache_salt_secret: str | None = None  # HMAC key for tenant cache salts; same on every replica
    replica_id: str | None = None  # this replica's name in the prefix index (default: host:port)
    trace_requests: bool = False  # log each request's stages (admission, engine queue, first step, delivery): bench/
    tool_call_parser: str = "auto"  # how tool_choice "auto" reads calls: hermes, llama3_json, auto (from the template)
    max_tool_calls: int = 16  # calls in one constrained answer (tool_choice "required" with parallel calls)
    preprocessing_threads: int = 0  # threads that parse and tokenize request bodies off the loop; 0: one per core
    preprocessing_bulk_bytes: int = 65536  # bodies this large are preprocessed at preprocessing_bulk_nice
    preprocessing_bulk_nice: int = 10  # 0-19: a busy core goes to the engine's threads first
    open_metrics: bool = False  # with tenants: /metrics for anyone, without per-tenant series (admin key: all)
    body_timeout_s: float = 30.0  # a request body must arrive whole within this (slow senders): else 408
    idle_timeout_s: float = 15.0  # a connection without a whole request head this long is closed (slowloris, idle)
    max_connections_per_ip: int = 256  # open connections from one address; more are closed at once (0: no cap)
    max_requests_per_connection: int = 1000  # requests one keep-alive connection carries, then it closes (0: no cap)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"server.port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes < 1024:
            raise ConfigError("server.max_body_bytes must be at least 1024")
        if self.max_queued_requests < 0:
            raise ConfigError("server.max_queued_requests must be >= 0")
        if not self.responses_retention_s > 0:
            raise ConfigError("server.responses_retention_s must be > 0")
        if self.admission_wait_s < 0:
            raise ConfigError("server.admission_wait_s must be >= 0")
        if self.usage_write_timeout_s <= 0:
            raise ConfigError("server.usage_write_timeout_s must be > 0")
        if self.preprocessing_threads < 0:
            raise ConfigError("server.preprocessing_threads must be >= 0 (0: one per core)")
        if self.preprocessing_bulk_bytes < 1:
            raise ConfigError("server.preprocessing_bulk_bytes must be >= 1")
        if not 0 <= self.preprocessing_bulk_nice <= 19:
            raise ConfigError("server.preprocessing_bulk_nice must be in 0..19")
        if not self.body_timeout_s > 0:
            raise ConfigError("server.body_timeout_s must be > 0")
        if not self.idle_timeout_s > 0:
            raise ConfigError("server.idle_timeout_s must be > 0")
        if self.max_connections_per_ip < 0:
            raise ConfigError("server.max_connections_per_ip must be >= 0 (0: no cap)")
        if self.max_requests_per_connection < 0:
            raise ConfigError("server.max_requests_per_connection must be >= 0 (0: no cap)")
        if self.max_tool_calls < 1:
            raise ConfigError("server.max_tool_calls must be >= 1")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"server.tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                              f"got {self.tool_call_parser!r}")


ROUTERS = ("embedded", "dynamo")
ROUTING_MODES = ("kv", "round_robin", "random")


class DistributedSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Past one machine: workers behind NVIDIA Dynamo's router (service/distributed/)."""

    router: str = "embedded"  # serve: "embedded" (the engine in this process) or "dynamo" (remote workers)
    discovery_dir: str = "data/dynamo"  # Dynamo's file discovery: one folder every process of the cluster sees
    namespace: str = "pagedserve"  # Dynamo namespace; workers serve {namespace}.worker.generate
    routing: str = "kv"  # front door: "kv" (Dynamo's KV-aware router), "round_robin", "random"
    kv_prefill_load_scale: float = 1.0  # Dynamo's prefill_load_scale: > 1 weighs cache hits over balance
    kv_events_endpoint: str | None = None  # also publish vLLM-format KV events on this ZMQ PUB address
    kv_events_replay_endpoint: str | None = None  # ... and answer replay requests (ROUTER socket) here
    kv_events_topic: str = "kv-events"
    worker_timeout_s: float = 60.0  # front door: start-up's wait for a first worker; a silent worker's longest hold
    worker_port: int = 0  # worker: its probe port; 0 takes a free one and prints it (never the front door's 8000)

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ConfigError(f"distributed.router must be one of {ROUTERS}, got {self.router!r}")
        if self.routing not in ROUTING_MODES:
            raise ConfigError(f"distributed.routing must be one of {ROUTING_MODES}, got {self.routing!r}")
        if not self.worker_timeout_s > 0:
            raise ConfigError(f"distributed.worker_timeout_s must be > 0, got {self.worker_timeout_s}")
        if not 0 <= self.worker_port <= 65535:
            raise ConfigError(f"distributed.worker_port must be in [0, 65535], got {self.worker_port}")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ConfigError("distributed.kv_events_replay_endpoint needs distributed.kv_events_endpoint")
        if not self.kv_prefill_load_scale > 0:
            raise ConfigError(f"distributed.kv_prefill_load_scale must be > 0, got {self.kv_prefill_load_scale}")
        if "." in self.namespace or not self.namespace:
            raise ConfigError(f"distributed.namespace must be a non-empty name without dots, got {self.namespace!r}")


class Settings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    engine: EngineSettings = msgspec.field(default_factory=EngineSettings)
    server: ServerSettings = msgspec.field(default_factory=ServerSettings)
    distributed: DistributedSettings = msgspec.field(default_factory=DistributedSettings)


SECTIONS = {"engine": EngineSettings, "server": ServerSettings, "distributed": DistributedSettings}


def _env_table(environ: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """PAGEDSERVE_ENGINE_NUM_BLOCKS=64 -> {"engine": {"num_blocks": "64"}}; unknown keys raise."""
    table: dict[str, dict[str, str]] = {}
    for name, value in environ.items():
        for section, struct in SECTIONS.items():
            prefix = f"{ENV_PREFIX}{section.upper()}_"
            if name.startswith(prefix):
                key = name[len(prefix) :].lower()
                if key not in struct.__struct_fields__:
                    raise ConfigError(f"unknown setting {name} (no {section}.{key})")
                table.setdefault(section, {})[key] = value
    return table


def _merge(base: dict, update: Mapping) -> None:
    for section, values in update.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown settings section [{section}]")
        if not isinstance(values, Mapping):
            raise ConfigError(f"[{section}] must be a table")
        base.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})


def load_settings(
    path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping] | None = None,
) -> Settings:
    """Defaults, then the TOML file at `path`, then PAGEDSERVE_* variables, then `overrides`
    ({"engine": {...}, "server": {...}}; None values are ignored)."""
    table: dict = {}
    _merge(table, tomllib.loads(DEFAULT_TOML.read_text()))
    if path is not None:
        try:
            _merge(table, tomllib.loads(Path(path).read_text()))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read settings file {path}: {exc}") from exc
    from_env = _env_table(os.environ if environ is None else environ)
    try:
        msgspec.convert(table, Settings)  # the file's values keep their own types, checked strictly
        typed_env: dict[str, dict] = {}
        for section, values in from_env.items():  # environment strings convert field by field
            struct = SECTIONS[section]
            for key, text in values.items():
                typed = msgspec.convert({key: text}, _one_field(struct, key), strict=False)
                typed_env.setdefault(section, {})[key] = getattr(typed, key)
        _merge(table, typed_env)
        _merge(table, overrides or {})
        return msgspec.convert(table, Settings)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"settings: {exc}") from exc


def _one_field(struct: type, key: str) -> type:
    """A Struct type with just `key` of `struct`, to convert one environment string."""
    annotation = {f.name: f.type for f in msgspec.structs.fields(struct)}[key]
    return msgspec.defstruct(f"{struct.__name__}_{key}", [(key, annotation)])


def load_engine_settings(path: str | Path | None = None, **overrides) -> EngineSettings:
    """Engine settings alone: defaults, the file's [engine] table, then keyword overrides."""
    return load_settings(path, environ={}, overrides={"engine": overrides}).engine
