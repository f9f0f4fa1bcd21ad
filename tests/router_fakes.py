"""Test doubles for the router tests: a tiny byte-fallback tokenizer on disk, fake decode nodes
(real zmq ROUTER sockets speaking pdcluster.control.protocol, in a thread) and a uvicorn server thread."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Any

import uvicorn
import zmq

from pdcluster.control import protocol
from pdcluster.control.protocol import Abort, Generate, Load, Progress, Reject, TokenBatch, Tokens
from pdcluster.control.records import Capacity, NodeInfo

CORPUS = [
    "Hello world, this is a tiny test corpus for the router.",
    "The quick brown fox jumps over the lazy dog.",
    "Stop strings may span several tokens of the stream.",
] * 20
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def make_tokenizer_dir(path: str, max_position_embeddings: int = 256) -> str:
    """A Llama-style (metaspace + byte fallback) BPE tokenizer trained on ASCII text, so any
    non-ASCII character becomes several <0xNN> byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=420, special_tokens=specials + byte_tokens,
                                                        show_progress=False))
    # Byte tokens are ordinary vocabulary in Llama tokenizers (not "special": skip_special_tokens keeps them).
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] in specials]
    tok = Tokenizer.from_str(json.dumps(spec))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "bos_token_id": 1,
                   "eos_token_id": 2, "max_position_embeddings": max_position_embeddings}, f)
    return path


