"""The declared-constraint machinery of the config schema, on small dataclasses of its own."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Literal

import pytest

from fedcluster_flwr.declarations.options import check_in_experiment, from_mapping
from fedcluster_flwr.declarations.schema import (
    REQUIRED,
    AtMostOne,
    ConfigError,
    ExactlyOne,
    InRegistry,
    Interval,
    Is,
    IsNot,
    LessThan,
    NoMoreThan,
    OnlyWith,
    RequiredWith,
    above,
    at_least,
    option,
)


@dataclass(frozen=True)
class Sampling:
    client_fraction: float = option(0.1, Interval(0, 1, closed="right"))
    lambda_: float = option(0.2, Interval(0, 1), key="lambda")
    batch: int | None = option(None, at_least(1), note="null: all samples")
    noise: float = option(0.01, above(0))


@dataclass(frozen=True)
class Clustering:
    threshold: float | None = option(None, above(0))
    num_clusters: int | None = option(None, at_least(1))
    linkage: Literal["single", "ward"] = "single"
    distance: Literal["l1", "l2"] = "l1"
    projection_dim: int | None = None
    num_kept: int = 2
    num_neighbours: int = 5
    warmup_rounds: int = 0

    rules = (
        ExactlyOne("threshold", "num_clusters"),
        OnlyWith(Is("linkage", "ward"), Is("distance", "l2")),
        OnlyWith("projection_dim", IsNot("distance", "l1"), message="remove it for distance {distance}"),
        RequiredWith("projection_dim", Is("linkage", "ward")),
        NoMoreThan("num_kept", "num_neighbours"),
    )
    experiment_rules = (
        NoMoreThan("num_clusters", "partition.num_clients"),
        LessThan("warmup_rounds", "rounds", why="warm-up must leave rounds for clustering"),
    )


@dataclass(frozen=True)
class WithPrefetch(Clustering):
    prefetch: int = 0

    rules = (NoMoreThan("prefetch", "num_neighbours"),)


@dataclass(frozen=True)
class Outer:
    name: str = option(REQUIRED, InRegistry({"a": 1, "b": 2}, "thing", retired={"old": "was renamed 'a'"}))
    sampling: Sampling = Sampling()


def error(cls, data, prefix="section"):
    with pytest.raises(ConfigError) as info:
        from_mapping(cls, data, prefix)
    return info.value


@pytest.mark.parametrize(("data", "key", "message"), [
    ({"client_fraction": 0}, "section.client_fraction", "must be in (0, 1], got 0.0"),
    ({"client_fraction": 1.5}, "section.client_fraction", "must be in (0, 1], got 1.5"),
    ({"client_fraction": float("nan")}, "section.client_fraction", "must be in (0, 1], got nan"),
    ({"lambda": -0.5}, "section.lambda", "must be in [0, 1], got -0.5"),
    ({"batch": 0}, "section.batch", "must be >= 1, got 0 (null: all samples)"),
    ({"noise": 0}, "section.noise", "must be > 0, got 0.0"),
])
def test_a_range_violation_names_the_key_the_bound_and_the_value(data, key, message):
    err = error(Sampling, data)
    assert err.key == key and str(err) == f"{key}: {message}"


def test_values_inside_the_range_and_null_where_allowed_pass():
    built = from_mapping(Sampling, {"client_fraction": 1, "lambda": 0, "batch": None}, "section")
    assert (built.client_fraction, built.lambda_, built.batch) == (1.0, 0.0, None)


def test_intervals_read_as_written():
    assert [str(i) for i in (Interval(0, 1, closed="right"), Interval(0, 1, closed="neither"), at_least(2),
                             above(0), Interval(None, 3, closed="right"))] == [
        "in (0, 1]", "in (0, 1)", ">= 2", "> 0", "<= 3"]
    with pytest.raises(ValueError, match="empty interval"):
        Interval(1, 0)
    with pytest.raises(ValueError, match="closed must be"):
        Interval(0, 1, closed="open")


def test_an_exactly_one_violation_names_the_first_key_and_what_was_given():
    assert str(error(Clustering, {})) == (
        "section.threshold: give exactly one of section.threshold and section.num_clusters; got neither")
    assert str(error(Clustering, {"threshold": 2.0, "num_clusters": 3})) == (
        "section.threshold: give exactly one of section.threshold and section.num_clusters; "
        "got threshold 2.0 and num_clusters 3")


@dataclass(frozen=True)
class Cut:
    threshold: float | None = None
    num_clusters: int | None = None


def test_at_most_one_allows_neither_and_refuses_both():
    cut = AtMostOne("threshold", "num_clusters")
    cut.check(Cut(), "section", None)
    cut.check(Cut(num_clusters=3), "section", None)
    with pytest.raises(ConfigError) as err:
        cut.check(Cut(threshold=2.0, num_clusters=3), "section", None)
    assert (err.value.key, str(err.value)) == ("section.threshold", "section.threshold: give at most one of "
                                                "section.threshold and section.num_clusters; got threshold 2.0 and num_clusters 3")


def test_an_only_with_violation_names_the_subject_and_the_condition():
    err = error(Clustering, {"threshold": 1.0, "linkage": "ward", "projection_dim": 8})
    assert err.key == "section.linkage"
    assert str(err) == "section.linkage: only distance l2 takes linkage ward (distance is l1)"
    err = error(Clustering, {"threshold": 1.0, "projection_dim": 8})
    assert str(err) == "section.projection_dim: remove it for distance l1"  # the declared wording


def test_a_required_with_violation_names_the_missing_key():
    err = error(Clustering, {"threshold": 1.0, "linkage": "ward", "distance": "l2"})
    assert str(err) == "section.projection_dim: linkage ward needs projection_dim"


def test_a_field_bounded_by_another_field():
    err = error(Clustering, {"threshold": 1.0, "num_kept": 6})
    assert str(err) == "section.num_kept: cannot exceed num_neighbours (5); got 6"


def test_a_subclass_obeys_its_bases_rules_and_its_own():
    assert error(WithPrefetch, {}).key == "section.threshold"
    assert str(error(WithPrefetch, {"threshold": 1.0, "prefetch": 9})) == (
        "section.prefetch: cannot exceed num_neighbours (5); got 9")


def test_field_constraints_come_before_the_rules():
    # num_clusters 0 breaks its range and, with a threshold, the one-of: the range is reported
    assert error(Clustering, {"threshold": 1.0, "num_clusters": 0}).key == "section.num_clusters"


def test_a_declared_constraint_names_the_nested_key():
    err = error(Outer, {"name": "a", "sampling": {"client_fraction": 2}}, "top")
    assert err.key == "top.sampling.client_fraction"
    assert str(err) == "top.sampling.client_fraction: must be in (0, 1], got 2.0"


def test_registry_names_and_retired_names():
    assert str(error(Outer, {"name": "c"}, "")) == "name: unknown thing 'c'; available: a, b"
    assert str(error(Outer, {"name": "old"}, "")) == "name: 'old' was renamed 'a'"
    assert str(error(Outer, {}, "")) == "name: is required"


def test_experiment_rules_read_other_sections_and_use_the_given_prefix():
    options = from_mapping(Clustering, {"num_clusters": 4, "warmup_rounds": 3}, "elsewhere")
    experiment = SimpleNamespace(rounds=10, partition=SimpleNamespace(num_clients=4))
    check_in_experiment(options, experiment, "elsewhere")  # 4 clusters of 4 clients, 3 < 10 rounds
    with pytest.raises(ConfigError) as info:
        check_in_experiment(options, SimpleNamespace(rounds=10, partition=SimpleNamespace(num_clients=3)), "elsewhere")
    assert str(info.value) == "elsewhere.num_clusters: cannot exceed partition.num_clients (3); got 4"
    with pytest.raises(ConfigError) as info:
        check_in_experiment(options, SimpleNamespace(rounds=3, partition=SimpleNamespace(num_clients=4)), "x")
    assert str(info.value) == "x.warmup_rounds: must be below rounds (3): warm-up must leave rounds for clustering; got 3"
