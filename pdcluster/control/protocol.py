"""Typed node-to-node messages: msgpack maps over zmq frames.

Every frame is one msgpack map ``{"v": PROTOCOL_VERSION, "t": <type name>, **fields}``.
``decode`` never raises on bad input from the network: it raises ``ProtocolError`` that the
receive loop logs before dropping the frame.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import msgpack

from pdcluster.control.block_hash import EVICTED, STORED, TIER_NAMES

PROTOCOL_VERSION = 2  # 2: Generate/Prefill carry timeout_s (time left), not a wall-clock deadline
FEATURE_DTYPES = ("float32", "bfloat16", "float16")
MAX_FRAME_BYTES = 64 * 1024 * 1024  # a prompt of 1M token ids fits; anything bigger is hostile


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


@dataclass
class Message:
    TYPE: ClassVar[str] = ""

    def check(self) -> None:
        """Range checks beyond the field types, for values a receiver computes with; ProtocolError if off."""


def check_timeout(kind: str, value: float) -> None:
    if not math.isfinite(value):
        raise ProtocolError(f"{kind}.timeout_s: must be finite, got {value}")


@dataclass
class Generate(Message):
    """router -> decode: run this request; stream Tokens back to `router`."""

    TYPE: ClassVar[str] = "generate"
    rid: str
    prompt_ids: list[int]
    sampling: dict[str, Any]  # engine.SamplingParams.to_dict()
    prefill_node: str | None  # node id of the chosen prefill node; None = prefill locally
    # Seconds left when sent (0: none). Never an absolute time: hosts' clocks differ; the receiver adds it
    # to its own monotonic clock.
    timeout_s: float
    router: str = ""
    # Tokens already streamed to the client (request migration): the new decode node resumes after them.
    resume_ids: list[int] = field(default_factory=list)
    # The router's prefix index: node `kv_source` holds the prompt's first `kv_source_blocks` blocks in its pool,
    # more than the decode node has; the decode node fetches what it lacks (FetchKV) before it prefills the rest.
    kv_source: str | None = None
    kv_source_blocks: int = 0
    # Multi-LoRA: run under this adapter (its name on the nodes); `lora_path`: where a node that does not hold it
    # yet loads it from ("": it must hold it already).
    lora_name: str = ""
    lora_path: str = ""

    def check(self) -> None:
        check_timeout("generate", self.timeout_s)
        check_lora("generate", self.lora_name, self.lora_path)
        if self.kv_source_blocks < 0:
            raise ProtocolError(f"generate.kv_source_blocks: must be >= 0, got {self.kv_source_blocks}")


@dataclass
class Tokens(Message):
    """decode -> router, once per engine step per request: new token ids since the last message."""

    TYPE: ClassVar[str] = "tokens"
    rid: str
    ids: list[int]
    # per new token: [sampled_logprob, [[token_id, logprob], ...top-N]] or None when not requested
    logprobs: list[Any] | None = None
    # "stop" | "length" | "abort" | "error" | "invalid" (the request: 400, no retry) | "migrate" (the node drains:
    # the router resumes it elsewhere, the KV fetched from this node)
    finish: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prefill_path: str = ""  # "remote:<prefill node id>" | "local" (set on the first Tokens of a request)
    # sampling prompt_logprobs (first Tokens of a request): per prompt token a logprob entry, the first None
    prompt_logprobs: list[Any] | None = None
    # Index of ids[0] in this attempt's output (-1: not given). A gap (messages lost in a reconnect) is
    # seen by the router, which then migrates the request instead of streaming a hole.
    pos: int = -1

    def check(self) -> None:
        if self.pos < -1:
            raise ProtocolError(f"tokens.pos: must be >= -1, got {self.pos}")
        if self.logprobs is not None and len(self.logprobs) != len(self.ids):
            raise ProtocolError(f"tokens.logprobs: {len(self.logprobs)} entries for {len(self.ids)} ids")
        if self.prompt_logprobs is not None and len(self.prompt_logprobs) > self.num_prompt_tokens:
            raise ProtocolError(f"tokens.prompt_logprobs: {len(self.prompt_logprobs)} entries for "
                                f"{self.num_prompt_tokens} prompt tokens")

    def append(self, later: Tokens) -> None:
        """The request's next Tokens appended to this one: its ids, its logprobs kept aligned with the ids
        (None entries for a message that had none), its finish and error; pos and the first-message fields
        stay this message's."""
        if self.logprobs is not None or later.logprobs is not None:
            self.logprobs = (self.logprobs or [None] * len(self.ids)) + (later.logprobs or [None] * len(later.ids))
        self.ids = self.ids + later.ids
        self.finish, self.error = later.finish, later.error


