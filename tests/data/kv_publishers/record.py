"""Record a KV-event stream from an engine's own publisher class, as the bytes its ZMQ PUB
socket sends: one JSON line per message, ``{"frames": [hex, hex, hex]}`` (topic, seq, payload).

Run with a Python where the engine's package imports (nothing of it is copied here):

    python record.py sglang OUT.jsonl    # sglang.srt.disaggregation.kv_events.ZmqEventPublisher
    python record.py vllm OUT.jsonl      # vllm.distributed.kv_events.ZmqEventPublisher
"""

import json
import socket
import sys
import time

import zmq


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def batches(mod, engine):
    """The scenario: stores on the device tier (a chain, coalesced hashes), a store to the host
    tier, a removal, a LoRA/salted store (SGLang's optional fields), a clear."""
    R, C = mod.BlockRemoved, mod.AllBlocksCleared

    def S(**kw):  # vLLM's BlockStored requires lora_name; SGLang's defaults it
        return mod.BlockStored(**({"lora_name": None} if engine != "sglang" else {}) | kw)
    extra = {"lora_name": "adapter-a"}
    host = "CPU_PINNED" if engine == "sglang" else "CPU"
    if engine == "sglang":
        extra_salt = {"cache_salt": "salt-1", "session_id": "s1"}
    else:
        extra_salt = {"extra_keys": [None, None]}
    yield [S(block_hashes=[-5, 7], parent_block_hash=None, token_ids=list(range(8)), block_size=4,
             lora_id=None, medium="GPU")]
    yield [S(block_hashes=[11], parent_block_hash=7, token_ids=[8, 9, 10, 11], block_size=4,
             lora_id=None, medium="GPU")]
    yield [S(block_hashes=[-5], parent_block_hash=None, token_ids=[0, 1, 2, 3], block_size=4,
             lora_id=None, medium=host)]
    yield [R(block_hashes=[11], medium="GPU")]
    yield [S(block_hashes=[2 ** 62 + 3, 13], parent_block_hash=None, token_ids=list(range(100, 108)),
             block_size=4, lora_id=None, medium="GPU", **extra, **extra_salt)]
    yield [R(block_hashes=[-5, 7], medium="GPU"), R(block_hashes=[-5], medium=host)]
    yield [C()]


def main(engine: str, out: str) -> None:
    if engine == "sglang":
        import sglang.srt.disaggregation.kv_events as mod
        pub = mod.ZmqEventPublisher(attn_dp_rank=0, endpoint=f"tcp://127.0.0.1:{free_port()}",
                                    bind=True, topic="kv")
        batch = lambda evs: mod.KVEventBatch(ts=time.time(), events=evs)  # noqa: E731
    else:
        import vllm.distributed.kv_events as mod
        port = free_port()  # vLLM binds a wildcard endpoint (connects to any other)
        pub = mod.ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", topic="kv")
        batch = lambda evs: mod.KVEventBatch(ts=time.time(), events=evs)  # noqa: E731
    endpoint = f"tcp://127.0.0.1:{port}" if engine != "sglang" else \
        pub._pub.getsockopt_string(zmq.LAST_ENDPOINT)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    # PUB drops messages until the subscription arrives: probe with empty batches until one
    # is received, then record from the first content batch on (its seq is above 0)
    while True:
        pub.publish(batch([]))
        if sub.poll(200):
            sub.recv_multipart()
            break
    while sub.poll(200):
        sub.recv_multipart()
    lines = []
    for evs in batches(mod, engine):
        pub.publish(batch(evs))
        assert sub.poll(5000), "the publisher sent nothing"
        lines.append({"frames": [f.hex() for f in sub.recv_multipart()]})
    pub.shutdown()
    with open(out, "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
