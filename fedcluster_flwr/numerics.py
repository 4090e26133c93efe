"""Which floating-point code paths this process runs on.

A seed fixes a CPU run bit for bit *on one platform*: torch picks its vectorised kernels by the
CPU's instruction set (``torch.backends.cpu.get_cpu_capability()``: AVX2, AVX512, ...), and MKL
and oneDNN pick theirs by instruction set, vendor and CPU model. Two platforms that pick
different kernels add the same numbers in another order, so trajectories agree to about 1e-8
relative after a few rounds, not bit for bit (see docs/reference/reproducibility.md).

:func:`numeric_platform` names what decides those choices, so a recorded trajectory can say
where it was recorded and a comparison can say whether bit-equality is to be expected.
:func:`pin_portable_numerics` (``simulation.portable_numerics``) makes every x86-64 CPU with AVX2
pick the same kernels: torch's AVX2 ones, MKL's vendor-neutral ``COMPATIBLE`` branch (its AVX2
branch still differs between Intel and AMD), oneDNN capped to AVX2, one thread.
"""

from __future__ import annotations

import os
import platform
import re
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .declarations.schema import ConfigError
from .training import use_deterministic_kernels

if TYPE_CHECKING:
    from .config.sections import ExperimentConfig

# Environment variables that steer the CPU kernels' choice; recorded so a comparison can see them.
NUMERIC_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
# The pins of simulation.portable_numerics. Measured: a native AVX-512 Intel Xeon and an emulated
# AVX2 AMD EPYC-Rome (qemu) give bit-identical trajectories with these, not with MKL_CBWR=AVX2.
PORTABLE_NUMERICS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2"}
CAPABILITIES_WITHIN_AVX2 = ("AVX2", "DEFAULT", "NO AVX")  # what torch reports once capped (or on older CPUs)


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``count`` inside, restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def pin_portable_numerics() -> None:
    """Pin this process's CPU kernels to the ones every x86-64 CPU with AVX2 runs alike, and one
    torch thread. Must run before the process's first torch operation (torch, MKL and oneDNN read
    their settings once); raises ValueError if the environment sets another value or if torch has
    already chosen wider kernels."""
    for name, value in PORTABLE_NUMERICS.items():
        if (current := os.environ.get(name, value)) != value:
            raise ValueError(f"portable numerics set {name}={value}, but the environment sets {name}={current}")
    os.environ.update(PORTABLE_NUMERICS)
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in CAPABILITIES_WITHIN_AVX2:
        raise ValueError(
            f"this process already runs torch's {capability} kernels (it computed before the pin); "
            f"start it with {' '.join(f'{k}={v}' for k, v in PORTABLE_NUMERICS.items())} in the environment"
        )
    torch.set_num_threads(1)


def is_portable(p: dict[str, str]) -> bool:
    return all(p.get(name.lower()) == value for name, value in PORTABLE_NUMERICS.items())


@lru_cache(maxsize=1)
def cpu_identity() -> tuple[str, str]:
    """The CPU's vendor and model name (from ``/proc/cpuinfo``; ``platform.processor()`` elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "", platform.processor()
    fields = dict(re.findall(r"^(vendor_id|model name)\s*:\s*(.*)$", text, flags=re.MULTILINE))
    return fields.get("vendor_id", ""), fields.get("model name", platform.processor())


def blas() -> str:
    """torch's BLAS as its build reports it (e.g. ``mkl``, ``open``)."""
    match = re.search(r"BLAS_INFO=([^,\s]+)", torch.__config__.show())
    return match[1] if match else "unknown"


def numeric_platform() -> dict[str, str]:
    """What selects this process's CPU kernels: two runs of one seed are bit-identical where these
    are equal (``cpu_model`` is informative; the others must match).

    Reading the capability fixes it for the process (torch computes it once), so call this after
    any environment setting meant to change it.
    """
    vendor, model = cpu_identity()
    return {
        "machine": platform.machine(),
        "cpu_vendor": vendor,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "blas": blas(),
        **{name.lower(): os.environ.get(name, "") for name in NUMERIC_ENV},
        "cpu_model": model,
    }


INFORMATIVE_KEYS = ("cpu_model",)


def same_numeric_platform(a: dict[str, str], b: dict[str, str]) -> bool:
    """Whether runs on ``a`` and ``b`` pick the same kernels: everything but the CPU model matches,
    or, with portable numerics on both, everything but the CPU's vendor and model."""
    ignored = set(INFORMATIVE_KEYS) | ({"cpu_vendor"} if is_portable(a) and is_portable(b) else set())
    return all(a.get(k) == b.get(k) for k in (set(a) | set(b)) - ignored)


def describe_platform(p: dict[str, str]) -> str:
    pins = ", ".join(f"{name}={p[name.lower()]}" for name in NUMERIC_ENV if p.get(name.lower()))
    return (
        f"{p.get('cpu_model') or p.get('cpu_vendor') or 'unknown CPU'} ({p.get('machine')}), torch {p.get('torch')} "
        f"capability {p.get('cpu_capability')}, BLAS {p.get('blas')}" + (f", {pins}" if pins else "")
    )


def use_configured_numerics(config: ExperimentConfig) -> None:
    """``simulation.portable_numerics``: pin this process's CPU kernels before its first torch op."""
    if config.simulation.portable_numerics:
        try:
            pin_portable_numerics()
        except ValueError as err:
            raise ConfigError("simulation.portable_numerics", str(err)) from None


def configure_torch(config: ExperimentConfig, clients_here: bool = True) -> None:
    """Set up this process's torch as ``config`` asks, or refuse what this machine cannot honour:
    ``simulation.portable_numerics``, ``client.device`` and ``simulation.deterministic``.

    The switches are per process, so each process calls it: ``Experiment.client`` in every client's
    (under ``flwr run`` the first to read the config), and ``fedcluster run`` in its driver before
    Ray starts, so that a mistake is one error line before any worker and the workers inherit the
    environment pins (the driver's own torch work then follows the clients' rules, as it does when
    the in-process driver builds the clients). ``clients_here`` False: the clients run on other
    machines (a Ray cluster's), whose GPUs this one cannot see; each client checks its own.
    """
    use_configured_numerics(config)  # first: the pins must precede this process's first torch operation
    if config.client.device == "cuda" and clients_here and not torch.cuda.is_available():
        raise ConfigError("client.device", "is 'cuda' but this machine has no CUDA GPU; use 'auto' or 'cpu'")
    if config.simulation.deterministic:
        try:
            use_deterministic_kernels()
        except ValueError as err:
            raise ConfigError("simulation.deterministic", str(err)) from None


def configure_driver_torch(config: ExperimentConfig) -> None:
    """:func:`configure_torch` in ``fedcluster run``'s own processes (before Ray starts, and in the
    simulation's process): the clients run on this machine unless ``simulation.ray_address`` joins
    a cluster, whose machines check their own GPUs."""
    configure_torch(config, clients_here=config.simulation.ray_address is None)


def client_device(config: ExperimentConfig) -> torch.device:
    """Where the clients train: ``client.device``, ``auto`` meaning the GPU where there is one."""
    device = config.client.device
    return torch.device("cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu")