@dataclass
class TokenBatch(Message):
    """decode -> router, once per engine step per router: the `Tokens` of every request of that router that
    got tokens this step, in one frame (each item a `Tokens` map without its defaults). Per item the
    semantics are those of `Tokens` (pos, finish, logprobs); items of one request keep their order."""

    TYPE: ClassVar[str] = "token_batch"
    items: list[Any]  # after decode: list[Tokens]

    def check(self) -> None:
        self.items = [item if isinstance(item, Tokens) else _token_item(item) for item in self.items]


def _token_item(item: Any) -> Tokens:
    """A TokenBatch item. The usual one (`rid`, `ids`, `pos`: a streaming step) is checked inline, the
    rest through the generic path; both refuse exactly what a `Tokens` frame would refuse."""
    if type(item) is dict and len(item) == 3:
        rid, ids, pos = item.get("rid"), item.get("ids"), item.get("pos")
        if (type(rid) is str and type(ids) is list and type(pos) is int and pos >= -1
                and (type(ids[0]) is int if len(ids) == 1 else all(type(x) is int for x in ids))):
            return Tokens(rid, ids, pos=pos)
    return cast(Tokens, _build(Tokens, item, "token_batch.items"))


def logprob_to_wire(lp: Any) -> Any:
    """The engine's `(logprob, [(token id, logprob), ...top-N])` (or None) as msgpack lists, the shape of a
    `Tokens.logprobs` / `PrefillDone.logprobs` entry."""
    if lp is None:
        return None
    return [float(lp[0]), [[int(t), float(v)] for t, v in lp[1]]]


def logprob_from_wire(entry: Any) -> tuple[float, list[tuple[int, float]]] | None:
    """A wire logprob entry back as the engine's tuple (None stays None); ValueError / TypeError when
    `entry` is not `[logprob, [[token id, logprob], ...]]`."""
    if entry is None:
        return None
    if not isinstance(entry, (list, tuple)) or len(entry) != 2:
        raise ValueError(f"logprob entry: expected [logprob, top], got {entry!r:.80}")
    if not isinstance(entry[1], (list, tuple)):
        raise TypeError(f"logprob entry: top must be a list, got {type(entry[1]).__name__}")
    return float(entry[0]), [(int(t), float(v)) for t, v in entry[1]]


PROGRESS_STATES = ("queued", "prefilling", "waiting_kv")


@dataclass
class Progress(Message):
    """decode -> router: these requests are alive but sent no token lately (queued, waiting on a prefill
    node or on its KV); once on admission and then every `heartbeat_interval` while silent, one frame per
    router. The router's stall timer measures silence, so this keeps a slow first token from migrating.
    prefill -> decode: these prompts are still queued or computing there (their deadlines renewed); the decode
    node extends its wait and their KV reservations (its `prefill_timeout` measures the prefill node's silence)."""

    TYPE: ClassVar[str] = "progress"
    rids: list[str]
    states: list[str]  # per rid: one of PROGRESS_STATES

    def check(self) -> None:
        if len(self.states) != len(self.rids):
            raise ProtocolError(f"progress: {len(self.rids)} rids but {len(self.states)} states")
        if not all(isinstance(r, str) for r in self.rids):
            raise ProtocolError("progress.rids: expected a list of strings")
        bad = [s for s in self.states if s not in PROGRESS_STATES]
        if bad:
            raise ProtocolError(f"progress.states: {bad[0]!r} is not one of {', '.join(PROGRESS_STATES)}")


@dataclass
class Reject(Message):
    """decode -> router: not admitted (queue full, draining, too long); try another node."""

    TYPE: ClassVar[str] = "reject"
    rid: str
    reason: str
    retry_after: float = 0.0


@dataclass
class Abort(Message):
    """router -> decode and decode -> prefill: stop this request and free its blocks."""

    TYPE: ClassVar[str] = "abort"
    rid: str


