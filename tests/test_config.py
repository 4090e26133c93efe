"""Config loading, overrides and the error a user gets for each kind of mistake."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
import yaml

from conftest import DEFAULT_CONFIG, ROOT
from fedcluster_flwr.config.load import (
    apply_overrides,
    build_config,
    config_to_dict,
    load_config,
    parse_override,
    read_yaml,
)
from fedcluster_flwr.declarations.schema import ConfigError


def load(*overrides: str):
    return load_config(DEFAULT_CONFIG, [parse_override(o) for o in overrides])


def test_default_config_loads_with_typed_values():
    config, notes = load()
    assert notes == []
    assert config.dataset.name == "digits"
    assert config.partition.name == "label_swap" and config.partition.num_clients >= 20
    assert config.strategy.name == "flhc"
    assert config.strategy.options.distance == "l1" and config.strategy.options.linkage == "complete"
    assert isinstance(config.client.lr, float)


def test_dotted_overrides_are_parsed_as_yaml_values():
    config, _ = load("rounds=7", "client.lr=1e-3", "strategy.linkage=average", "partition.name=rotation",
                     "partition.angles=[0, 180]", "partition.cluster_sizes=[10,10]")
    assert config.rounds == 7
    assert config.client.lr == pytest.approx(1e-3)
    assert config.strategy.options.linkage == "average"
    assert config.partition.options.angles == (0.0, 180.0)


def test_switching_strategy_drops_the_old_strategys_options_with_one_note():
    config, notes = load("strategy.name=fedavg")
    assert config.strategy.name == "fedavg" and config.strategy.options.client_fraction == 0.3
    assert notes == ["strategy.name=fedavg replaces the YAML's flhc: dropped its options rounds_before_clustering, "
                     "distance, linkage, threshold; kept client_fraction"]


def test_a_key_of_another_strategy_in_the_yaml_itself_is_ignored_with_a_note(tmp_path):
    raw = read_yaml(DEFAULT_CONFIG)
    raw["strategy"]["tau"] = 3.0  # a DAC option under FL+HC
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    config, notes = load_config(path)
    assert config.strategy.name == "flhc" and notes == ["strategy.tau ignored: not an option of strategy 'flhc'"]


def test_resolved_config_round_trips():
    config, _ = load("strategy.num_clusters=4", "strategy.threshold=null")
    again, notes = build_config(config_to_dict(config))
    assert again == config and notes == []


@pytest.mark.parametrize("path", sorted((ROOT / "conf").glob("*.yaml")), ids=lambda p: p.name)
def test_every_conf_file_loads_without_notes_and_its_resolved_config_round_trips(path, tmp_path, monkeypatch):
    # a home holding torchvision's ResNet-18 file where the pretrained-feature conf expects it
    monkeypatch.setenv("HOME", str(tmp_path))
    weights = tmp_path / ".cache" / "torch" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    weights.parent.mkdir(parents=True)
    weights.touch()
    config, notes = load_config(path)
    assert notes == []
    again, notes = build_config(config_to_dict(config))
    assert again == config and notes == []


def test_a_paper_key_that_is_a_python_keyword_round_trips():
    config, notes = load("strategy.name=gradloss", "strategy.lambda=0.5")
    assert config.strategy.options.lambda_ == 0.5 and "dropped its options" in " ".join(notes)
    plain = config_to_dict(config)
    assert plain["strategy"]["lambda"] == 0.5 and "lambda_" not in plain["strategy"]
    assert build_config(plain)[0] == config


def test_the_configs_dataset_facts_are_those_of_the_loaded_pool():
    """The config checks models against the registry's shapes without loading data; the bundled
    dataset's pool must agree with them (the others are checked where their files are faked)."""
    from fedcluster_flwr.data import DATASETS, load_pool

    config, _ = load("dataset.name=digits")
    pool = load_pool("digits")
    assert (config.input_shape, config.num_classes) == (pool.input_shape, pool.num_classes)
    assert DATASETS["digits"].input_shape == pool.input_shape


def all_options_classes():
    from fedcluster_flwr.data.partitions import PARTITIONERS
    from fedcluster_flwr.registry import strategies

    return {cls for s in strategies().values() for cls in s.Options.__mro__ if dataclasses.is_dataclass(cls)} | {
        p.options for p in PARTITIONERS.values()}


