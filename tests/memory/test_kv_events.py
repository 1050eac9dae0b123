"""KV page events (engine/memory/kv_events.py): a subscriber that applies them in order holds the engine's set of
cached pages exactly, through admissions that share prefixes, evictions and a reset; the wire format is vLLM's
KVEvents; the hashes follow the documented scheme; bad endpoints are refused naming them."""
import time

import msgspec
import pytest
import zmq

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.memory.block_manager import prefix_digests
from engine.memory.kv_events import TOPIC, KVEventBatch, KVEventPublisher
from engine.requests.sequence import SamplingParams

BLOCK = 16


def drain(sub, quiet_s: float = 1.0) -> list[tuple[int, KVEventBatch]]:
    """Every message until none arrives for quiet_s: (sequence number, batch)."""
    decoder, got = msgspec.msgpack.Decoder(KVEventBatch), []
    while sub.poll(int(quiet_s * 1000)):
        topic, seq, payload = sub.recv_multipart()
        assert topic == TOPIC
        got.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
    return got


def apply(batches, cached: set, parents: dict) -> set[str]:
    """Apply the events to `cached` (a router's view); returns the event kinds seen."""
    kinds = set()
    for _, batch in batches:
        for event in batch.events:
            kind = type(event).__name__
            kinds.add(kind)
            if kind == "BlockStored":
                assert event.block_size == BLOCK and len(event.token_ids) == BLOCK * len(event.block_hashes)
                # the documented scheme: blake2b chained from the parent page's digest over int64 token ids
                assert prefix_digests(event.token_ids, BLOCK, event.parent_block_hash or b"") == event.block_hashes
                cached.update(event.block_hashes)
            elif kind == "BlockRemoved":
                assert set(event.block_hashes) <= cached
                cached.difference_update(event.block_hashes)
            else:
                cached.clear()
    return kinds


def test_a_subscriber_rebuilds_the_engines_cached_pages_exactly():
    engine = LLMEngine(model="dummy:tiny", device="cpu", dtype="float32", max_num_seqs=4, max_model_len=256,
                       num_kv_blocks=14, block_size=BLOCK, kv_events_endpoint="tcp://127.0.0.1:*")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sub.connect(engine.kv_events.endpoint)
    time.sleep(1.0)                                 # the subscription reaches the publisher before any event
    cached, parents, seen, batches = set(), {}, set(), []
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    try:
        for wave in range(4):                       # shared system prefixes, then new ones that evict the old
            system = [100 + wave] * 40
            engine.generate([system + [7, 8, 9 + i] for i in range(3)], params)
            got = drain(sub)
            batches += got
            seen |= apply(got, cached, parents)
            assert cached == set(engine.blocks._page), f"wave {wave}"
        engine.reset_prefix_cache()
        got = drain(sub)
        batches += got
        seen |= apply(got, cached, parents)
        assert cached == set() == set(engine.blocks._page)
    finally:
        sub.close()
        engine.close()
    assert [seq for seq, _ in batches] == list(range(len(batches)))           # nothing lost, in order
    assert seen == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    assert engine.blocks.evictions > 0


def test_the_payload_is_vllms_array_layout():
    """[ts, [["BlockStored", hashes, parent, tokens, block_size, lora_id, medium], ...]] as msgpack arrays."""
    from engine.memory.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
    batch = KVEventBatch(1.5, [BlockStored([b"a" * 16], None, list(range(BLOCK)), BLOCK, None, "GPU"),
                               BlockRemoved([b"a" * 16], "GPU"), AllBlocksCleared()])
    plain = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    assert plain == [1.5, [["BlockStored", [b"a" * 16], None, list(range(BLOCK)), BLOCK, None, "GPU"],
                           ["BlockRemoved", [b"a" * 16], "GPU"], ["AllBlocksCleared"]]]


@pytest.mark.parametrize("endpoint", ["localhost:5557", "http://x:1", "tcp://"])
def test_an_endpoint_that_is_not_a_zmq_address_is_refused_naming_it(endpoint):
    with pytest.raises(ValueError, match="kv_events_endpoint .* is not a ZMQ address"):
        EngineConfig(kv_events_endpoint=endpoint)


def test_events_need_the_prefix_cache_and_a_taken_address_is_refused():
    with pytest.raises(ValueError, match="needs prefix_caching"):
        EngineConfig(kv_events_endpoint="tcp://127.0.0.1:5557", prefix_caching=False)
    first = KVEventPublisher("tcp://127.0.0.1:*", BLOCK)
    try:
        with pytest.raises(ValueError, match="cannot bind"):
            KVEventPublisher(first.endpoint, BLOCK)
    finally:
        first.close()