@dataclass
class Handback(Message):
    """router -> decode: hand request `rid` back to run elsewhere (Tokens finish "migrate"; its KV then fetched from
    this node), if it runs in the engine, at the next block boundary (its KV then lies in full blocks only: the new
    node recomputes nothing); else nothing happens. The last step of a migration (rebalancing, draining)."""

    TYPE: ClassVar[str] = "handback"
    rid: str


@dataclass
class MoveAway(Message):
    """decode -> router: move request `rid` to another decode node, with its KV (the node drains, or its pool is
    about to preempt). The router pre-copies the KV to a target (PreCopy) and then sends Handback; a node that
    hears nothing back in time hands the request back itself."""

    TYPE: ClassVar[str] = "move_away"
    rid: str
    reason: str = ""


@dataclass
class PreCopy(Message):
    """router -> decode: copy the first `num_blocks` blocks of `token_ids` from node `kv_source` (FetchKV) into this
    node's prefix cache while the request keeps decoding there, and hold them (pinned, at most `timeout_s`) for the
    request `rid` the router sends next (Generate with this rid); answer PreCopied. A live migration's pre-copy."""

    TYPE: ClassVar[str] = "pre_copy"
    rid: str
    token_ids: list[int]
    kv_source: str
    num_blocks: int
    timeout_s: float

    def check(self) -> None:
        check_timeout("pre_copy", self.timeout_s)
        if not 0 < self.num_blocks <= MAX_FETCH_BLOCKS:
            raise ProtocolError(f"pre_copy.num_blocks: must be in [1, {MAX_FETCH_BLOCKS}], got {self.num_blocks}")
        if not 0 < self.timeout_s <= MAX_PRECOPY_HOLD_S:
            raise ProtocolError(f"pre_copy.timeout_s: must be in (0, {MAX_PRECOPY_HOLD_S}], got {self.timeout_s}")


@dataclass
class PreCopied(Message):
    """decode -> router: the pre-copy of `rid` ended: `num_blocks` blocks are held here (0 with `error`: none)."""

    TYPE: ClassVar[str] = "pre_copied"
    rid: str
    num_blocks: int = 0
    error: str | None = None

    def check(self) -> None:
        if self.num_blocks < 0:
            raise ProtocolError(f"pre_copied.num_blocks: must be >= 0, got {self.num_blocks}")


@dataclass
class Prefill(Message):
    """decode -> prefill: compute the prompt's KV and write it into the reserved destination. `dst` empty: the
    destination follows (`PrefillDestination`): the decode node sends the prompt before its engine has reserved
    the blocks, so the prefill starts while they are reserved."""

    TYPE: ClassVar[str] = "prefill"
    rid: str
    prompt_ids: list[int]
    sampling: dict[str, Any]
    dst: dict[str, Any]  # kv_transfer destination (address, block ids, token, timeout_s, layout); {}: to follow
    decode_node: str
    timeout_s: float  # seconds left when sent (<= 0: already late); the receiver counts on its monotonic clock
    # Leading prompt blocks the decode node already holds from its own prefix cache: not sent.
    skip_blocks: int = 0
    # The request's LoRA adapter (Generate's), and its content hash on the decode node: a prefill node whose
    # adapter of that name differs refuses (its KV would be another adapter's).
    lora_name: str = ""
    lora_path: str = ""
    lora_hash: str = ""

    def check(self) -> None:
        check_timeout("prefill", self.timeout_s)
        check_lora("prefill", self.lora_name, self.lora_path)


@dataclass
class PrefillDestination(Message):
    """decode -> prefill: where the KV of prompt `rid` (sent in a `Prefill` with no `dst`) goes, once reserved."""

    TYPE: ClassVar[str] = "prefill_destination"
    rid: str
    dst: dict[str, Any]  # as Prefill.dst
    skip_blocks: int = 0  # as Prefill.skip_blocks

    def check(self) -> None:
        if self.skip_blocks < 0:
            raise ProtocolError(f"prefill_destination.skip_blocks: must be >= 0, got {self.skip_blocks}")