def test_a_field_redeclared_in_a_subclass_keeps_its_bases_constraints():
    """A subclass that changes a default redeclares the field, and the field's metadata with it: it
    must declare the same constraints (GradLossOptions.selection_batch), or they would be lost."""
    for cls in all_options_classes():
        for base in cls.__mro__[1:]:
            if not dataclasses.is_dataclass(base):
                continue
            ours = {f.name: f.metadata for f in dataclasses.fields(cls)}
            for field in dataclasses.fields(base):
                assert ours[field.name].get("constraints") == field.metadata.get("constraints"), (
                    f"{cls.__name__}.{field.name} drops the constraints {base.__name__} declares")


def test_yaml_reads_exponent_floats(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("client: {lr: 1e-3}\n")
    assert read_yaml(path)["client"]["lr"] == pytest.approx(1e-3)


def test_overrides_do_not_mutate_the_input():
    raw = {"client": {"lr": 0.1}}
    merged = apply_overrides(raw, [("client.lr", 0.2), ("seed", 3)])
    assert raw == {"client": {"lr": 0.1}} and merged == {"client": {"lr": 0.2}, "seed": 3}


# Each bad input, the key the error must name, and a phrase of the explanation.
BAD_CONFIGS = [
    (["rounds_=5"], "rounds_", "did you mean 'rounds'"),
    (["rounds=ten"], "rounds", "expected an integer, got 'ten'"),
    (["rounds=0"], "rounds", "must be >= 1"),
    (["client.lr=-0.1"], "client.lr", "must be in (0, 1e+37], got -0.1"),
    (["client.optimizer=adagrad"], "client.optimizer", "expected one of sgd, adam"),
    (["dataset.name=imagenet"], "dataset.name", "available: digits, mnist"),
    (["model.name=resnet"], "model.name", "available: cnn_briggs"),
    (["model.name=lenet_cifar"], "model.name", "cannot take digits's inputs"),
    (["strategy.name=scaffold"], "strategy.name", "unknown strategy 'scaffold'; available: cfl, dac, dac_var, ditto, fedavg"),
    (["partition.name=shards"], "partition.name", "available: iid"),
    (["partition.test_fraction=1.5"], "partition.test_fraction", "must be in (0, 1)"),
    (["strategy.treshold=3"], "strategy.treshold", "did you mean 'threshold'"),
    (["strategy.linkage=ward", "strategy.distance=cosine"], "strategy.linkage", "ward linkage needs distance l2"),
    (["strategy.num_clusters=4"], "strategy.threshold", "at most one of"),
    (["strategy.rounds_before_clustering=30"], "strategy.rounds_before_clustering", "must fall within rounds"),
    (["strategy.projection_dim=64"], "strategy.projection_dim", "l2/cosine"),
    (["partition.name=rotation", "partition.cluster_sizes=[10,10]"], "partition.cluster_sizes",
     "needs one size per entry of angles (4), got 2"),
    (["partition.num_groups=0"], "partition.num_groups", "must be >= 1"),
    (["partition.name=rotation", "partition.rotation_fill=grey"], "partition.rotation_fill",
     "expected one of normalized_zero, black"),
    (["strategy.name=oneshot_hfl", "strategy.num_clusters=4", "strategy.eigen_floor=1.5"], "strategy.eigen_floor",
     "must be in [0, 1)"),
    (["simulation.fail_fit={99: [3]}"], "simulation.fail_fit.99", "partition ids run from 0 to 19"),
    (["simulation.fail_fit={3: [2, 0]}"], "simulation.fail_fit.3", "rounds start at 1, got 0"),
    (["simulation.fail_fit={3: [2, 31]}"], "simulation.fail_fit.3", "round 31 comes after the last round (30)"),
    (["client.epochs=1.5"], "client.epochs", "expected an integer"),
    (["client=3"], "client", "expected a mapping"),
    (["partition.val_fraction=0.8"], "partition.val_fraction", "must be in [0, 1 - test_fraction) = [0, 0.8)"),
    (["strategy.name=gradloss", "strategy.lambda=2"], "strategy.lambda", "must be in [0, 1], got 2.0"),
    (["strategy.name=gradloss", "strategy.lamda=0.5"], "strategy.lamda", "did you mean 'lambda'"),
    (["strategy.name=ifca", "strategy.num_clusters=21"], "strategy.num_clusters", "cannot exceed partition.num_clients"),
    (["strategy.name=ifca", "strategy.loss_reduction=max"], "strategy.loss_reduction", "expected one of mean, sum"),
    (["strategy.name=ifca", "strategy.warmup_rounds=30"], "strategy.warmup_rounds", "must leave rounds"),
    (["strategy.name=ifca", "strategy.selection_batch=0"], "strategy.selection_batch", "must be >= 1"),
]


@pytest.mark.parametrize(("overrides", "key", "phrase"), BAD_CONFIGS, ids=[" ".join(b[0]) for b in BAD_CONFIGS])
def test_bad_config_names_the_key_and_what_was_expected(overrides, key, phrase):
    with pytest.raises(ConfigError) as info:
        load(*overrides)
    assert info.value.key == key
    assert phrase in str(info.value)


def test_key_of_an_unregistered_partitioner_option_is_an_error_not_a_note():
    # cluster_sizes is an option of rotation/label_groups/class_subsets, so for label_swap it
    # is ignored with a note -- but a key no partitioner knows is an error.
    config, notes = load("partition.alpha=0.3")
    assert any("partition.alpha ignored" in n for n in notes)
    with pytest.raises(ConfigError, match="partition.alhpa"):
        load("partition.alhpa=0.3")


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_override("rounds")
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_override("strategy..name=x")


def test_setting_inside_a_scalar_is_an_error():
    with pytest.raises(ConfigError, match="is a value"):
        load("rounds.inner=3")


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(scalar)


def test_model_is_required():
    with pytest.raises(ConfigError, match="model.name: is required"):
        build_config({"dataset": {"name": "digits"}})


USED_DIR = ROOT / "tests" / "fixtures" / "used_run_dir"  # holds a file: an earlier run's directory


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fedcluster_flwr.cli", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["run", "conf/default.yaml", "--set", "strategy.linkage=ward", "--set", "strategy.distance=l1"],
         "strategy.linkage: ward linkage needs distance l2"),
        (["run", "conf/nope.yaml"], "config: file not found"),
        (["run", "conf/default.yaml", "--set", "dataset.name=mnist", "--set", "dataset.data_dir=/nonexistent"],
         "mnist: missing train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, "
         "t10k-labels-idx1-ubyte in /nonexistent/MNIST/raw (the data folder /nonexistent does not exist)"),
        (["run", "conf/default.yaml", "--set", "partition.samples_per_client=500"],
         "partition.samples_per_client: 20 clients x 500 samples exceeds"),
        (["run", "conf/default.yaml", "--out", "USED_DIR"], "already holds files"),
        pytest.param(["run", "conf/default.yaml", "--set", "client.device=cuda"], "no CUDA GPU",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
        (["compare", "conf/default.yaml", "--strategies", ","], "--strategies: give at least one"),
        (["plot", "USED_DIR"], "no rounds.jsonl and config.yaml"),
        (["resume", "USED_DIR"], "used_run_dir/config.yaml: not found: is this a fedcluster run directory?"),
    ],
)
def test_cli_reports_user_mistakes_in_one_line_without_traceback(args, phrase):
    result = run_cli(*[a.replace("USED_DIR", str(USED_DIR)) for a in args])
    assert result.returncode == 2, result.stderr
    assert phrase in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


