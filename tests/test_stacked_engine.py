"""The stacked step, checked where no GPU is: on the ``meta`` device (any host tensor entering a
step fails there), under a dispatch audit (host-to-device copies and host reads do not grow with
the number of steps), with torch's fused optimizer fed gradients of another layout (the stride
trap), with an engine error injected (the run stops, no client is blamed) and out of memory
(the stack is split and retried), and with a module hook (honoured: such a model trains alone)."""

from __future__ import annotations

import copy
from dataclasses import asdict, replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import DEFAULT_CONFIG
from fedcluster_flwr.config.load import load_config, parse_override
from fedcluster_flwr.engines import batched as batched_module
from fedcluster_flwr.engines import stacked
from fedcluster_flwr.engines.batched import BatchPolicy, EngineError, Request, execute
from fedcluster_flwr.apps.server_app import run_in_process
from fedcluster_flwr.engines.stacked import (
    ClientBatchData, StackedOptimizer, evaluation_sums, stack_parameters, train_stacked, train_steps,
)
from fedcluster_flwr.models import MODELS, build_model
from fedcluster_flwr.declarations.schema import ConfigError
from fedcluster_flwr.algorithms.fedprox.math import ProximalTerm
from fedcluster_flwr.training import PLAIN, Objective, TrainSettings, evaluate, train

META = torch.device("meta")
CPU = torch.device("cpu")
ADAM = TrainSettings(epochs=1, batch_size=4, lr=0.01, optimizer="adam", momentum=0.0, weight_decay=1e-3)