class FakeDecodeNode:
    """Answers Generate with tokens from `script` (position i -> script[i]), `chunk` ids per message
    every `delay` seconds; finish "length" at max_tokens, "stop" when the script ends.

    mode: "ok" | "reject" (Reject every Generate) | "die" (after `die_after` tokens of its first
    request it closes its socket and stops, like a killed process) | "silent" (takes every Generate and
    never answers, like a hung node).
    first_delay: seconds before a request's first token (a queue, a slow prefill); meanwhile, with
    `progress` set, a Progress for it every `progress` seconds (what a real decode node does).
    batch: send the tokens of one loop pass (a "step") as one `TokenBatch` per router, as a real decode node
    does. gap_prompt: the second message of a request with exactly these prompt ids skips a position (tokens
    lost in a reconnect), once.
    """

    def __init__(self, node_id: str, script: list[int], mode: str = "ok", delay: float = 0.01, chunk: int = 1,
                 die_after: int = 3, load: dict[str, Any] | None = None, model: str = "tiny",
                 max_model_len: int = 0, first_delay: float = 0.0, progress: float | None = None,
                 batch: bool = False, gap_prompt: list[int] | None = None) -> None:
        self.node_id = node_id
        self.model = model  # the served name it registers (NodeInfo.model)
        self.max_model_len = max_model_len  # registered in NodeInfo.capacity; 0 = not said
        self.script = script
        self.mode = mode
        self.delay = delay
        self.chunk = chunk
        self.die_after = die_after
        self.first_delay = first_delay
        self.progress = progress
        self.batch = batch
        self.gap_prompt = gap_prompt
        self.batches: list[TokenBatch] = []   # what it sent, in batch mode
        self.load = load  # when set, published as Load every 0.1 s
        self.generates: list[Generate] = []
        self.aborts: list[Abort] = []
        self.dead = threading.Event()
        self._stop = threading.Event()
        ctx = zmq.Context.instance()
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self._sock.bind_to_random_port('tcp://127.0.0.1')}"
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.load_address = f"tcp://127.0.0.1:{self._pub.bind_to_random_port('tcp://127.0.0.1')}"
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"fake-{node_id}")
        self._thread.start()

    @property
    def info(self) -> NodeInfo:
        return NodeInfo(node_id=self.node_id, role="decode", model=self.model, control_addr=self.address,
                        load_addr=self.load_address, capacity=Capacity(max_model_len=self.max_model_len))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        active: dict[str, dict[str, Any]] = {}
        sent_total = 0
        next_load = 0.0
        try:
            while not self._stop.is_set():
                if self._sock.poll(5):
                    frames = self._sock.recv_multipart()
                    msg = protocol.decode(frames[1])
                    if isinstance(msg, Generate):
                        self.generates.append(msg)
                        if self.mode == "reject":
                            self._send(frames[0], Reject(rid=msg.rid, reason="queue full", retry_after=2.0))
                        else:
                            active[msg.rid] = {"identity": frames[0], "pos": len(msg.resume_ids),
                                               "max": msg.sampling["max_tokens"],
                                               "logprobs": msg.sampling.get("logprobs"),
                                               "first": True, "next": time.monotonic() + self.first_delay,
                                               "ping": 0.0, "resumed": len(msg.resume_ids),
                                               "gap": msg.prompt_ids == self.gap_prompt and not msg.resume_ids,
                                               "plen": len(msg.prompt_ids)}
                    elif isinstance(msg, Abort):
                        self.aborts.append(msg)
                        active.pop(msg.rid, None)
                now = time.monotonic()
                if self.load is not None and now >= next_load:
                    self._pub.send(protocol.encode(Load(node_id=self.node_id, role="decode", **self.load)))
                    next_load = now + 0.1
                step: dict[bytes, list[Tokens]] = {}
                for rid, req in list(active.items()):
                    if self.mode == "silent":
                        continue
                    if now < req["next"]:
                        if self.progress and req["first"] and now >= req["ping"]:
                            self._send(req["identity"], Progress(rids=[rid], states=["queued"]))
                            req["ping"] = now + self.progress
                        continue
                    if self.mode == "die" and sent_total >= self.die_after:
                        self.dead.set()
                        return  # the finally closes the socket: the node is gone
                    n = min(self.chunk, req["max"] - req["pos"])
                    ids = [self.script[(req["pos"] + k) % len(self.script)] for k in range(n)]
                    end = req["pos"] + n
                    finish = "length" if end >= req["max"] else None
                    if end >= len(self.script) and finish is None:
                        ids = ids[:len(self.script) - req["pos"]]
                        end, finish = len(self.script), "stop"
                    logprobs = None
                    if req["logprobs"] is not None:
                        logprobs = [[-0.25 * (1 + (req["pos"] + k) % 3),
                                     [[t + j, -0.25 * (1 + j)] for j in range(req["logprobs"])]]
                                    for k, t in enumerate(ids)]
                    msg = Tokens(rid=rid, ids=ids, logprobs=logprobs, finish=finish,
                                 num_prompt_tokens=req["plen"] if req["first"] else 0,
                                 prefill_path="local" if req["first"] else "", pos=req["pos"] - req["resumed"])
                    if req["gap"] and req["pos"] > req["resumed"]:
                        msg.pos += 1
                        req["gap"], self.gap_prompt = False, None
                    if self.batch:
                        step.setdefault(req["identity"], []).append(msg)
                    else:
                        self._send(req["identity"], msg)
                    sent_total += len(ids)
                    req.update(pos=end, first=False, next=now + self.delay)
                    if finish:
                        del active[rid]
                for identity, items in step.items():
                    self.batches.append(TokenBatch(items=items))
                    self._send(identity, self.batches[-1])
        finally:
            self._sock.close(0)
            self._pub.close(0)

    def _send(self, identity: bytes, msg: protocol.Message) -> None:
        self._sock.send_multipart([identity, protocol.encode(msg)])


class ServerThread:
    """uvicorn (uvloop + httptools, as in production) serving `app` on a free loopback port."""

    def __init__(self, app: Any) -> None:
        from pdcluster.router.server import uvicorn_config

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", self.port))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def start(self, timeout: float = 20.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("router server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)
        self._sock.close()


def wait_until(predicate, timeout: float = 5.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


# Tool-calling fixtures shared by test_tool_calls.py and test_responses_api.py: two Hermes-style calls, and a chat
# template that renders tools, the assistant's calls and the tools' answers and opens <think> (qwen3 style).
HERMES = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
TEMPLATE = ("{% if tools %}<s>tools: {% for t in tools %}"
            "{{ t.function.name }} {{ t.function.parameters | default({}) | tojson }};{% endfor %}\n{% endif %}"
            "{% for m in messages %}<s>{{ m.role }}: {{ m.content or '' }}"
            "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }} city={{ c.function.arguments.city }}"
            "</call>{% endfor %}{% if m.tool_call_id %} ({{ m.tool_call_id }}){% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:<think>\n{% endif %}")
