"""The batched engine over Ray actors (fedcluster_flwr.engines.sharded): shards, placement, config;
slow: on two local actors and on a two-node Ray cluster, the decisions of single-process batched; a
`fedcluster run` on two actors stopped by Ctrl-C or SIGTERM leaves no actor and resumes to them."""

from __future__ import annotations

import logging
import os
import re
import signal

import pytest

from conftest import DEFAULT_CONFIG
from fedcluster_flwr.config.load import load_config, parse_override
from fedcluster_flwr.declarations.schema import ConfigError
from fedcluster_flwr.engines.sharded import place_shards, shards
from test_engines import run_case
from test_lifecycle import (OVERRIDES, STOP_AT_ROUND, assert_one_line_naming_the_resume, process_table, read_run,
                            started, stop_at_round_2_and_resume)  # noqa: F401 - started: the fixture

# Ray's cluster description, as ray.cluster_resources() and ray.nodes() give it
TWO_NODES = [{"NodeID": "b" * 56, "NodeManagerAddress": "10.0.0.2", "Alive": True, "Resources": {"CPU": 2.0}},
             {"NodeID": "a" * 56, "NodeManagerAddress": "10.0.0.1", "Alive": True, "Resources": {"CPU": 8.0}}]


def config(*overrides: str):
    return load_config(DEFAULT_CONFIG, [parse_override(o) for o in ("simulation.engine=batched", *overrides)])[0]


@pytest.mark.parametrize("clients,count", [(20, 2), (20, 3), (7, 7), (5, 9), (100, 16)])
def test_shards_are_contiguous_blocks_of_partition_ids_of_near_equal_size(clients, count):
    blocks = shards(clients, count)
    assert [pid for block in blocks for pid in block] == list(range(clients))
    assert len(blocks) == min(clients, count) and max(map(len, blocks)) - min(map(len, blocks)) <= 1


def test_actors_asked_for_share_the_cpus_evenly():
    blocks, placements = place_shards(config("simulation.batched_actors=2"), {"CPU": 5.0}, TWO_NODES)
    assert blocks == [list(range(10)), list(range(10, 20))]
    assert placements == [({"num_cpus": 2.5, "num_gpus": 0}, 2)] * 2  # 5 / 2 cores each; floor(2.5) workers
    _, crowded = place_shards(config("simulation.batched_actors=3"), {"CPU": 2.0}, TWO_NODES)
    assert crowded == [({"num_cpus": 2 / 3, "num_gpus": 0}, 1)] * 3  # more actors than cores: they share them


def test_a_joined_cluster_gets_one_actor_per_node_holding_its_cpus():
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    blocks, placements = place_shards(config("simulation.ray_address=10.0.0.1:6379", "client.device=cpu"),
                                      {"CPU": 10.0}, TWO_NODES)
    assert blocks == [list(range(10)), list(range(10, 20))]
    (first, first_workers), (second, second_workers) = placements
    assert (first["num_cpus"], first_workers, second["num_cpus"], second_workers) == (8, 8, 2, 2)  # by address
    assert isinstance(first["scheduling_strategy"], NodeAffinitySchedulingStrategy)
    assert first["scheduling_strategy"].node_id == "a" * 56 and not first["scheduling_strategy"].soft


def test_a_cluster_with_gpus_gets_one_actor_per_gpu():
    blocks, placements = place_shards(config("simulation.ray_address=10.0.0.1:6379"), {"CPU": 10.0, "GPU": 4.0}, TWO_NODES)
    assert len(blocks) == 4 and all(options["num_gpus"] == 1 and workers == 1 for options, workers in placements)


@pytest.mark.parametrize("overrides,key", [
    (("simulation.engine=inprocess", "simulation.batched_actors=2"), "simulation.batched_actors"),
    (("simulation.engine=batched", "simulation.batched_actors=0"), "simulation.batched_actors"),
    (("simulation.engine=inprocess", "simulation.ray_address=10.0.0.1:6379"), "simulation.ray_address"),
])
def test_sharding_settings_that_cannot_work_name_their_key(overrides, key):
    with pytest.raises(ConfigError) as caught:
        load_config(DEFAULT_CONFIG, [parse_override(o) for o in overrides])
    assert caught.value.key == key


def no_shard_left() -> bool:
    return not [p for p in process_table().values() if "ShardHost" in p["cmd"]]


