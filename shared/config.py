"""Every setting of every service, from one place: CLI flags, else `CUSTODY_*` environment
variables, else the defaults below. `custody up --help` lists them all."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass, fields
from pathlib import Path

from shared.dtypes import check_dtype, sizing_dtype
from shared.model_config import ModelConfig
from shared.redis_server import free_port
from shared.sglang_flags import ALIASES, VALUES
from shared.streams import REPLICA_ID
from shared.tiers import TierSizes
from shared.tokenizer import TOKENIZER_KINDS

TOOL_PARSERS = ("qwen3_coder", "nemotron_json", "hermes")  # text/tool_calls.py
REASONING_PARSERS = ("deepseek_r1", "qwen3", "nemotron_v3")  # text/reasoning.py

ROUTER_POLICIES = ("prefix", "random")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "dummy")
MAX_DRAFTS = 16  # speculative_num_steps: a verify row holds one Mamba slot per draft
HEAD_ALGORITHMS = ("NEXTN", "EAGLE")  # SGLang's names for drafting by an in-checkpoint head
# never shown by /get_server_info: keys, the cluster secret, and a Redis URL (it may carry
# a password)
SECRET_SETTINGS = frozenset({"api_keys", "admin_api_keys", "cluster_secret", "redis_url"})


@dataclass(frozen=True)
class Settings:
    redis_url: str = ""  # empty: `custody up` starts a private Redis
    # this replica's id (its Redis names carry it, shared/streams.py); custody up sets it;
    # auto: this machine's hostname (hostname_replica)
    replica: str = "0"
    replicas: int = 1  # custody up: replicas to start; more than 1 puts the router on `port`
    # a replica whose registration is missing this long is dead: the router re-homes its
    # sessions (until then their turns wait)
    replica_dead_seconds: float = 10.0
    # a replica dead this long, nothing placed on it any more, is forgotten: its id leaves
    # the replica set and the store stops its consumer (0: never; ids would pile up)
    replica_forget_seconds: float = 3600.0
    # how the router places a request no session binds: prefix (the longest cached prefix
    # within a bounded load, fronts/choice.py) or random (uniform; a baseline)
    router_policy: str = "prefix"
    model: Path | None = None  # a NemotronH checkpoint directory; None: the built-in model
    # auto: the checkpoint's tokenizer.json, else ids-only (text refused); byte: UTF-8 bytes
    tokenizer: str = "auto"
    # weights, KV and conv state: auto (the checkpoint's on a GPU, float32 on CPU),
    # float32, bfloat16 or float16 (shared/dtypes.py)
    dtype: str = "auto"
    # where the executor runs the model: auto (CUDA when torch sees a GPU, else the
    # CPU), cpu or cuda (SGLang's --device)
    device: str = "auto"
    # auto: the checkpoint's weights; dummy (SGLang's --load-format dummy): seeded random
    # weights of the checkpoint's config, built on the device (benchmarks of a published
    # shape whose weights are not at hand)
    load_format: str = "auto"
    host: str = "127.0.0.1"
    # the host a replica registers its API under (a pod's IP, from the downward API);
    # empty: the bound host, or this machine's name when bound to every interface
    advertise_host: str = ""
    port: int = 30000  # the HTTP API (scheduler)
    store_port: int = 30001  # the session store's HTTP (ledger, sessions, metrics)
    executor_metrics_port: int = 30002
    # the endpoint picker (services/epp/): Envoy's ext_proc gRPC, gRPC health, and its
    # HTTP (/metrics, POST /admin/drain)
    epp_port: int = 9002
    epp_health_port: int = 9003
    epp_http_port: int = 9090
    page_size: int = 16
    kv_pages: int = 2048
    mamba_slots: int = 256  # a running request holds 6 (4 at pipeline depth 0 or 1), a session 1
    max_running_requests: int = 32
    context_len: int = 8192
    chunk_size: int = 512
    max_step_tokens: int = 2048
    track_interval: int = 64
    # during a long prefill, a chunk ends (and its state is cached) every this many
    # positions, for prompts whose junctions nobody can predict; 0: only at junctions
    state_checkpoint_interval: int = 0
    # cache the state where a request's prompt leaves the cached path (its junction);
    # false: states only at chunk ends, as engines without junctions keep them
    junction_checkpoints: bool = True
    pipeline_depth: int = 2  # steps in flight while the scheduler plans the next: 0, 1 or 2
    # decode steps through torch.compile (services/executor/compiled_decode.py), compiled
    # before the executor's first heartbeat; false: eager
    compile: bool = True
    # constrained JSON in xgrammar's compact form (SGLang's flag): bounded by its schema
    constrained_json_disable_any_whitespace: bool = False
    # how the model writes tool calls (services/scheduler/text/tool_calls.py: qwen3_coder,
    # nemotron_json, hermes); empty: tool calls are not parsed (tool_choice auto refused)
    tool_call_parser: str = ""
    # how it marks its reasoning (text/reasoning.py: nemotron_v3, deepseek_r1, qwen3);
    # empty: reasoning stays in the content
    reasoning_parser: str = ""
    # reasoning tokens a chat reply may write before a constraint's answer (a forced
    # tool call, a schema) when the prompt opened its reasoning: then its end is forced;
    # at most half the reply's max_tokens. A request's `thinking_budget` overrides it
    thinking_budget: int = 1024
    # a request header naming the session a stateless chat request continues (e.g.
    # X-Session-ID; services/scheduler/http/header_sessions.py); empty: none
    session_header: str = ""
    # SGLang's /generate stream: cumulative chunks (SGLang's default), or only what is new
    incremental_streaming_output: bool = False
    # a stream sends every this many tokens (and at the end), as SGLang's flag: fewer,
    # larger chunks for a client that does not need every token at once
    stream_interval: int = 1
    stream_maxlen: int = 100_000
    heartbeat_seconds: float = 1.0
    executor_timeout_seconds: float = 5.0  # no heartbeat for this long: the executor is dead
    api_keys: str = ""  # comma-separated; empty: no authentication
    # signs replica registrations (shared/registration_auth.py); the router sends keys only
    # to replicas whose registration it verified, and with api_keys it requires one
    cluster_secret: str = ""
    admin_api_keys: str = ""  # comma-separated operator keys (flush, store routes, abort_all)
    store_host: str = "127.0.0.1"  # the session store's HTTP: loopback unless asked
    max_sessions: int = 0  # open sessions at once; 0: one per Mamba slot but the reserved one
    max_sessions_per_key: int = 0  # 0: only the global limit applies
    # a session no client touches (no turn, no open) for this long closes; one the client
    # opened with its own `timeout` keeps that. 0: never (orphans then stay for good)
    session_idle_timeout: float = 3600.0
    max_queued_requests: int = 1024  # waiting requests; beyond it a 503 (0: no limit)
    # processes that parse, tokenize, detokenize and stream the generation routes beside
    # the scheduling core (services/scheduler/edge/); -1: max(1, cores - 1); 0: none, the
    # core's own process serves every route
    api_workers: int = -1
    read_timeout_seconds: float = 30.0  # reading one request's headers and body (slowloris)
    keepalive_seconds: float = 75.0  # an idle keep-alive connection is closed after this
    served_model_name: str = ""  # the OpenAI model id; empty: the checkpoint dir's name
    host_state_bytes: int = 1 << 30  # the host tier of session state; 0: none
    state_dir: Path | None = None  # the disk tier's blobs (0700); None: no disk tier
    disk_state_bytes: int = 8 << 30  # the disk tier's bound (with a state_dir)
    # fault drills only: each tier move sleeps this long half-way (a spill between its
    # write and its rename), so a drill's kill lands during one
    tier_move_delay_seconds: float = 0.0
    # speculative decoding (docs/speculative.md), SGLang's flags: NGRAM drafts from the
    # sequence's own n-grams, NEXTN or EAGLE (the same here) from the checkpoint's MTP head
    speculative_algorithm: str = ""  # empty: none
    speculative_num_steps: int = 3  # drafts per verify step
    speculative_num_draft_tokens: int = 0  # SGLang's verify width: steps + 1 (0: that)
    speculative_eagle_topk: int = 1  # drafts per position: 1 only

    def public(self) -> dict[str, object]:
        """Every setting but the secret ones, as JSON values (SGLang's server args)."""
        shown: dict[str, object] = {}
        for f in fields(self):
            if f.name not in SECRET_SETTINGS:
                value = getattr(self, f.name)
                shown[f.name] = str(value) if isinstance(value, Path) else value
        return shown

    def check(self) -> None:
        for name in (
            "page_size",
            "kv_pages",
            "mamba_slots",
            "max_running_requests",
            "context_len",
            "chunk_size",
            "max_step_tokens",
            "track_interval",
            "replicas",
            "stream_interval",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("chunk_size", "track_interval", "state_checkpoint_interval"):
            if getattr(self, name) % self.page_size:
                raise ValueError(f"{name} must be a multiple of page_size ({self.page_size})")
        for name in (
            "max_sessions",
            "max_sessions_per_key",
            "max_queued_requests",
            "state_checkpoint_interval",
            "thinking_budget",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.api_keys.strip() and not self.admin_api_keys.strip():
            raise ValueError(
                "api_keys without admin_api_keys: the session store's routes and every "
                "migration (drains, re-homing) need an operator key, and without one they "
                "would be refused (or the store left open); set --admin-api-keys too"
            )
        if self.tool_call_parser not in ("", *TOOL_PARSERS):
            raise ValueError(f"tool_call_parser must be one of {TOOL_PARSERS} (or empty)")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, not {self.device!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, not {self.load_format!r}")
        if self.reasoning_parser not in ("", *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS} (or empty)")
        if self.api_workers < -1 or self.api_workers > 64:
            raise ValueError("api_workers must be -1 (one per core but one), 0 (none) .. 64")
        if self.replica_forget_seconds < 0:
            raise ValueError("replica_forget_seconds must be >= 0 (0: never)")
        if self.session_idle_timeout < 0:
            raise ValueError("session_idle_timeout must be >= 0 (0: never)")
        if self.host_state_bytes < 0 or self.disk_state_bytes < 0:
            raise ValueError("host_state_bytes and disk_state_bytes must be >= 0")
        check_dtype(self.dtype)
        if not REPLICA_ID.fullmatch(self.replica):
            raise ValueError("replica must be 1..64 of A-Z a-z 0-9 _ . -")
        if self.tokenizer not in TOKENIZER_KINDS:
            raise ValueError(f"tokenizer must be one of {TOKENIZER_KINDS}")
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(f"router_policy must be one of {ROUTER_POLICIES}")
        if self.pipeline_depth not in (0, 1, 2):
            raise ValueError("pipeline_depth must be 0, 1 or 2")
        if self.kv_pages * self.page_size < self.context_len:
            raise ValueError("kv_pages * page_size must hold at least one context_len")
        self._check_speculation()

    def _check_speculation(self) -> None:
        if self.speculative_algorithm.upper() not in ("", "NGRAM", *HEAD_ALGORITHMS):
            raise ValueError("speculative_algorithm must be NGRAM, NEXTN or EAGLE (or empty)")
        steps = self.speculative_num_steps
        if not 1 <= steps <= MAX_DRAFTS:
            raise ValueError(f"speculative_num_steps must be 1..{MAX_DRAFTS}")
        if self.speculative_num_draft_tokens not in (0, steps + 1):
            raise ValueError(
                f"speculative_num_draft_tokens {self.speculative_num_draft_tokens}: with "
                f"top-k 1 the verify width is speculative_num_steps + 1 = {steps + 1}"
            )
        if self.speculative_eagle_topk != 1:
            raise ValueError("speculative_eagle_topk must be 1: custody verifies one chain")

    @property
    def drafts_by_head(self) -> bool:
        """Whether the checkpoint's multi-token-prediction head drafts (NEXTN, EAGLE)."""
        return self.speculative_algorithm.upper() in HEAD_ALGORITHMS

    def check_speculation(self, model: ModelConfig) -> None:
        """Refuse, at start and by name, a head the checkpoint does not have or custody
        does not run."""
        problem = model.mtp_problem if self.drafts_by_head else None
        if problem:
            raise ValueError(f"--speculative-algorithm {self.speculative_algorithm}: {problem}")

    @property
    def spec_drafts(self) -> int:
        """Drafts a verify step checks: 0 when the engine does not speculate."""
        return self.speculative_num_steps if self.speculative_algorithm else 0

    @property
    def working_slots(self) -> int:
        """A running request's Mamba working slots, and as many track slots: one more
        than the pipeline's depth, two at least (services/scheduler/allocators/)."""
        return max(2, self.pipeline_depth + 1)

    @property
    def edge_workers(self) -> int:
        """How many edge worker processes the scheduler starts (`api_workers`)."""
        if self.api_workers >= 0:
            return self.api_workers
        return max(1, len(os.sched_getaffinity(0)) - 1)  # the cores it may run on

    @property
    def model_name(self) -> str:
        """The id the OpenAI routes serve: the given name, else the checkpoint
        directory's name, else `custody` for the built-in model."""
        return self.served_model_name or (self.model.name if self.model else "custody")

    @property
    def blob_dir(self) -> Path | None:
        """This replica's disk tier: `state_dir/replica-<id>`, beside the other replicas'
        (a session that moves here copies its blob from there)."""
        return None if self.state_dir is None else self.state_dir / f"replica-{self.replica}"

    def tier_sizes(self, model: ModelConfig) -> TierSizes:
        """The host and disk tiers' pools (shared/tiers.py), the same on every service."""
        return TierSizes.of(
            model,
            self.page_size,
            self.kv_pages,
            self.mamba_slots,
            self.host_state_bytes,
            self.disk_state_bytes if self.state_dir is not None else 0,
            self.context_len,
            sizing_dtype(self.dtype),
        )

    def session_limit(self, tiers: TierSizes) -> int:
        """Open sessions at once: as many as can keep a state somewhere between turns
        (one device Mamba slot, slot 0 reserved; one host slot; one blob)."""
        room = self.mamba_slots - 1 + tiers.host_mamba_slots + tiers.disk_slots
        return self.max_sessions or max(1, room)

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """One flag per setting, with SGLang's name beside it where SGLang has one
        (shared/sglang_flags.py); a boolean stands bare for true, as SGLang's do."""
        for f in fields(Settings):
            flags = ["--" + f.name.replace("_", "-")]
            flags += [ALIASES[f.name]] if f.name in ALIASES else []
            kind = _kind(f.type)
            bare = {"nargs": "?", "const": True} if kind is _flag else {}
            parser.add_argument(
                *flags,
                dest=f.name,
                type=kind,
                default=None,
                help=f"env CUSTODY_{f.name.upper()}; default {f.default!r}",
                **bare,
            )

    @classmethod
    def ephemeral(cls, **overrides: object) -> Settings:
        """Settings whose ports are free now, for a stack that must not meet another on
        this machine (tests, benchmarks, soaks)."""
        return cls(
            port=free_port(), store_port=free_port(), executor_metrics_port=free_port(), **overrides
        )

    @classmethod
    def resolve(
        cls, args: argparse.Namespace | None = None, environ: dict[str, str] | None = None
    ) -> Settings:
        environ = os.environ if environ is None else environ
        values = {}
        for f in fields(cls):
            flag = getattr(args, f.name, None) if args is not None else None
            env = environ.get(f"CUSTODY_{f.name.upper()}")
            if f.name == "redis_url" and env is None:
                env = environ.get("REDIS_URL")
            if flag is not None:
                values[f.name] = flag
            elif env is not None and env != "":
                values[f.name] = _kind(f.type)(env)
        for name, spelled in VALUES.items():  # SGLang's spelling of a value
            if name in values:
                values[name] = spelled.get(values[name], values[name])
        if values.get("replica") == "auto":
            values["replica"] = hostname_replica()
        settings = cls(**values)
        settings.check()
        return settings

    def to_env(self) -> dict[str, str]:
        """The same settings for a child process."""
        return {
            f"CUSTODY_{f.name.upper()}": ""
            if getattr(self, f.name) is None
            else str(getattr(self, f.name))
            for f in fields(self)
        }


def hostname_replica() -> str:
    """The replica id `auto` stands for: this machine's hostname. The containers of a
    scaled compose service cannot be numbered, but each has a hostname of its own (its
    short container id) that its restarts keep and that names it on the compose network,
    so a restarted replica is the same replica, and one recreated is a new one whose
    predecessor the router re-homes."""
    name = socket.gethostname()
    if not REPLICA_ID.fullmatch(name):
        raise ValueError(
            f"replica auto: the hostname {name!r} is not a replica id "
            "(1..64 of A-Z a-z 0-9 _ . -); set the replica explicitly"
        )
    return name


def _flag(text: str) -> bool:
    """A boolean setting as a flag or an environment variable spells it."""
    words = {"1": True, "true": True, "yes": True, "on": True}
    words |= {"0": False, "false": False, "no": False, "off": False}
    try:
        return words[text.strip().lower()]
    except KeyError:
        raise ValueError(f"not a boolean: {text!r} (true/false, on/off, yes/no, 1/0)") from None


def _kind(annotation: object):
    text = str(annotation)
    if text == "bool":
        return _flag
    if "Path" in text:
        return Path
    if "float" in text:
        return float
    if "int" in text:
        return int
    return str