def clients(sizes, shape=(1, 28, 28), seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [ClientBatchData(torch.randn(n, *shape, generator=generator), torch.randint(0, 10, (n,), generator=generator))
            for n in sizes]


def models(name, count, shape=(1, 28, 28), seed=0):
    torch.manual_seed(seed)
    return [build_model(name, shape, 10) for _ in range(count)]


@pytest.mark.parametrize("name", ["cnn_zec_fmnist", "mlp_fmnist"])
def test_stacked_training_and_evaluation_run_on_the_meta_device_from_models_on_the_cpu(name):
    # The models stay on the CPU (as the clients build them); every tensor of a step must be on the
    # device: on "meta" a CPU tensor in an operation raises ("Tensor on device cpu is not on the
    # expected device meta"), as the first version of this engine did on a GPU.
    group = models(name, 3)
    data = clients([9, 9, 5])  # unequal: masked rows and a second batch size take part too
    params = stack_parameters(group, META)
    losses = train_steps(group[0], params, data, ADAM, [torch.Generator().manual_seed(k) for k in range(3)], META)
    assert losses.device.type == "meta" and losses.shape == (3,)
    assert all(p.device.type == "meta" for p in params.values())
    loss_sums, correct = evaluation_sums(group[0], params, data, META)
    assert loss_sums.device.type == "meta" and correct.shape == (3,)
    assert all(p.device.type == "cpu" for m in group for p in m.parameters())


class Audit(TorchDispatchMode):
    """Counts what a GPU would wait for: copies from the host onto the device, and host reads."""

    def __init__(self) -> None:
        super().__init__()
        self.to_device = 0
        self.host_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.__name__
        if name.startswith("_local_scalar_dense"):
            self.host_reads += 1
        if name.startswith(("_to_copy", "copy_")):
            source = args[1] if name.startswith("copy_") else args[0]
            target = out if not name.startswith("copy_") else args[0]
            if isinstance(source, torch.Tensor) and source.device.type == "cpu" and target.device.type == "meta":
                self.to_device += 1
        return out


def audited_training(epochs: int, anchored: bool = False) -> Audit:
    """``anchored``: Ditto's pull towards a model each client was sent (the anchor "global")."""
    group = models("cnn_zec_fmnist", 3)
    data = clients([12, 12, 7])
    settings = TrainSettings(epochs=epochs, batch_size=4, lr=0.01, optimizer="adam", momentum=0.0, weight_decay=0.0)
    params = stack_parameters(group, META)
    objective, anchors = PLAIN, ()
    if anchored:
        objective = Objective(terms=(ProximalTerm(0.1, anchor="global"),))
        anchors = [{"global": [v.numpy() for v in m.state_dict().values()]} for m in models("cnn_zec_fmnist", 3, seed=1)]
    stacked.RESIDENT = stacked.ResidentData()  # a fresh cache: the data's first crossing is counted
    with Audit() as audit:
        train_steps(group[0], params, data, settings, [torch.Generator().manual_seed(k) for k in range(3)], META,
                    objective, anchors)
    return audit


def test_the_step_loop_copies_to_the_device_and_reads_the_host_a_fixed_number_of_times():
    one, four = audited_training(1), audited_training(4)  # 3 steps vs 12 steps
    assert one.host_reads == four.host_reads == 0
    assert one.to_device == four.to_device  # whatever the number of steps:
    assert one.to_device == 3 + 2 * 3  # the indices, the step counts and numbers, and each client's x and y once


def test_an_anchored_objective_moves_its_anchors_to_the_device_once_before_the_step_loop():
    plain, one, four = audited_training(1), audited_training(1, anchored=True), audited_training(4, anchored=True)
    assert one.host_reads == four.host_reads == 0
    assert one.to_device == four.to_device  # however many steps
    parameters = len(list(models("cnn_zec_fmnist", 1)[0].parameters()))
    assert one.to_device == plain.to_device + parameters  # each parameter's stacked anchors, once


def test_client_data_crosses_to_the_device_once_per_run():
    data = clients([6, 6])
    stacked.RESIDENT = stacked.ResidentData()
    group = models("mlp_fmnist", 2)
    params = stack_parameters(group, META)
    with Audit() as first:
        evaluation_sums(group[0], params, data, META)
    with Audit() as second:
        evaluation_sums(group[0], params, data, META)
    assert second.to_device < first.to_device  # the samples are resident; only the mask is built anew


@pytest.mark.parametrize("layout", [torch.channels_last, torch.contiguous_format])
def test_fused_adam_over_stacked_parameters_is_torchs_adam_whatever_the_gradients_layout(layout):
    torch.manual_seed(3)
    weight = torch.randn(2, 4, 3, 3, 3)  # two clients' conv weights
    grads = [torch.randn_like(weight) for _ in range(3)]
    params = {"w": weight.clone()}
    optimizer = StackedOptimizer(params, ADAM, ["w"])
    for step, grad in enumerate(grads):
        # a gradient laid out as channels-last although the weight is contiguous: the trap
        shaped = grad.flatten(0, 1).contiguous(memory_format=torch.channels_last).view_as(grad) if layout is torch.channels_last else grad
        assert shaped.is_contiguous() == (layout is torch.contiguous_format)
        optimizer.update(params, [shaped], torch.tensor(float(step)), None)
    for k in range(2):
        alone = torch.nn.Parameter(weight[k].clone())
        reference = torch.optim.Adam([alone], lr=ADAM.lr, weight_decay=ADAM.weight_decay)
        for grad in grads:
            alone.grad = grad[k].clone()
            reference.step()
        torch.testing.assert_close(params["w"][k], alone.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_models_stacked_forward_is_its_forward_per_client(name):
    shape = (1, 8, 8) if "digits" in name else (3, 32, 32) if "cifar" in name else (1, 28, 28)
    group = models(name, 3, shape)
    x = torch.randn(3, 5, *shape)
    params = stack_parameters(group, CPU)
    got = stacked.stacked_forward(group[0])(params, x)
    expected = torch.stack([m(x[k]) for k, m in enumerate(group)])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def requests_for(group, data, settings=ADAM):
    return [Request("train", k, m, d.x, d.y, CPU, settings, torch.Generator().manual_seed(k))
            for k, (m, d) in enumerate(zip(group, data))]


def test_a_stack_out_of_memory_is_split_and_retried_until_it_fits(monkeypatch):
    group, data = models("mlp_fmnist", 4), clients([8, 8, 8, 8])
    expected = copy.deepcopy(group)
    real = stacked.train_stacked
    sizes = []

    def tight(models_, *args, **kwargs):
        sizes.append(len(models_))
        if len(models_) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(models_, *args, **kwargs)

    monkeypatch.setattr(batched_module, "train_stacked", tight)
    requests = requests_for(group, data)
    execute(requests, BatchPolicy(stack_on_cpu=True, memory_bytes=2**40))
    assert sizes == [4, 2, 1, 1, 2, 1, 1]  # halves, then quarters
    for request, model, d in zip(requests, expected, data):
        assert request.error is None
        loss = train(model, d.x, d.y, ADAM, torch.Generator().manual_seed(request.pid), CPU)
        assert request.result == pytest.approx(loss, rel=1e-5)  # each retry starts from the same batches


def test_any_other_error_in_stacked_work_is_the_engines_and_stops_the_run(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the stacked step (injected)")

    monkeypatch.setattr(batched_module, "train_stacked", broken)
    monkeypatch.setattr(batched_module, "CPU_UNSTACKED_MODELS", frozenset())
    config, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in ("rounds=2", "strategy.name=fedavg", "simulation.engine=batched")])
    with pytest.raises(EngineError, match="injected"):
        run_in_process(config, tmp_path / "run")
    rows = (tmp_path / "run" / "rounds.jsonl")
    assert not rows.exists() or rows.read_text() == ""  # no round was recorded with its clients as failures


def test_a_hooked_model_is_trained_alone_with_its_hook_honoured(caplog):
    group, data = models("mlp_fmnist", 3), clients([8, 8, 8])
    calls = []
    group[1].fc[0].register_forward_hook(lambda module, inputs, output: calls.append(1))
    policy = BatchPolicy(stack_on_cpu=True, memory_bytes=2**40)
    assert policy.stacks(requests_for(group, data)[0]) is True
    assert policy.stacks(requests_for(group, data)[1]) is False
    assert any("has a hook" in r.message for r in caplog.records)
    hooked = requests_for(group, data)
    execute(hooked, policy)
    assert len(calls) == 2  # two steps of batch 4: the hook ran at each, it was not dropped
    assert all(r.error is None for r in hooked)


def test_stacked_evaluation_on_the_cpu_is_each_clients_own_evaluation():
    group, data = models("cnn_zec_fmnist", 5), clients([30, 30, 12, 30, 1])
    got = batched_module.evaluate_stacked(group, data, CPU)
    expected = [evaluate(m, d.x, d.y, CPU) for m, d in zip(group, data)]
    np.testing.assert_allclose(got, expected, rtol=1e-5)


# ---- edges the mutation run found untested (docs/development.md, "Mutation testing") -----------

SGD = TrainSettings(epochs=2, batch_size=4, lr=0.1, optimizer="sgd", momentum=0.0, weight_decay=0.0)


def plain_models(count, seed=0):
    """Models without a ``forward_stacked``: the stacked step vmaps their own forward."""
    torch.manual_seed(seed)
    return [torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3)) for _ in range(count)]


