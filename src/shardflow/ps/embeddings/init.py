"""A row's first values, drawn from a counter-based generator keyed by (seed, table, id, column): any PS, process or
batch of ids makes the same row for the same id, bit for bit. Only integer arithmetic, +, *, / and sqrt are used
(exactly rounded in torch's vector and scalar loops alike), never log or cos, whose vector code may differ from
the scalar code run on a batch's tail in the last bit."""

from __future__ import annotations

import hashlib
import math

import torch

from shardflow.ps.embeddings.spec import TableSpec

_GAMMA = -7046029254386353131  # 0x9E3779B97F4A7C15: splitmix64's increment
_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M2 = -7723592293110705685  # 0x94D049BB133111EB
_LOW24 = (1 << 24) - 1
_CHUNK_ROWS = 8192
"""Rows drawn at a time: the temporaries of a chunk stay in the cache, and the output is the only large tensor."""
_SIGN_BIT = -(1 << 31)
_LN2 = math.log(2.0)
_ANGLE_STEP = (math.pi / 2) / (1 << 22)


def initial_rows(spec: TableSpec, ids: torch.Tensor) -> torch.Tensor:
    """The initial values of the rows of `ids` (int64, 1-D) of `spec`'s table: float32 [len(ids), dim]."""
    dim = spec.embedding_dim
    out = torch.empty((ids.numel(), dim), dtype=torch.float32)
    key = table_key(spec)
    for begin in range(0, ids.numel(), _CHUNK_ROWS):
        chunk = ids[begin : begin + _CHUNK_ROWS]
        _fill(spec, key, chunk, out[begin : begin + chunk.numel()])
    return out


def table_key(spec: TableSpec) -> int:
    """The int64 that keys a table's generator: its seed and a stable hash of its name (never Python's hash)."""
    digest = hashlib.blake2b(spec.name.encode(), digest_size=8, person=b"sf.init").digest()
    name_key = int.from_bytes(digest, "little", signed=True)
    return int(_finalise(torch.tensor([name_key ^ spec.initializer.seed]))[0])


def uniform_draws(key: int, ids: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """A float64 in [0, 1) for each (id, counter), the same for the same key, id and counter anywhere."""
    bits = _finalise(_finalise(ids * _GAMMA + key) + counters * _GAMMA)
    return ((bits >> 11) & ((1 << 53) - 1)).to(torch.float64) * 2.0**-53


def _fill(spec: TableSpec, key: int, ids: torch.Tensor, out: torch.Tensor) -> None:
    init = spec.initializer
    if init.kind in ("zeros", "constant"):
        out.fill_(0.0 if init.kind == "zeros" else init.value)
        return
    num_ids, dim = out.shape
    pairs = (dim + 1) // 2
    # One 64-bit draw per pair of columns, split into two 32-bit halves; a pair's two values fill column j and
    # column pairs + j.
    row_state = _finalise(ids.to(torch.int64) * _GAMMA + key)
    counters = torch.arange(1, pairs + 1, dtype=torch.int64) * _GAMMA
    bits = _finalise((row_state.unsqueeze(1) + counters).view(-1))
    high, low = (bits >> 32).to(torch.int32), bits.to(torch.int32)
    if init.kind == "uniform":
        first, second = _uniform(high, init.low, init.high), _uniform(low, init.low, init.high)
    else:
        first, second = _normal(high, low)
    out[:, :pairs] = first.view(num_ids, pairs)
    out[:, pairs:] = second.view(num_ids, pairs)[:, : dim - pairs]
    if init.kind == "normal" and (init.std != 1.0 or init.mean != 0.0):
        out.mul_(init.std).add_(init.mean)


def _finalise(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function, a bijection of int64 (logical shifts written as arithmetic shift and mask)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _M1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _M2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def _uniform(bits32: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """low + (high - low) u, u the top 24 bits as a fraction in [0, 1) (exact in float32)."""
    fraction = ((bits32 >> 8) & _LOW24).to(torch.float32)
    return fraction.mul_(2.0**-24 * (high - low)).add_(low)


def _normal(high: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent N(0, 1) by Box-Muller, x = r cos(a), y = r sin(a) with r = sqrt(-2 ln u): u from the top 24
    bits of `high`, the angle a in [0, pi/2) from bits 8 to 29 of `low`, and the quadrant from its top two bits as
    the signs of x and y."""
    radius = _log_fraction((high >> 8) & _LOW24).mul_(-1.0).sqrt_()  # sqrt(-2 ln u) / sqrt(2), see below
    # a = b + pi/4, b in [-pi/4, pi/4) where the series converge fast: cos a = (cos b - sin b) / sqrt(2),
    # sin a = (cos b + sin b) / sqrt(2); the sqrt(2) is taken out of the radius above.
    b = ((low >> 8) & ((1 << 22) - 1)).to(torch.float32).add_(0.5 - (1 << 21)).mul_(_ANGLE_STEP)
    sine, cosine = _sin_cos(b)
    x = (cosine - sine).mul_(radius)
    y = cosine.add_(sine).mul_(radius)
    sign_x = low & _SIGN_BIT
    sign_y = (low << 1) & _SIGN_BIT
    x.view(torch.int32).bitwise_xor_(sign_x)
    y.view(torch.int32).bitwise_xor_(sign_y)
    return x, y


def _log_fraction(bits24: torch.Tensor) -> torch.Tensor:
    """ln((k + 1) / 2**24) for 24-bit integers k, in (-16.7, 0]: the exponent from the float's bits, and the
    series of 2 atanh(s), s = (m - 1) / (m + 1), for the logarithm of the mantissa m in [1, 2)."""
    as_float = (bits24 + 1).to(torch.float32)  # exact: at most 2**24
    raw = as_float.view(torch.int32)
    exponent = (raw >> 23).to(torch.float32).sub_(127 + 24).mul_(_LN2)
    mantissa = ((raw & ((1 << 23) - 1)) | (127 << 23)).view(torch.float32)
    # s < 1/3: the series to s**15 is exact to float32.
    s = (mantissa - 1.0).div_(mantissa + 1.0)
    s2 = s * s
    series = s2 * (1.0 / 15.0)
    for power in (13, 11, 9, 7, 5, 3):
        series.add_(1.0 / power).mul_(s2)
    series.add_(1.0).mul_(s).mul_(2.0)
    return series.add_(exponent)


def _sin_cos(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sin and cos of x in [-pi/4, pi/4] by their Taylor series (to x**11 and x**12: below float32's resolution)."""
    x2 = x * x
    sine = x2 * (-1.0 / 39916800.0)
    for coefficient in (1.0 / 362880.0, -1.0 / 5040.0, 1.0 / 120.0, -1.0 / 6.0):
        sine.add_(coefficient).mul_(x2)
    sine.add_(1.0).mul_(x)
    cosine = x2 * (1.0 / 479001600.0)
    for coefficient in (-1.0 / 3628800.0, 1.0 / 40320.0, -1.0 / 720.0, 1.0 / 24.0, -0.5):
        cosine.add_(coefficient).mul_(x2)
    return sine, cosine.add_(1.0)
