"""Router settings: one frozen dataclass, resolved by common.config (defaults < file < env < flags).

Limits that depend on the model (vocabulary, context, KV capacity, the worker's own batch limits) come
from the worker's Info at run time; the values here only cap them further.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.config import LOG_LEVEL_ENV, check_distinct_ports, check_message_limit, setting
from common.connection_limits import MAX_CONNECTIONS
from common.errors import ConfigError
from common.listen_address import ADDRESS_HELP, bind_address_problem, unix_socket_path_problem
from router_service.http_hosts import allowed_hosts_problem

# gRPC takes some durations in milliseconds as a 32-bit int (request_timeout_s is a channel argument) and fails a
# call whose deadline it cannot represent at once (worker_step_timeout_s): longer ones stop nothing useful.
MAX_DURATION_S = (2**31 - 1) // 1000

MiB = 1 << 20
# gRPC target schemes taken as they are; any other address is HOST:PORT.
GRPC_SCHEMES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:")


def worker_address_problem(address: str) -> str | None:
    """Why `address` cannot reach a worker, or None. gRPC waits forever on a target it cannot resolve (a space in
    it), and takes a HOST without a port as HOST:443, so such addresses are refused at start-up instead."""
    if any(c.isspace() for c in address):
        return "an address has no whitespace"
    if address.startswith(GRPC_SCHEMES):  # unix: with no path was an empty address list, retried for ever
        scheme, _, rest = address.partition(":")
        if not rest.lstrip("/"):
            return f"nothing after {scheme + ':'!r} (e.g. unix:/ABSOLUTE/PATH)"
        if scheme == "unix":  # unix:PATH or unix:///ABSOLUTE/PATH
            return unix_socket_path_problem(rest[2:] if rest.startswith("//") else rest)
        return None
    if "://" in address:  # http://worker:50052 read as an IPv6 host ("an IPv6 host goes in brackets")
        return f"a URL; gRPC takes HOST:PORT or unix:PATH (schemes: {', '.join(GRPC_SCHEMES)})"
    host, colon, port = address.rpartition(":")
    if not colon or not host.strip("[]"):
        return "expected HOST:PORT or unix:PATH"
    if not (port.isdigit() and 1 <= int(port) <= 65535):
        return f"port {port!r} is not in [1, 65535]"
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        return "an IPv6 host goes in brackets ([::1]:PORT)"
    return None


def step_timeouts_problem(worker_step_timeout_s: float, step_timeout_s: float) -> str | None:
    """Why the router's step deadline (its worker_step_timeout_s) would cut the worker's steps short, or None. The
    worker's watchdog (its step_timeout_s) must fire first: a step the router gave up on failed its requests with the
    router's bare deadline while the worker kept running it, and the steps behind it, until the watchdog. `colibri
    serve` refuses such a pair at start; a router started apart does not use that worker (worker_info.py)."""
    if worker_step_timeout_s > step_timeout_s:
        return None
    return (
        f"router worker_step_timeout_s={worker_step_timeout_s:g} s must exceed the worker's watchdog "
        f"step_timeout_s={step_timeout_s:g} s: the router would give up on steps the worker still runs; raise the "
        "router's worker_step_timeout_s or lower the worker's step_timeout_s"
    )


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = setting(
        "::", f"address the public gRPC, health and HTTP ports bind to: {ADDRESS_HELP}", ("COLIBRI_HOST",)
    )
    port: int = setting(
        50051, "public gRPC port (GenerationService, health, reflection); 0 = pick a free one", ("COLIBRI_PORT", "PORT")
    )
    metrics_port: int = setting(
        9090, "HTTP port serving Prometheus /metrics; 0 = off", ("COLIBRI_METRICS_PORT", "METRICS_PORT")
    )
    metrics_host: str = setting(
        "127.0.0.1",
        f"address of the /metrics port (:: to let Prometheus scrape it from outside the host or pod): {ADDRESS_HELP}",
        ("COLIBRI_METRICS_HOST",),
    )
    worker: str = setting(
        "localhost:50052",
        "gRPC address of the expert worker (host:port or unix:PATH)",
        ("COLIBRI_WORKER", "WORKER_ADDRESS"),
    )
    model: str = setting(
        "", "model directory; its tokenizer.json enables text prompts and text output", ("COLIBRI_MODEL", "MODEL_DIR")
    )
    model_name: str = setting(
        "",
        "served model name; empty = the worker's (the model directory name)",
        ("COLIBRI_MODEL_NAME", "SERVED_MODEL_NAME"),
    )
    max_concurrent_requests: int = setting(
        128,
        "requests admitted at once (queued + running); more get RESOURCE_EXHAUSTED",
        ("COLIBRI_MAX_CONCURRENT_REQUESTS", "MAX_CONCURRENT_REQUESTS"),
    )
    max_batch_size: int = setting(
        64, "sequences per step (capped by the worker's own limit)", ("COLIBRI_MAX_BATCH_SIZE", "MAX_BATCH_SIZE")
    )
    max_batch_tokens: int = setting(
        2048,
        "token budget per step, prefill chunks + decodes (capped by the worker)",
        ("COLIBRI_MAX_BATCH_TOKENS", "MAX_BATCH_TOKENS", "MAX_BATCH_PREFILL_TOKENS"),
    )
    default_max_new_tokens: int = setting(
        256,
        "max_new_tokens when a request leaves it 0 and the model's generation_config.json sets none",
        ("COLIBRI_DEFAULT_MAX_NEW_TOKENS",),
    )
    max_new_tokens: int = setting(
        4096, "largest max_new_tokens a request may ask for", ("COLIBRI_MAX_NEW_TOKENS", "MAX_NEW_TOKENS")
    )
    max_stop_sequences: int = setting(
        4, "stop sequences per request", ("COLIBRI_MAX_STOP_SEQUENCES", "MAX_STOP_SEQUENCES")
    )
    max_stop_sequence_length: int = setting(256, "characters per stop sequence", ("COLIBRI_MAX_STOP_SEQUENCE_LENGTH",))
    max_stop_token_ids: int = setting(64, "stop_token_ids per request", ("COLIBRI_MAX_STOP_TOKEN_IDS",))
    max_request_id_length: int = setting(
        128, "characters of a caller-chosen request_id", ("COLIBRI_MAX_REQUEST_ID_LENGTH",)
    )
    queue_timeout_s: float = setting(
        60.0, "seconds a request may wait for admission to the batch", ("COLIBRI_QUEUE_TIMEOUT", "QUEUE_TIMEOUT")
    )
    request_timeout_s: float = setting(
        600.0,
        "upper bound on one request's total time (a client deadline shortens it)",
        ("COLIBRI_REQUEST_TIMEOUT", "REQUEST_TIMEOUT"),
    )
    drain_timeout_s: float = setting(
        30.0,
        "on SIGTERM, seconds in-flight requests get to finish",
        ("COLIBRI_DRAIN_TIMEOUT", "GRACEFUL_TERMINATION_TIMEOUT"),
    )
    # Longer than the worker's watchdog (its step_timeout_s, 300 s by default): a slow step then ends as the
    # worker's own error and restart, never as a router deadline on a step the worker still runs.
    worker_step_timeout_s: float = setting(
        330.0,
        "deadline of one worker step result (a silent worker fails the batch after this); must exceed the "
        "worker's step_timeout_s watchdog, so that a step too slow is the worker's fault, reported by it",
        ("COLIBRI_WORKER_STEP_TIMEOUT",),
    )
    worker_retry_s: float = setting(
        1.0, "seconds between attempts to reach an unavailable worker", ("COLIBRI_WORKER_RETRY",)
    )
    max_message_bytes: int = setting(
        16 * MiB, "largest gRPC message on the public port", ("COLIBRI_MAX_MESSAGE_BYTES", "PAYLOAD_LIMIT")
    )
    worker_max_message_bytes: int = setting(
        256 * MiB, "largest gRPC message to/from the worker", ("COLIBRI_WORKER_MAX_MESSAGE_BYTES",)
    )
    retry_after_s: float = setting(
        1.0,
        "back-off suggested in RetryInfo and Retry-After when the router is full, draining or has no ready worker",
        ("COLIBRI_RETRY_AFTER",),
    )
    routing_table: str = setting(
        "",
        "static routing table (`colibri router-gen`): every step carries its lookup "
        "as a routing plan (the routing itself when the worker runs --routing lut; "
        "a prefetch prediction whose recall is measured otherwise); needs --model",
        ("COLIBRI_ROUTING_TABLE",),
    )
    auth_token: str = setting(
        "",
        "bearer token required on the public API (health exempt); empty = off. Set it "
        "through the environment or the config file: on the command line it shows in `ps`",
        ("COLIBRI_AUTH_TOKEN", "API_KEY"),
    )
    auth_token_file: str = setting(
        "",
        "file of bearer tokens accepted on the public API, one per line (blank lines "
        "and # comments skipped), re-read when it changes; health exempt",
        ("COLIBRI_AUTH_TOKEN_FILE",),
    )
    worker_token_file: str = setting(
        "",
        "file holding the token the router sends to the worker "
        "(`authorization: Bearer ...`), re-read when it changes; env "
        "COLIBRI_WORKER_TOKEN gives the token itself",
        ("COLIBRI_WORKER_TOKEN_FILE",),
    )
    # The token itself has no flag (argv is visible to every local user): environment or config file only.
    worker_token: str = dataclasses.field(default="", repr=False, metadata={"env": ("COLIBRI_WORKER_TOKEN",)})
    tls_cert_file: str = setting(
        "",
        "PEM certificate chain for TLS on the public port (with --tls-key-file); re-read when the files change",
        ("COLIBRI_TLS_CERT_FILE",),
    )
    tls_key_file: str = setting("", "PEM private key of --tls-cert-file", ("COLIBRI_TLS_KEY_FILE",))
    tls_client_ca_file: str = setting(
        "",
        "PEM CA bundle: clients must present a certificate it signed (mutual TLS); needs --tls-cert-file",
        ("COLIBRI_TLS_CLIENT_CA_FILE",),
    )
    health_port: int = setting(
        0,
        "plaintext port serving only grpc.health.v1 (kubelet gRPC probes speak neither TLS nor auth); 0 = off",
        ("COLIBRI_HEALTH_PORT",),
    )
    http_port: int = setting(
        0,
        "port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health), with the same auth and TLS as the gRPC port; 0 = off",
        ("COLIBRI_HTTP_PORT",),
    )
    allowed_hosts: tuple[str, ...] = setting(
        (),
        "Host header names the HTTP front answers besides loopback ones (comma-separated; *.example.com for its "
        "subdomains; * = any). Empty: any Host on a non-loopback --host, only localhost, *.localhost and loopback "
        "addresses on a loopback one, against DNS rebinding; set: those and these on either",
        ("COLIBRI_ALLOWED_HOSTS",),
    )
    chat_template: str = setting(
        "",
        "Jinja2 chat template file used instead of the model's (tokenizer_config.json chat_template)",
        ("COLIBRI_CHAT_TEMPLATE",),
    )
    chat_template_timeout_s: float = setting(
        2.0,
        "seconds one chat-template render may take; it runs in a child "
        "process, killed past this (the request fails as invalid)",
        ("COLIBRI_CHAT_TEMPLATE_TIMEOUT",),
    )
    chat_template_processes: int = setting(
        2,
        "child processes rendering chat templates (about 40 MB each, started on "
        "the first chat); more chats at once wait for one",
        ("COLIBRI_CHAT_TEMPLATE_PROCESSES",),
    )
    tool_call_format: str = setting(
        "auto",
        "how the model writes tool calls: hermes (<tool_call> tags, Qwen), mistral ([TOOL_CALLS] and a JSON "
        'array), generic (the whole reply is {"tool_calls": [...]}), or auto: from the chat template\'s text',
        ("COLIBRI_TOOL_CALL_FORMAT",),
    )
    http_header_timeout_s: float = setting(
        60.0,
        "seconds an HTTP connection gets to send a request's line and "
        "headers, counted from its opening or its previous answer (an idle "
        "keep-alive connection is closed after it too)",
        ("COLIBRI_HTTP_HEADER_TIMEOUT",),
    )
    http_body_timeout_s: float = setting(
        60.0,
        "seconds an HTTP request gets to send its whole body once its headers are in; a slower one gets 408",
        ("COLIBRI_HTTP_BODY_TIMEOUT",),
    )
    http_write_timeout_s: float = setting(
        30.0,
        "seconds one write of an HTTP answer (a whole answer, one streamed "
        "event) may wait for the client to read; past it the client is "
        "disconnected and its request cancelled",
        ("COLIBRI_HTTP_WRITE_TIMEOUT",),
    )
    http_max_connections: int = setting(
        1024,
        "HTTP connections open at once (idle keep-alive ones included); past it a new connection is answered 503 "
        "(too_many_connections, Retry-After) and closed. The open-file limit is raised to fit it when the hard "
        "limit allows",
        ("COLIBRI_HTTP_MAX_CONNECTIONS",),
    )
    # 0: 4 bodies of max_message_bytes (64 MiB by default): parsing one holds up to ~7x its bytes (token ids)
    http_max_body_bytes_in_flight: int = setting(
        0,
        "bytes of HTTP request bodies held at once, all connections together: a body reserves its Content-Length "
        "before it is read (a chunked or compressed one grows its share as it arrives) until it is parsed; one that "
        "does not fit is answered 503 (too_many_body_bytes, Retry-After). 0: 4 x max_message_bytes; else at least "
        "max_message_bytes",
        ("COLIBRI_HTTP_MAX_BODY_BYTES_IN_FLIGHT",),
    )
    grpc_max_connections: int = setting(
        1024,
        "connections open at once on the gRPC port, and apart on the health port (idle ones and ones still in their "
        "handshake included); past it a new connection is closed as it opens (its client sees UNAVAILABLE). The "
        "open-file limit is raised to fit it when the hard limit allows",
        ("COLIBRI_GRPC_MAX_CONNECTIONS",),
    )
    grpc_write_timeout_s: float = setting(
        30.0,
        "seconds one message of a gRPC stream may wait for a client that stops reading (HTTP/2 flow control); "
        "past it the request ends (DEADLINE_EXCEEDED, reason CLIENT_TOO_SLOW) and its KV blocks are freed",
        ("COLIBRI_GRPC_WRITE_TIMEOUT",),
    )
    max_prompt_bytes: int = setting(
        0,
        "largest text prompt (and Tokenize text) in UTF-8 bytes, checked before "
        "tokenizing; 0 = 32 bytes per token of the context the worker reports, at "
        "most max_message_bytes",
        ("COLIBRI_MAX_PROMPT_BYTES",),
    )
    pipeline_depth: int = setting(
        3,
        "worker steps in flight: 3 keeps two steps queued behind the running one, so a "
        "result's round trip through both services hides behind two device steps (a stop "
        "is then seen two steps late, costing up to two discarded tokens); 2 hides it "
        "behind one; 1 waits for each result. While a constrained request runs at most 2 "
        "are in flight (its grammar masks follow one step behind); a routing table forces "
        "1 (its lookup needs each step's input tokens)",
        ("COLIBRI_PIPELINE_DEPTH",),
    )
    prefix_caching: bool = setting(
        True,
        "automatic prefix caching: full KV blocks of prompts and of generated tokens are cached by a hash of their tokens and reused by "
        "later requests with the same prefix (and cache_salt); false computes every prompt in full",
        ("COLIBRI_PREFIX_CACHING", "PREFIX_CACHING"),
    )
    warmup: bool = setting(
        True,
        "ask the worker for a warm-up step of max_batch_tokens when it connects (a worker without Warmup is fine)",
        ("COLIBRI_WARMUP",),
    )
    log_level: str = setting("INFO", "log level", LOG_LEVEL_ENV)

    @property
    def http_body_budget_bytes(self) -> int:
        """http_max_body_bytes_in_flight as applied: 0 means 4 bodies of max_message_bytes."""
        return self.http_max_body_bytes_in_flight or 4 * self.max_message_bytes

    def __post_init__(self):
        positive = (
            "max_concurrent_requests",
            "max_batch_size",
            "max_batch_tokens",
            "default_max_new_tokens",
            "max_new_tokens",
            "max_stop_sequence_length",
            "max_request_id_length",
            "chat_template_processes",
            "http_max_connections",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"router: {name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_message_bytes", "worker_max_message_bytes"):
            check_message_limit(f"router: {name}", getattr(self, name))
        if 0 < self.http_max_body_bytes_in_flight < self.max_message_bytes:  # a largest body could never be read
            raise ConfigError(
                f"router: http_max_body_bytes_in_flight ({self.http_max_body_bytes_in_flight}) must be >= "
                f"max_message_bytes ({self.max_message_bytes})"
            )
        if not 1 <= self.pipeline_depth <= 4:
            raise ConfigError(f"router: pipeline_depth must be in [1, 4], got {self.pipeline_depth}")
        for name in ("max_stop_sequences", "max_stop_token_ids", "http_max_body_bytes_in_flight"):
            if getattr(self, name) < 0:
                raise ConfigError(f"router: {name} must be >= 0, got {getattr(self, name)}")
        for name in (
            "queue_timeout_s",
            "request_timeout_s",
            "drain_timeout_s",
            "worker_step_timeout_s",
            "worker_retry_s",
            "retry_after_s",
            "chat_template_timeout_s",
            "http_header_timeout_s",
            "http_body_timeout_s",
            "http_write_timeout_s",
            "grpc_write_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"router: {name} must be > 0 seconds, got {getattr(self, name)}")
            if getattr(self, name) > MAX_DURATION_S:
                raise ConfigError(
                    f"router: {name} must be at most {MAX_DURATION_S} seconds (about 24 days), got {getattr(self, name)}"
                )
        for name in ("port", "metrics_port", "health_port", "http_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ConfigError(f"router: {name} must be in [0, 65535], got {getattr(self, name)}")
        if self.default_max_new_tokens > self.max_new_tokens:
            raise ConfigError(
                f"router: default_max_new_tokens ({self.default_max_new_tokens}) must be <= "
                f"max_new_tokens ({self.max_new_tokens})"
            )
        if self.tool_call_format not in ("auto", "hermes", "mistral", "generic"):
            raise ConfigError(
                f"router: tool_call_format must be auto, hermes, mistral or generic, got {self.tool_call_format!r}"
            )
        if not self.worker:
            raise ConfigError("router: worker address is required (--worker HOST:PORT)")
        problem = worker_address_problem(self.worker)
        if problem:
            raise ConfigError(f"router: worker {self.worker!r}: {problem}")
        if not 1 <= self.grpc_max_connections <= MAX_CONNECTIONS:
            raise ConfigError(
                f"router: grpc_max_connections must be in [1, {MAX_CONNECTIONS}], got {self.grpc_max_connections}"
            )
        if self.max_prompt_bytes < 0:
            raise ConfigError(f"router: max_prompt_bytes must be >= 0, got {self.max_prompt_bytes}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("router: tls_cert_file and tls_key_file go together (give both or neither)")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ConfigError("router: tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")
        for name in ("host", "metrics_host"):  # a typo would surface only as a port that cannot be bound
            if problem := bind_address_problem(getattr(self, name)):
                raise ConfigError(f"router: --{name.replace('_', '-')} {getattr(self, name)!r} {problem}")
        if problem := allowed_hosts_problem(self.allowed_hosts):
            raise ConfigError(f"router: allowed_hosts {problem}")
        check_distinct_ports("router: ", self.listeners())

    def listeners(self) -> dict[str, tuple[str, int]]:
        """Each port setting's (host, port): the addresses the router listens on."""
        return {
            "port": (self.host, self.port),
            "health_port": (self.host, self.health_port),
            "http_port": (self.host, self.http_port),
            "metrics_port": (self.metrics_host, self.metrics_port),
        }