# ---- swapping strategies with one override ------------------------------------------------------

CONF_FILES = sorted((ROOT / "conf").glob("*.yaml"))


# The one (conf, strategy) pair `--set strategy.name=STRATEGY` refuses, and the key its one-line error
# names: the conf's 10 rounds leave no room for FL+HC's 10 rounds before clustering.
SWAPS_REFUSED = {("mnist_iid_fedavg.yaml", "flhc"): "strategy.rounds_before_clustering"}


def _strategy_names():
    from fedcluster_flwr.registry import strategies

    return list(strategies())


@pytest.mark.parametrize("strategy", _strategy_names())
@pytest.mark.parametrize("path", CONF_FILES, ids=lambda p: p.name)
def test_every_strategy_swaps_in_on_every_conf_with_one_override(path, strategy, tmp_path, monkeypatch):
    """The swapped-in strategy gets the YAML's options that mean the same for it and its own defaults
    for the rest (FL+HC, one-shot HFL and PACFL given no cut cut at the largest silhouette); or, for the
    listed pair only, one error line naming its key and the YAML's strategy."""
    from fedcluster_flwr.config.load import carries_over
    from fedcluster_flwr.declarations.schema import config_key
    from fedcluster_flwr.registry import strategies

    monkeypatch.setenv("HOME", str(tmp_path))  # the pretrained-feature conf's ResNet-18 file, faked
    weights = tmp_path / ".cache" / "torch" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    weights.parent.mkdir(parents=True)
    weights.touch()
    yaml_strategy = read_yaml(path)["strategy"]
    if (path.name, strategy) in SWAPS_REFUSED:
        with pytest.raises(ConfigError) as err:
            load_config(path, [("strategy.name", strategy)])
        assert err.value.key == SWAPS_REFUSED[path.name, strategy]
        assert "\n" not in str(err.value) and f"the YAML's strategy is {yaml_strategy['name']}" in str(err.value)
        return
    config, notes = load_config(path, [("strategy.name", strategy)])
    assert config.strategy.name == strategy
    old, new = strategies()[yaml_strategy["name"]], strategies()[strategy]
    defaults = new.Options.__dataclass_fields__
    for field in dataclasses.fields(config.strategy.options):
        key, value = config_key(field), getattr(config.strategy.options, field.name)
        if key in yaml_strategy and (old is new or carries_over(field.name, old, new)):
            expected = yaml_strategy[key]
            assert value == (tuple(expected) if isinstance(expected, list) else expected), key
        else:
            default = defaults[field.name]
            assert value == (default.default_factory() if default.default is dataclasses.MISSING else default.default), key
    dropped = [k for k in yaml_strategy if k != "name" and k not in config_to_dict(config)["strategy"]]
    assert all(k in notes[0] for k in dropped) if dropped else notes == []