@dataclass
class PrefillDone(Message):
    """prefill -> decode: KV written (or failed); carries the first sampled token."""

    TYPE: ClassVar[str] = "prefill_done"
    rid: str
    first_token: int = -1
    logprobs: list[Any] | None = None
    checksum: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    kv_backend: str = ""  # transfer backend used (shm | tcp | gloo | ...), for the decode node's metrics
    # A hidden-state head (EAGLE, EAGLE-3, MTP): the target's features of the prompt's positions
    # features_start.. (the last ones, bounded), rows of features_dtype, for the decode node's head
    features: bytes = b""
    features_dtype: str = ""
    features_start: int = 0

    def check(self) -> None:
        if self.features_start < 0:
            raise ProtocolError(f"prefill_done.features_start: must be >= 0, got {self.features_start}")
        if self.features and self.features_dtype not in FEATURE_DTYPES:
            raise ProtocolError(f"prefill_done.features_dtype: one of {', '.join(FEATURE_DTYPES)}, "
                                f"got {self.features_dtype!r}")


MAX_LORA_NAME = 256
MAX_LORAS_LISTED = 4096   # adapters one Load report lists
MAX_LORA_PATH = 4096


def check_lora(kind: str, name: str, path: str) -> None:
    if len(name) > MAX_LORA_NAME or len(path) > MAX_LORA_PATH:
        raise ProtocolError(f"{kind}.lora_name / lora_path: at most {MAX_LORA_NAME} / {MAX_LORA_PATH} characters")
    if path and not name:
        raise ProtocolError(f"{kind}.lora_path: given without lora_name")


@dataclass
class LoraAdapter(Message):
    """router -> node: load (`path` given) or unload (`path` "") the LoRA adapter `name`; answered by LoraDone."""

    TYPE: ClassVar[str] = "lora_adapter"
    rid: str
    name: str
    path: str = ""

    def check(self) -> None:
        if not self.name:
            raise ProtocolError("lora_adapter.name: must not be empty")
        check_lora("lora_adapter", self.name, self.path)


@dataclass
class LoraDone(Message):
    """node -> router: the LoraAdapter `rid` is done (`error`: why not)."""

    TYPE: ClassVar[str] = "lora_done"
    rid: str
    error: str | None = None


MAX_FETCH_BLOCKS = 1 << 16   # blocks one FetchKV may ask for (a 1M-token prompt of 16-token blocks fits)
MAX_PRECOPY_HOLD_S = 120.0   # longest a node holds pre-copied blocks for a migration that does not come


@dataclass
class FetchKV(Message):
    """node -> a node holding a prefix: write the pool blocks published under the leading `block_hashes` (as many
    as it has, in order) into the first reserved blocks of the kv_transfer destination `dst`; answer KVFetched."""

    TYPE: ClassVar[str] = "fetch_kv"
    rid: str
    block_hashes: list[int]
    dst: dict[str, Any]
    timeout_s: float

    def check(self) -> None:
        check_timeout("fetch_kv", self.timeout_s)
        if len(self.block_hashes) > MAX_FETCH_BLOCKS:
            raise ProtocolError(f"fetch_kv.block_hashes: more than {MAX_FETCH_BLOCKS}")
        if not all(0 <= h < 1 << 63 for h in self.block_hashes):
            raise ProtocolError("fetch_kv.block_hashes: hashes must be integers in [0, 2**63)")


@dataclass
class KVFetched(Message):
    """holder -> fetching node: its first `num_blocks` reserved blocks were written, acknowledged with `checksum`
    by its receiver (0 blocks: the holder had none, nothing was sent); `error` when the copy failed."""

    TYPE: ClassVar[str] = "kv_fetched"
    rid: str
    num_blocks: int = 0
    checksum: int = 0
    kv_backend: str = ""
    error: str | None = None

    def check(self) -> None:
        if self.num_blocks < 0:
            raise ProtocolError(f"kv_fetched.num_blocks: must be >= 0, got {self.num_blocks}")