def plain_clients(sizes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [ClientBatchData(torch.randn(n, 4, generator=generator), torch.randint(0, 3, (n,), generator=generator))
            for n in sizes]


@pytest.mark.parametrize("settings", [SGD, replace(SGD, weight_decay=1.0), replace(SGD, momentum=0.5)],
                         ids=["sgd", "weight_decay_1", "momentum"])
def test_a_model_without_forward_stacked_trains_and_evaluates_stacked_as_each_client_alone(settings):
    """vmap of the model's own forward; unequal clients (masked rows); weight decay at 1, the
    declared bound's edge where a test of ``!= 0`` and one of ``!= 1`` part."""
    sizes = [9, 4, 6]
    alone, together, data = plain_models(3), plain_models(3), plain_clients(sizes)
    assert stacked.stacked_forward(together[0]) is not None and not hasattr(together[0], "forward_stacked")
    expected = [train(m, d.x, d.y, settings, torch.Generator().manual_seed(k), CPU) for k, (m, d) in enumerate(zip(alone, data))]
    got = train_stacked(together, data, settings, [torch.Generator().manual_seed(k) for k in range(3)], CPU)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    for a, b in zip(alone, together):
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    evaluated = stacked.evaluate_stacked(together, data, CPU)
    np.testing.assert_allclose(evaluated, [evaluate(m, d.x, d.y, CPU) for m, d in zip(alone, data)], rtol=1e-5)


def test_an_architecture_with_forward_stacked_uses_it():
    model = models("mlp_fmnist", 1)[0]
    assert stacked.stacked_forward(model) == model.forward_stacked


def test_architectures_of_other_classes_are_never_stacked_together():
    class Other(torch.nn.Sequential):
        pass

    first, second = plain_models(2)
    other = Other(*plain_models(1)[0])
    assert stacked.architecture_key(first) == stacked.architecture_key(second)
    assert stacked.architecture_key(other) != stacked.architecture_key(first)


def test_one_client_evaluates_stacked_and_a_single_right_prediction_is_accuracy_1():
    model = plain_models(1)[0]
    x = torch.randn(1, 4, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        y = model(x).argmax(dim=1)
    [(loss, accuracy)] = stacked.evaluate_stacked([model], [ClientBatchData(x, y)], CPU)
    assert accuracy == 1.0 and loss == pytest.approx(evaluate(model, x, y, CPU)[0], rel=1e-6)


def test_clients_without_samples_take_no_step_and_report_nan():
    group = plain_models(2)
    before = [p.detach().clone() for p in group[0].parameters()]
    losses = train_stacked(group, plain_clients([0, 0]), SGD, [torch.Generator().manual_seed(k) for k in range(2)], CPU)
    assert all(np.isnan(losses))
    assert all(torch.equal(p, q) for p, q in zip(group[0].parameters(), before))


def test_the_stacked_optimizer_names_the_optimizers_it_knows():
    params = stack_parameters(plain_models(2), CPU)
    with pytest.raises(ConfigError, match=r"^optimizer: expected one of sgd, adam; got 'rmsprop'"):
        replace(SGD, optimizer="rmsprop")  # the settings type refuses it first, wherever it is made
    unchecked = SimpleNamespace(**(asdict(SGD) | {"optimizer": "rmsprop"}))  # settings that skip the declarations
    with pytest.raises(ValueError, match=r"knows the optimizers \('sgd', 'adam'\), not 'rmsprop'"):
        StackedOptimizer(params, unchecked, list(params))


def test_resident_copies_are_kept_up_to_the_byte_limit_and_freed_with_their_tensors():
    resident = stacked.ResidentData(limit_bytes=60)
    big, small = torch.ones(10), torch.ones(5)  # 40 and 20 bytes
    big_copy = resident.on(big, META)
    assert resident.on(big, META) is big_copy  # kept
    small_copy = resident.on(small, META)
    assert resident.on(small, META) is small_copy  # kept: 60 bytes, exactly the limit
    third = torch.ones(10)
    assert resident.on(third, META) is not resident.on(third, META)  # past the limit: copied each time
    del big, big_copy  # the tensor's copy goes with it: 20 bytes held
    fourth = torch.ones(10)
    assert resident.on(fourth, META) is resident.on(fourth, META)  # 20 + 40 fit again
    fifth = torch.ones(1)
    assert resident.on(fifth, META) is not resident.on(fifth, META)  # full again


def test_every_kind_of_hook_keeps_a_model_off_the_stacked_step():
    def hooked(register):
        model = plain_models(1)[0]
        register(model)
        return stacked.why_not_stackable(model)

    assert stacked.why_not_stackable(plain_models(1)[0]) is None
    buffered = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    assert stacked.why_not_stackable(buffered) == "models with buffers (e.g. BatchNorm) train one client at a time"
    nested = "module '2' has a hook: its model trains one client at a time"
    assert hooked(lambda m: m[2].register_full_backward_pre_hook(lambda *a: None)) == nested
    assert hooked(lambda m: m.register_forward_hook(lambda *a: None)) == (
        "module 'Sequential' has a hook: its model trains one client at a time")
    on_parameter = "parameter '0.weight' has a hook: its model trains one client at a time"
    assert hooked(lambda m: m[0].weight.register_hook(lambda g: g)) == on_parameter
    assert hooked(lambda m: m[0].weight.register_post_accumulate_grad_hook(lambda p: None)) == on_parameter
    handle = torch.nn.modules.module.register_module_full_backward_pre_hook(lambda *a: None)
    try:
        assert stacked.why_not_stackable(plain_models(1)[0]) == (
            "a global module hook is registered: models train one client at a time")
    finally:
        handle.remove()


@pytest.mark.parametrize(("clients_", "workers", "fits", "sizes"), [
    (100, 1, 10**6, [100]),        # the DAC table's one worker: one stack
    (100, 2, 10**6, [50, 50]),
    (13, 4, 10**6, [4, 3, 3, 3]),  # was [4, 4, 4, 1]: a client alone in its stack
    (10, 3, 10**6, [4, 3, 3]),
    (9, 1, 4, [3, 3, 3]),          # the memory budget fits 4 a stack
    (100, 1, 30, [25, 25, 25, 25]),  # was [30, 30, 30, 10]
    (5, 1, 1, [1, 1, 1, 1, 1]),
])
def test_stacks_are_cut_evenly_within_the_budget(clients_, workers, fits, sizes):
    """Consecutive stacks in partition-id order, sizes one apart at most, none above what fits."""
    group, data = models("mlp_fmnist", 1) * clients_, clients([8] * clients_)
    requests = requests_for(group, data)
    budget = fits * BatchPolicy.client_bytes(requests[0], 8)
    chunks = BatchPolicy(stack_on_cpu=True, memory_bytes=budget, workers=workers).chunks(requests, 8)
    assert [len(c) for c in chunks] == sizes
    assert [r.pid for c in chunks for r in c] == list(range(clients_))
