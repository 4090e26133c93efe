"""Reading a CIFAR-10 python batch without running anything the file asks for.

A batch (``data_batch_1`` .. ``data_batch_5``, ``test_batch``) is a pickle of one dict:
``data``, a uint8 array of N x 3072 (the red, green and blue 32x32 planes of each image);
``labels``, N integers in 0..9; ``batch_label`` and ``filenames``, strings. The official batches
are Python 2 pickles (protocol 2) that hold the array as numpy pickles one: the call
``numpy.core.multiarray._reconstruct(numpy.ndarray, (0,), b'b')`` and then its state (version,
shape, ``numpy.dtype('u1', 0, 1)`` with its state, raw bytes) applied by ``BUILD``. Copies
re-pickled by Python 3 name ``numpy._core.multiarray`` instead, and at protocol 2 carry the raw
bytes as ``_codecs.encode(text, 'latin1')``; at protocol 5, ``numpy._core.numeric._frombuffer``.

``pickle.load`` imports and calls whatever function a file names (``os.system`` included), before
the loader can say the file is not a batch; :func:`load_batch` resolves exactly the names above,
each to a function that builds only what the format holds (an empty plain ndarray, a dtype
without Python objects, an array over the file's own bytes, latin-1 bytes), and refuses any other
name unrun: dicts, lists, tuples, strings, bytes and numbers need no function at all.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np

# numpy's own pickling functions, as numpy hands them out (their module moved in numpy 2).
_NUMPY_RECONSTRUCT = np.zeros(1).__reduce__()[0]
_NUMPY_SCALAR = np.uint8(0).__reduce__()[0]
_NUMPY_FROMBUFFER = np.zeros(1).__reduce_ex__(5)[0]


class RefusedPickle(pickle.UnpicklingError):
    """The pickle asks for a function or class that a CIFAR-10 batch never holds."""

    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(f"it asks for {what}, which a CIFAR-10 batch never holds")


class _NdarrayClass:
    """What ``numpy.ndarray`` resolves to: an argument of ``_reconstruct`` only, never called."""

    def __call__(self, *args: Any) -> None:
        raise RefusedPickle("numpy.ndarray(...) called directly")


_NDARRAY = _NdarrayClass()


def _plain_dtype(dtype: Any) -> np.dtype:
    if not isinstance(dtype, np.dtype) or dtype.hasobject:
        raise RefusedPickle(f"an array of dtype {dtype!r}")
    return dtype


def _reconstruct(cls: Any, shape: Any, typecode: Any) -> np.ndarray:
    """numpy's ``_reconstruct`` as ``ndarray.__reduce__`` calls it: an empty ndarray, which the
    pickle's state then fills from its own bytes."""
    if cls is not _NDARRAY or tuple(shape) != (0,) or typecode not in (b"b", "b"):
        raise RefusedPickle(f"numpy _reconstruct({cls!r}, {shape!r}, {typecode!r})")
    return _NUMPY_RECONSTRUCT(np.ndarray, (0,), b"b")


def _dtype(spec: Any, align: Any = False, copy: Any = True) -> np.dtype:
    if not isinstance(spec, (str, bytes)):
        raise RefusedPickle(f"numpy.dtype({spec!r})")
    return _plain_dtype(np.dtype(spec.decode("latin1") if isinstance(spec, bytes) else spec, bool(align), bool(copy)))


def _scalar(dtype: Any, data: Any) -> Any:
    return _NUMPY_SCALAR(_plain_dtype(dtype), data)


def _frombuffer(buffer: Any, dtype: Any, shape: Any, order: Any, *rest: Any) -> np.ndarray:
    return _NUMPY_FROMBUFFER(buffer, _plain_dtype(dtype), shape, order, *rest)


def _latin1(text: Any, encoding: Any = "utf-8") -> bytes:
    """``_codecs.encode`` as Python 3 pickles bytes at protocol 2: latin-1 text to bytes."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise RefusedPickle(f"_codecs.encode(..., {encoding!r})")
    return text.encode("latin1")


_ALLOWED = {
    ("numpy", "ndarray"): _NDARRAY,
    ("numpy", "dtype"): _dtype,
    ("_codecs", "encode"): _latin1,
    **{(f"numpy.{core}.multiarray", "_reconstruct"): _reconstruct for core in ("core", "_core")},
    **{(f"numpy.{core}.multiarray", "scalar"): _scalar for core in ("core", "_core")},
    **{(f"numpy.{core}.numeric", "_frombuffer"): _frombuffer for core in ("core", "_core")},
}


class _BatchUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise RefusedPickle(f"{module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedPickle(f"persistent object {pid!r}")


def load_batch(path: Path) -> Any:
    """The object pickled in ``path``, built from the format's types only (see the module
    docstring); raises :class:`RefusedPickle` for anything else, and what ``pickle.load`` raises
    for a truncated or garbled file. Python 2 strings are read as latin-1, as numpy's arrays need."""
    with open(path, "rb") as handle:
        return _BatchUnpickler(handle, encoding="latin1").load()