def assert_same_decisions(case, expected, got):
    """What test_engines asks of batched against inprocess, asked of sharded against batched."""
    rows, sharded_rows = expected.observer.recorder.rows, got.observer.recorder.rows
    assert [r["fit_clients"] for r in sharded_rows] == [r["fit_clients"] for r in rows], case
    # the behaviour fixture's settings fail two clients' fits on purpose (simulation.fail_fit): the
    # same failures, no more (no fit failed for the engine's sake), each its own client's inside a shard
    assert [r["fit_failures"] for r in sharded_rows] == [r["fit_failures"] for r in rows], case
    for before, after in zip(rows, sharded_rows):
        for pid, accuracy in before["client_accuracy"].items():
            assert after["client_accuracy"][pid] == pytest.approx(accuracy, abs=1e-4), (case, before["round"], pid)
    if hasattr(expected, "communication"):
        assert (got.communication == expected.communication).all()
    else:
        assert [int(c) for c in got.assignment] == [int(c) for c in expected.assignment]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["flhc", "dac"])
def test_two_local_actors_make_the_decisions_of_one_process(case, tmp_path, caplog):
    one = run_case(case, "batched", tmp_path / "one")
    with caplog.at_level(logging.INFO, logger="fedcluster"):
        two = run_case(case, "batched", tmp_path / "two", "simulation.batched_actors=2")
    assert "batched over 2 Ray actors: partitions 0-9 on node" in caplog.text
    assert_same_decisions(case, one, two)
    assert no_shard_left()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["flhc", "dac"])
def test_a_two_node_ray_cluster_makes_the_decisions_of_one_process(case, tmp_path, caplog):
    """Ray's own two-node cluster on this machine (ray.cluster_utils.Cluster): one shard per node."""
    from ray.cluster_utils import Cluster

    one = run_case(case, "batched", tmp_path / "one")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        with caplog.at_level(logging.INFO, logger="fedcluster"):
            two = run_case(case, "batched", tmp_path / "two", f"simulation.ray_address={cluster.address}",
                           "client.device=cpu")
    finally:
        cluster.shutdown()
    placed = re.search(r"batched over 2 Ray actors: (.*)", caplog.text).group(1)
    nodes = re.findall(r"on node ([^;]+)", placed)
    assert len(set(nodes)) == 2, placed  # one shard on each node
    assert_same_decisions(case, one, two)
    assert no_shard_left()


@pytest.mark.slow
def test_a_cluster_whose_nodes_have_gpus_gets_one_actor_per_gpu_from_rays_scheduler(tmp_path, caplog):
    """Two nodes declaring one GPU each (Ray schedules by the declared count; torch here sees no CUDA,
    so ``client.device: auto`` trains on the CPU): one actor per GPU, one on each node, holding it,
    with the decisions of one process. On a real GPU the device script checks the same
    (benchmarks/device/run.py, ``batched_actor``)."""
    from ray.cluster_utils import Cluster

    one = run_case("flhc", "batched", tmp_path / "one")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 1})
    try:
        cluster.add_node(num_cpus=1, num_gpus=1)
        cluster.wait_for_nodes()
        with caplog.at_level(logging.INFO, logger="fedcluster"):
            two = run_case("flhc", "batched", tmp_path / "two", f"simulation.ray_address={cluster.address}",
                           "client.device=auto")
    finally:
        cluster.shutdown()
    placed = re.search(r"batched over 2 Ray actors: (.*)", caplog.text).group(1)
    nodes = re.findall(r"on node ([^;]+)", placed)
    assert len(set(nodes)) == 2 and all(node.endswith(", GPU 0") for node in nodes), placed  # one GPU each
    assert_same_decisions("flhc", one, two)
    assert no_shard_left()


@pytest.mark.slow
def test_a_lost_actor_stops_the_run_in_one_line_naming_its_shard_and_partitions():
    """A node that dies takes its actor: the engine's fault, never the shard's clients' failures."""
    import ray
    from flwr.app import Message, RecordDict

    from fedcluster_flwr.engines.batched import EngineError
    from fedcluster_flwr.engines.inprocess import node_id_of, partition_node_configs
    from fedcluster_flwr.engines.sharded import ShardedGrid, ShardHost

    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        host = ray.remote(ShardHost).options(num_cpus=0, max_restarts=0).remote(max, [0, 1], 1)  # any builder
        grid = ShardedGrid(partition_node_configs(2), [host], [[0, 1]], ["10.0.0.2, 0123456789ab"])
        ray.kill(host)
        with pytest.raises(EngineError, match=r"^the Ray actor of shard 0 \(partitions 0-1, node 10\.0\.0\.2, "
                                              r"0123456789ab\) was lost \(\w+\): the run stops; resume it"):
            grid.deliver([Message(RecordDict(), node_id_of(1), "train")])
        assert grid.engine_fault(EngineError("x"))
    finally:
        ray.shutdown()
    assert no_shard_left()