@dataclass
class Load(Message):
    """node -> routers at ~2 Hz (PUB/SUB): what routing policies need."""

    TYPE: ClassVar[str] = "load"
    node_id: str
    role: str
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    block_size: int = 16
    queued_prefill_tokens: int = 0
    # Generated tokens per second: a node's engine over its last ~2 s (EngineStats.tokens_per_s, the same
    # figure as its pdcluster_node_tokens_per_second gauge); a router's since its previous Load report.
    tokens_per_s: float = 0.0
    prefill_tokens_per_s: float = 0.0  # prompt tokens prefilled per second since the previous report (prefill nodes)
    transfer_gbps: float = 0.0
    state: str = "serving"  # serving | cordoned | draining
    # Block-hash events of the node's KV cache since its previous report, per tier (engine/kv_events.py):
    # [[op (0 stored, 1 evicted), tier (0 pool, 1 host, 2 disk), [hash, ...]], ...], in order. kv_seq numbers
    # the reports (a gap: some were lost); kv_snapshot: these events are everything the node holds (stored
    # groups), replacing what a router knew. Routers keep them in router/prefix_index.py.
    kv_events: list = field(default_factory=list)
    kv_seq: int = 0
    kv_snapshot: bool = False
    cached_block_hashes: list[int] = field(default_factory=list)   # ignored: what nodes before kv_events sent
    # Multi-LoRA: the adapters the node holds (loaded, ready to serve), and how many it may hold on its device at
    # once (0: it runs without enable_lora).
    loras: list[str] = field(default_factory=list)
    max_loras: int = 0
    timestamp: float = 0.0
    # Routers (role "router", running = requests in flight): open token streams, failed requests since start.
    streams: int = 0
    errors: int = 0

    def check(self) -> None:
        if self.block_size < 1:
            raise ProtocolError(f"load.block_size: must be >= 1, got {self.block_size}")
        counts: dict[str, int] = {"running": self.running, "waiting": self.waiting, "free_blocks": self.free_blocks,
                  "total_blocks": self.total_blocks, "queued_prefill_tokens": self.queued_prefill_tokens,
                  "streams": self.streams, "errors": self.errors, "max_loras": self.max_loras}
        for name, value in counts.items():
            if value < 0:
                raise ProtocolError(f"load.{name}: must be >= 0, got {value}")
        check_kv_events(self.kv_events)
        if len(self.loras) > MAX_LORAS_LISTED or not all(type(n) is str and 0 < len(n) <= MAX_LORA_NAME
                                                          for n in self.loras):
            raise ProtocolError(f"load.loras: at most {MAX_LORAS_LISTED} non-empty names of <= {MAX_LORA_NAME} "
                                "characters")
        if not isinstance(self.kv_seq, int) or self.kv_seq < 0:
            raise ProtocolError(f"load.kv_seq: must be an integer >= 0, got {self.kv_seq!r}")
        for name, rate in (("tokens_per_s", self.tokens_per_s), ("prefill_tokens_per_s", self.prefill_tokens_per_s),
                            ("transfer_gbps", self.transfer_gbps),
                            ("timestamp", self.timestamp)):
            if not math.isfinite(rate):
                raise ProtocolError(f"load.{name}: must be finite, got {rate}")


MAX_KV_EVENT_HASHES = 1 << 18   # block hashes in one Load report (a snapshot of three full tiers fits)


def check_kv_events(events: Any) -> None:
    """`Load.kv_events`' shape: groups of (op 0/1, tier 0-2, 63-bit hashes), at most MAX_KV_EVENT_HASHES in all."""
    if not isinstance(events, list):
        raise ProtocolError("load.kv_events: must be a list")
    total = 0
    for group in events:
        if (not isinstance(group, list) or len(group) != 3 or group[0] not in (STORED, EVICTED)
                or group[1] not in range(len(TIER_NAMES))
                or type(group[0]) is not int or type(group[1]) is not int or not isinstance(group[2], list)):
            raise ProtocolError("load.kv_events: each group must be [op 0|1, tier 0|1|2, [hash, ...]]")
        total += len(group[2])
        if total > MAX_KV_EVENT_HASHES:
            raise ProtocolError(f"load.kv_events: more than {MAX_KV_EVENT_HASHES} hashes")
        if not all(type(h) is int and 0 <= h < 1 << 63 for h in group[2]):
            raise ProtocolError("load.kv_events: hashes must be integers in [0, 2**63)")


@dataclass
class Ping(Message):
    TYPE: ClassVar[str] = "ping"
    nonce: int = 0