def test_options_given_with_the_swap_are_kept_and_validated():
    config, notes = load("strategy.name=oneshot_hfl", "strategy.threshold=0.4")
    assert config.strategy.options.threshold == 0.4 and "threshold" in notes[0]  # the YAML's 20.0 was dropped
    config, _ = load("strategy.threshold=0.4", "strategy.name=oneshot_hfl")  # order does not matter
    assert config.strategy.options.threshold == 0.4
    with pytest.raises(ConfigError, match=r"^strategy.threshold: must be in \(0, 1\), got 20.0$"):
        load("strategy.name=oneshot_hfl", "strategy.threshold=20")  # given in the command: no hint to give it
    config, _ = load("strategy.name=oneshot_hfl", "strategy.num_clusters=4")
    assert config.strategy.options.num_clusters == 4 and config.strategy.options.linkage == "average"  # not FL+HC's complete


def test_an_option_of_another_strategy_is_an_error_with_set_but_a_note_in_the_yaml(tmp_path):
    """Typed for this run, a foreign option is a mistake; in a file shared between strategies it is not."""
    fedavg = ROOT / "conf" / "mnist_iid_fedavg.yaml"
    for override in (("strategy.threshold", 3), ("strategy", {"name": "fedavg", "threshold": 3})):
        with pytest.raises(ConfigError, match=r"^strategy\.threshold: not an option of strategy 'fedavg' \(it is one of flhc"):
            load_config(fedavg, [override], strict=True)
    raw = read_yaml(fedavg)
    raw["strategy"]["threshold"] = 3
    path = tmp_path / "shared.yaml"
    path.write_text(yaml.safe_dump(raw))
    config, notes = load_config(path)
    assert config.strategy.name == "fedavg" and notes == ["strategy.threshold ignored: not an option of strategy 'fedavg'"]
    _, notes = load_config(fedavg, [("strategy.threshold", 3)])  # not strict: overrides shared by strategies (compare)
    assert notes == ["strategy.threshold ignored: not an option of strategy 'fedavg'"]