@pytest.mark.slow
def test_a_sharded_run_stops_and_resumes_on_another_number_of_actors_with_what_its_clients_kept(tmp_path):
    """Ditto keeps each client's personal model on its node: a checkpoint read from two actors'
    shards, given back to three, continues as the run on one process goes."""
    from fedcluster_flwr.apps.server_app import run_in_process
    from fedcluster_flwr.results.checkpoints import load_checkpoint

    settings = ("strategy.name=ditto", "strategy.client_fraction=0.5", "rounds=4")
    whole = run_in_process(config(*settings), tmp_path / "whole")
    run_in_process(config(*settings, "simulation.batched_actors=2"), tmp_path / "stopped", stop_after=2)
    kept = load_checkpoint(tmp_path / "stopped")["clients"]
    assert kept and all(values for values in kept.values())  # the personal models, read from the actors
    resumed = run_in_process(config(*settings, "simulation.batched_actors=3"), tmp_path / "stopped", resume=True)
    assert_same_decisions("ditto", whole, resumed)
    assert no_shard_left()


@pytest.mark.slow
@pytest.mark.parametrize(("name", "send", "code"), [
    ("ctrl-c", lambda proc: os.killpg(proc.pid, signal.SIGINT), 130),
    ("sigterm", lambda proc: proc.send_signal(signal.SIGTERM), 143),
])
def test_a_stopped_sharded_run_leaves_no_actor_and_resumes_to_the_decisions_of_one_process(
    name, send, code, started, tmp_path
):
    """`fedcluster run` on two actors, stopped at round 2 as a terminal or a scheduler stops it: it
    exits in one line naming the resume, no actor, raylet or other Ray process of it is left, and
    `fedcluster resume` (on two actors again) ends where single-process batched ends."""
    from fedcluster_flwr.apps.server_app import run_in_process

    settings = ("simulation.engine=batched", *OVERRIDES)
    run_in_process(config(*OVERRIDES), tmp_path / "one")
    run_dir = tmp_path / name
    returncode, _, out, err = stop_at_round_2_and_resume(
        started, run_dir, send, (*settings, "simulation.batched_actors=2"), ray_process="ShardHost")
    assert returncode == code, err[-3000:]
    assert_one_line_naming_the_resume(out, err, run_dir)
    assert no_shard_left()
    (rows, summary), (one_rows, one_summary) = read_run(run_dir), read_run(tmp_path / "one")
    assert len(rows) == len(one_rows) > STOP_AT_ROUND
    assert [r["fit_clients"] for r in rows] == [r["fit_clients"] for r in one_rows]
    assert all(r["fit_failures"] == 0 for r in rows)
    assert summary["assignment"] == one_summary["assignment"]
    for pid, accuracy in one_summary["client_accuracy"].items():
        assert summary["client_accuracy"][pid] == pytest.approx(accuracy, abs=1e-4), pid


@pytest.mark.slow
def test_a_model_several_messages_of_a_shard_carry_is_sent_once_per_shard(tmp_path):
    """benchmarks/engines/sharded_bytes.py, as the how-to page quotes it: an evaluation of FedAvg
    sends every client the one global model; two actors are sent it twice, not once per client."""
    import json
    import subprocess
    import sys

    from conftest import ROOT

    out = tmp_path / "bytes.json"
    subprocess.run([sys.executable, "benchmarks/engines/sharded_bytes.py", str(DEFAULT_CONFIG), "--rounds", "1",
                    "--actors", "2", "--set", "strategy.name=fedavg", "--out", str(out)], cwd=ROOT, check=True, capture_output=True)
    evaluation = next(e for e in json.loads(out.read_text())["exchanges"] if e["message_type"] == "evaluate")
    per_shard = evaluation["sent_per_shard"]
    assert evaluation["messages"] == 20 and len(per_shard) == 2
    one_copy = evaluation["sent_one_by_one"] / evaluation["messages"]  # one client's message
    assert all(one_copy <= sent < 1.5 * one_copy for sent in per_shard.values()), (per_shard, one_copy)
    assert no_shard_left()
