"""A stopping worker's flush of the KV written behind (shared/kv/connectors/flush.py):
it waits for stores on their way, no longer than its bound, and counts the blocks of
those it gave up on."""

import concurrent.futures
import threading
import time

from shared.kv.connectors.flush import StoresBehind


def test_a_flush_with_nothing_on_its_way_returns_at_once():
    stores = StoresBehind()
    done: concurrent.futures.Future[None] = concurrent.futures.Future()
    done.set_result(None)
    stores.add(done, 4)
    assert stores.flush(0.0) == 0
    assert stores.num_blocks_unflushed == 0 and stores.num_pending_blocks == 0


def test_a_flush_waits_for_stores_that_land_within_its_bound():
    stores = StoresBehind()
    landing = [concurrent.futures.Future() for _ in range(2)]
    failing: concurrent.futures.Future[None] = concurrent.futures.Future()
    for future, blocks in zip([*landing, failing], (3, 5, 7)):
        stores.add(future, blocks)
    assert stores.num_pending_blocks == 15
    release = threading.Event()

    def land() -> None:
        release.wait()
        landing[0].set_result(None)
        landing[1].set_result(None)
        failing.set_exception(ConnectionError("kvcache refused"))  # failed: counted where it fails, not here

    thread = threading.Thread(target=land)
    thread.start()
    release.set()
    # A generous bound: the stores end long before it, and the flush returns once they have.
    assert stores.flush(60.0) == 0
    thread.join()
    assert stores.num_blocks_unflushed == 0 and stores.num_pending_blocks == 0


def test_a_flush_gives_up_after_its_bound_and_counts_the_blocks_still_on_their_way():
    stores = StoresBehind()
    stuck = [concurrent.futures.Future() for _ in range(2)]
    landed: concurrent.futures.Future[None] = concurrent.futures.Future()
    stores.add(stuck[0], 26)
    stores.add(stuck[1], 4)
    stores.add(landed, 9)
    landed.set_result(None)
    started = time.monotonic()
    assert stores.flush(0.2) == 30
    assert time.monotonic() - started >= 0.2  # it did wait its bound (an upper bound would race a loaded machine)
    assert stores.num_blocks_unflushed == 30
    # Counted once: a second flush has nothing left to give up, even though they never land.
    assert stores.flush(0.0) == 0 and stores.num_blocks_unflushed == 30
    # One that lands after the flush gave up changes nothing.
    stuck[0].set_result(None)
    assert stores.num_blocks_unflushed == 30 and stores.num_pending_blocks == 0


def test_stores_added_during_a_flush_are_waited_for_too():
    stores = StoresBehind()
    first: concurrent.futures.Future[None] = concurrent.futures.Future()
    late: concurrent.futures.Future[None] = concurrent.futures.Future()
    stores.add(first, 2)
    result: list[int] = []
    flushing = threading.Thread(target=lambda: result.append(stores.flush(60.0)))
    flushing.start()
    stores.add(late, 3)  # a save started while the flush waits (the engine's last step)
    first.set_result(None)
    flushing.join(timeout=0.3)
    assert flushing.is_alive() and not result  # still waiting, for `late` (it cannot return before it lands)
    late.set_result(None)
    flushing.join()
    assert result == [0] and stores.num_blocks_unflushed == 0