@pytest.mark.parametrize(
    ("overrides", "key", "groups"),
    [
        (("partition.num_clients=3",), "num_groups", 4),
        (("partition.name=rotation", "partition.num_clients=2", "strategy.name=fedavg"), "angles", 4),
        (("partition.name=label_groups", "partition.num_clients=1", "strategy.name=fedavg"), "groups", 2),
        (("partition.name=class_subsets", "partition.num_clients=3", "strategy.name=fedavg"), "subsets", 4),
    ],
)
def test_fewer_clients_than_the_partitions_groups_is_a_warning_not_an_error(overrides, key, groups):
    from fedcluster_flwr.config.load import ConfigWarning

    config, notes = load(*overrides)
    clients = config.partition.num_clients
    warnings = [n for n in notes if isinstance(n, ConfigWarning)]
    assert warnings == [f"partition.num_clients ({clients}) is below the {groups} groups of partition.{key}: "
                        f"{groups - clients} group(s) get no client; set partition.num_clients to at least {groups} "
                        "to have them all"]
    _, notes = load(*[o for o in overrides if not o.startswith("partition.num_clients")], f"partition.num_clients={groups}")
    assert not [n for n in notes if isinstance(n, ConfigWarning)]


def test_a_name_in_another_case_or_misspelt_gets_a_did_you_mean():
    from fedcluster_flwr.declarations.schema import closest_name

    choices = ["digits", "mnist", "fashion_mnist", "cifar10"]
    assert closest_name("MNIST", choices) == "mnist"
    assert closest_name("Cifar10", choices) == "cifar10"
    assert closest_name("minst", choices) == "mnist"
    assert closest_name("svhn", choices) is None
    with pytest.raises(ConfigError, match=r"^strategy\.name: unknown strategy 'FedAvg' \(did you mean 'fedavg'\?\)"):
        load("strategy.name=FedAvg")


def test_a_folder_given_as_the_config_file_is_named_as_a_folder(tmp_path):
    with pytest.raises(ConfigError, match=rf"^config: {tmp_path} is a folder, not a config file: give a YAML file$"):
        load_config(tmp_path)
    (tmp_path / "mine.yaml").write_text("rounds: 3\n")
    with pytest.raises(ConfigError, match=rf"give a YAML file in it, e.g. {tmp_path / 'mine.yaml'}$"):
        load_config(tmp_path)


def test_an_empty_config_file_is_named_as_empty_not_as_its_first_missing_key(tmp_path):
    (tmp_path / "c.yaml").write_text("# to fill in\n\n")
    with pytest.raises(ConfigError, match=rf"^config: {tmp_path / 'c.yaml'} is empty \(no keys, or only comments\)"):
        load_config(tmp_path / "c.yaml")


def test_a_share_of_few_test_examples_warns_and_one_of_none_is_refused_naming_the_share():
    """Below 10 test (validation) examples a client's accuracy moves in coarse steps: a warning, since
    10 is a judgement call; a share that rounds to no example at all (it was raised to one without
    a word) is refused when the partition is made, naming the option and the count."""
    import numpy as np

    from fedcluster_flwr.config.load import ConfigWarning
    from fedcluster_flwr.data.partition_options import IidOptions
    from fedcluster_flwr.data.partitions import make_partition

    _, notes = load("partition.test_fraction=0.05", "partition.val_fraction=0.15")  # 13 validation examples
    assert notes == [ConfigWarning("partition.test_fraction 0.05 leaves a client about 4 test examples (of ~89 samples): its "
                                   "accuracy moves in steps of 25 points; 10 need partition.test_fraction >= 0.11")]
    assert isinstance(notes[0], ConfigWarning) and load("partition.test_fraction=0.12")[1] == []
    labels = np.repeat(np.arange(10), 20)  # 200 samples, 50 a client
    split = dict(labels=labels, num_classes=10, num_clients=4, samples_per_client=None, seed=0)
    with pytest.raises(ConfigError, match=r"^partition.test_fraction: 0.001 gives client 0 0 test examples of its 50 "
                                          r"samples \(0.05, rounded\); .* \(at least 0.02\)"):
        make_partition("iid", IidOptions(), test_fraction=0.001, **split)
    with pytest.raises(ConfigError, match=r"^partition.val_fraction: 0.005 gives client 0 0 validation examples of its 40 "
                                          r"training samples"):
        make_partition("iid", IidOptions(), test_fraction=0.2, val_fraction=0.005, **split)
    made = make_partition("iid", IidOptions(), test_fraction=0.02, val_fraction=0.02, **split)  # one of each
    assert {len(t) for t in made.test_indices} == {1} and {len(v) for v in made.val_indices} == {1}