@dataclass
class Pong(Message):
    TYPE: ClassVar[str] = "pong"
    nonce: int = 0


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls for cls in (Generate, Tokens, TokenBatch, Progress, Reject, Abort, Handback, MoveAway, PreCopy,
                              PreCopied, Prefill, PrefillDestination, PrefillDone, FetchKV, KVFetched, LoraAdapter,
                              LoraDone, Load, Ping, Pong)
}
_TOKENS_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Tokens) if f.default is not dataclasses.MISSING}


def encode(msg: Message) -> bytes:
    # Fields are plain values (no nested dataclasses): a shallow copy is what asdict would make, faster.
    body = dict(msg.__dict__)
    if isinstance(msg, TokenBatch):
        body["items"] = [_tokens_item(item) for item in msg.items]
    body["v"] = PROTOCOL_VERSION
    body["t"] = msg.TYPE
    return msgpack.packb(body, use_bin_type=True)


def _tokens_item(tokens: Tokens) -> dict[str, Any]:
    """A Tokens as a TokenBatch item: only the fields that differ from their defaults."""
    return {k: v for k, v in tokens.__dict__.items() if k not in _TOKENS_DEFAULTS or v != _TOKENS_DEFAULTS[k]}


def decode(frame: bytes) -> Message:
    """The message in `frame`; any other bytes raise ProtocolError (never another exception: a receive
    loop drops the frame and goes on)."""
    try:
        return _decode(frame)
    except ProtocolError:
        raise
    except Exception as exc:   # a shape nobody foresaw must not escape as a crash of the caller
        raise ProtocolError(f"malformed frame: {type(exc).__name__}: {exc}") from None


def _decode(frame: bytes) -> Message:
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    try:
        body = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable frame: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"frame is a {type(body).__name__}, expected a map")
    version = body.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r}, expected {PROTOCOL_VERSION}")
    kind = body.pop("t", None)
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError("unknown message type in frame")
    return _build(cls, body, cls.TYPE)


def _build(cls: type[Message], body: Any, where: str) -> Message:
    """`cls` from a decoded map, type- and range-checked (ProtocolError naming `where` if not)."""
    if not isinstance(body, dict):
        raise ProtocolError(f"{where}: expected a map, got {type(body).__name__}")
    checks = _checks(cls)
    for name, value in body.items():   # fields left out keep their defaults, valid by construction
        check = checks.get(name) if isinstance(name, str) else None
        if check is None:
            raise ProtocolError(f"{where}: unknown fields {sorted(map(str, set(body) - set(checks)))}")
        if not check[0](value):
            raise ProtocolError(f"{cls.TYPE}.{name}: expected {check[1]}, got {type(value).__name__}")
    try:
        msg = cls(**body)
    except TypeError as exc:
        raise ProtocolError(f"{where}: {exc}") from None
    msg.check()
    return msg


_CHECKS: dict[type, dict[str, tuple[Any, str]]] = {}


def _checks(cls: type[Message]) -> dict[str, tuple[Any, str]]:
    """Per field: (does a wire value fit it, its type as written), built once per class (decode is a hot path)."""
    checks = _CHECKS.get(cls)
    if checks is None:
        checks = _CHECKS[cls] = {f.name: _check_for(str(f.type)) for f in dataclasses.fields(cls)}
    return checks


def _check_for(annotation: str) -> tuple[Any, str]:
    base, nullable = annotation.split("|")[0].strip(), "None" in annotation
    if base == "str":
        fits = lambda v: type(v) is str  # noqa: E731
    elif base == "int":
        fits = lambda v: type(v) is int  # noqa: E731  (not bool)
    elif base == "float":
        fits = lambda v: type(v) is float or type(v) is int  # noqa: E731
    elif base == "bool":
        fits = lambda v: type(v) is bool  # noqa: E731
    elif base == "bytes":
        fits = lambda v: type(v) is bytes  # noqa: E731
    elif base == "list[int]":
        fits, base = (lambda v: type(v) is list and all(type(x) is int for x in v)), "a list of ints"
    elif base.startswith("list"):
        fits, base = (lambda v: type(v) is list), "a list"
    elif base.startswith("dict"):
        fits, base = (lambda v: type(v) is dict), "a map"
    else:
        fits = lambda v: True  # noqa: E731  (Any)
    if nullable:
        return (lambda v: v is None or fits(v)), base
    return fits, base
