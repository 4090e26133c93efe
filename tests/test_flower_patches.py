"""The speed-up of Flower's simulation engine delivers the messages Flower's own loop delivers.

(The Ray tests in test_simulation.py run it end to end: ``engine.simulate`` installs it.)
"""

from __future__ import annotations

import threading
from queue import Queue
from types import SimpleNamespace

from flwr.server.superlink.fleet.vce import vce_api

from fedcluster_flwr import flower_patches

FLOWERS_LOOP = vce_api.add_messages_to_queue  # as imported, before any install()


class FakeState:
    """What the loops use of Flower's in-memory link state: its store, its lock, and
    ``get_message_ins`` (the first undelivered message of a node, marked delivered)."""

    def __init__(self, destinations: list[int]) -> None:
        self.lock = threading.RLock()
        self.message_ins_store = {
            f"m{i}": SimpleNamespace(id=f"m{i}", metadata=SimpleNamespace(dst_node_id=node, delivered_at=""))
            for i, node in enumerate(destinations)
        }
        self.asked: list[int] = []

    def get_message_ins(self, node_id: int, limit: int | None) -> list[SimpleNamespace]:
        self.asked.append(node_id)
        for message in self.message_ins_store.values():
            if message.metadata.dst_node_id == node_id and message.metadata.delivered_at == "":
                message.metadata.delivered_at = "now"
                return [message]
        return []


class OnePass(threading.Event):
    """A stop event that lets the loop run ``passes`` times."""

    def __init__(self, passes: int) -> None:
        super().__init__()
        self.passes = passes

    def wait(self, timeout: float | None = None) -> bool:
        self.passes -= 1
        if self.passes <= 0:
            self.set()
        return self.is_set()


def delivered(loop, destinations: list[int], nodes: dict[int, int], passes: int) -> tuple[list[str], FakeState]:
    state, queue = FakeState(destinations), Queue()
    loop(state, queue, nodes, OnePass(passes))
    return [queue.get().id for _ in range(queue.qsize())], state


def test_the_same_messages_in_the_same_order_as_flowers_loop():
    nodes = {node: pid for pid, node in enumerate([17, 3, 42, 8, 99])}  # node id -> partition id
    destinations = [42, 3, 42, 8, 17, 3, 3]  # one message per node per pass: 3 gets its third in pass 3
    for passes in (1, 2, 3):
        ours, state = delivered(flower_patches.add_messages_to_queue, destinations, nodes, passes)
        flowers, _ = delivered(FLOWERS_LOOP, destinations, nodes, passes)
        assert ours == flowers
    assert ours == ["m4", "m1", "m0", "m3", "m5", "m2", "m6"]
    assert state.asked == [17, 3, 42, 8, 3, 42, 3]  # only nodes with a message waiting were asked


def test_a_state_without_an_in_memory_store_is_asked_for_every_node():
    state = SimpleNamespace(get_message_ins=lambda node_id, limit: [])
    assert flower_patches.waiting_nodes(state, [5, 1, 9]) == [5, 1, 9]


def test_install_replaces_only_the_loop_it_was_written_for(monkeypatch):
    monkeypatch.setattr(vce_api, "add_messages_to_queue", FLOWERS_LOOP)
    assert flower_patches.install()
    assert vce_api.add_messages_to_queue is flower_patches.add_messages_to_queue
    assert flower_patches.install()  # again: still installed, nothing else changed

    def another_flowers_loop(state, queue, nodes_mapping, f_stop, extra):
        pass

    monkeypatch.setattr(vce_api, "add_messages_to_queue", another_flowers_loop)
    assert not flower_patches.install()
    assert vce_api.add_messages_to_queue is another_flowers_loop
