"""numpy arrays <-> `colibri.worker.v1.Tensor` (raw little-endian bytes + dtype + shape), checked on read."""

from __future__ import annotations

import math

import numpy as np

from common.errors import InvalidRequestError
from common.pb import worker_pb2

WIRE_DTYPES = ("int32", "int64", "uint16", "float32")
MAX_DIMS = 8


def to_pb(array: np.ndarray) -> worker_pb2.Tensor:
    data = np.ascontiguousarray(array)
    if data.dtype.name not in WIRE_DTYPES:
        raise ValueError(f"tensor dtype {data.dtype} cannot travel (supported: {', '.join(WIRE_DTYPES)})")
    return worker_pb2.Tensor(
        data=data.astype(data.dtype.newbyteorder("<"), copy=False).tobytes(),
        dtype=data.dtype.name,
        shape=list(data.shape),
    )


def from_pb(tensor: worker_pb2.Tensor, field: str, dtype: str | None = None) -> np.ndarray:
    """The array a Tensor carries; one-line InvalidRequestError naming `field` when it is malformed."""
    if tensor.dtype not in WIRE_DTYPES or (dtype is not None and tensor.dtype != dtype):
        raise InvalidRequestError(field, f"dtype must be {dtype or ' or '.join(WIRE_DTYPES)}, got {tensor.dtype!r}")
    shape = tuple(int(d) for d in tensor.shape)
    if len(shape) > MAX_DIMS:
        raise InvalidRequestError(field, f"{len(shape)} dimensions, at most {MAX_DIMS}")
    if any(d < 0 for d in shape):
        raise InvalidRequestError(field, f"negative dimension in shape {list(shape)}")
    itemsize = np.dtype(tensor.dtype).itemsize
    if len(tensor.data) != math.prod(shape) * itemsize:  # Python ints: a product cannot wrap around
        raise InvalidRequestError(field, f"{len(tensor.data)} bytes do not fit {tensor.dtype} {list(shape)}")
    return np.frombuffer(tensor.data, dtype=np.dtype(tensor.dtype).newbyteorder("<")).reshape(shape)
