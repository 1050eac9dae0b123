"""KV page events for prefix-aware routers, in vLLM's KVEvents wire format (msgpack over a ZMQ PUB socket).

The block manager and the prefix map record, as plain tuples, what changes in the set of cached pages
(engine/memory/block_manager.py, prefix_map.py): pages registered under their digests ("stored": the digests, the
parent page's digest, the pages' tokens), cached pages taken back for new ones ("removed") and the whole cache
forgotten ("cleared"). After each step the engine hands what a step recorded to `KVEventPublisher.publish`,
which queues it; a thread of its own encodes and sends it, so the loop never waits on the socket.

On the wire, one multipart message a step that changed something: [topic, sequence number (8 bytes, big-endian,
from 0), payload], the payload a msgpack `KVEventBatch` [timestamp, [event, ...]], each event an array tagged with
its type: ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium],
["BlockRemoved", block_hashes, medium] or ["AllBlocksCleared"]. A router that applies them in order holds the
engine's set of cached pages exactly.

Block hashes are this engine's page digests (16 bytes): blake2b over the parent page's digest (none for a
sequence's first page) and the page's token ids as int64 little-endian, block_size tokens a page
(engine/memory/block_manager.py prefix_digests). A router that hashes prompts itself must use the same scheme;
one that reads token_ids from BlockStored needs none.
"""
from __future__ import annotations

import queue
import threading
import time

import msgspec

TOPIC = b"kv-events"
QUEUE = 100_000         # batches waiting to be sent; past it the oldest are dropped (a gap in the sequence numbers)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Tagged by class name on the wire."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_event(record: tuple, block_size: int, medium: str):
    """A recorded tuple as its wire event."""
    kind = record[0]
    if kind == "stored":
        _, hashes, parent, tokens = record
        return BlockStored(list(hashes), parent or None, list(tokens), block_size, None, medium)
    if kind == "removed":
        return BlockRemoved(record[1], medium)
    if kind == "cleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event record {kind!r}")


class KVEventPublisher:
    """Binds a PUB socket at `endpoint` (EngineConfig checked its form; ValueError naming it where it cannot be
    bound) and sends each published step's
    events from a thread of its own."""

    def __init__(self, endpoint: str, block_size: int, medium: str = "GPU"):
        import zmq
        self.block_size, self.medium = block_size, medium
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, QUEUE)
        self._socket.setsockopt(zmq.LINGER, 1000)
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as e:
            self._socket.close()
            raise ValueError(f"kv_events_endpoint {endpoint!r}: cannot bind it ({e})") from e
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)   # the port a "*" or 0 got
        self._queue: queue.Queue = queue.Queue(QUEUE)
        self._seq = 0               # the next batch's sequence number (a dropped batch leaves its gap)
        self._thread = threading.Thread(target=self._send_all, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, records: list[tuple]) -> None:
        """Queue one step's records (called on the engine's loop; returns at once)."""
        item, self._seq = (self._seq, time.time(), records), self._seq + 1
        try:
            self._queue.put_nowait(item)
        except queue.Full:          # the sending side is stuck: drop the oldest, which leaves a gap a router sees
            self._queue.get_nowait()
            self._queue.put_nowait(item)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _send_all(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        try:
            while (item := self._queue.get()) is not None:
                seq, ts, records = item
                events = [to_event(r, self.block_size, self.medium) for r in records]
                self._socket.send_multipart([TOPIC, seq.to_bytes(8, "big"), encoder.encode(KVEventBatch(ts, events))])
        finally:
            self._socket.close()
