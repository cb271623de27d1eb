"""Initial weights whose every element depends only on (seed, parameter name, element index).

Whatever the device, `model.init_device`, the mesh or the world size, element i of parameter p gets
the same value, so FSDP, HSDP and the FL runs start from the same model, and a sharded rank computes
only its own rows (nothing is materialised in full, as the 8B model needs). torch's generators cannot
give this: CPU and CUDA draw different streams, and DTensor's RNG makes values depend on the mesh.

Each value comes from a counter-based hash of its index (integer ops on int64 whose products stay
below 2**63), turned into a normal deviate by Box-Muller written with IEEE-exact operations only
(+, -, *, tensor / tensor, sqrt, frexp): every one of those rounds identically on any IEEE device and
in any vectorised or scalar loop, whereas library log and cos may differ by an ulp between CPU, CUDA
and a kernel's vector body and tail. Llama's distributions: N(0, initializer_range) for linear and
embedding weights, ones for RMSNorm, zeros for biases.
"""

from __future__ import annotations

import hashlib
import math

import torch

_M32 = 0xFFFFFFFF
_CHUNK = 1 << 22  # elements per pass: bounds the float64 temporaries (~32 MiB each)
# Series truncated at ~1e-14 relative error, far below the fp32/bf16 rounding of the result; what
# matters is that the same operations run everywhere, not the last digits.
_LOG_TERMS = [1.0 / (2 * k + 1) for k in range(9)]  # ln m = 2 t sum t^2k/(2k+1), t^2 < 0.03
_COS_TERMS = [(-1) ** k / math.factorial(2 * k) for k in range(11)]  # cos x = sum (-1)^k x^2k/(2k)!, x <= pi/2


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply; multipliers below 2**31 so no int64 product overflows)."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def _keys(seed: int, name: str) -> list[int]:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return [int.from_bytes(digest[4 * i : 4 * i + 4], "little") for i in range(4)]


def _polynomial(x: torch.Tensor, coefficients: list[float]) -> torch.Tensor:
    """sum c_k x^k by Horner, one exactly rounded op at a time."""
    out = torch.full_like(x, coefficients[-1])
    for c in reversed(coefficients[:-1]):
        out = out * x + c
    return out


def _log(u: torch.Tensor) -> torch.Tensor:
    """Natural log of u > 0 (float64): u = m 2^e with m in [sqrt(1/2), sqrt(2)), then the atanh series."""
    m, e = torch.frexp(u)
    low = m < math.sqrt(0.5)
    m = torch.where(low, m * 2, m)
    e = (e - low.to(e.dtype)).to(u.dtype)
    t = (m - 1) / (m + 1)
    return 2 * t * _polynomial(t * t, _LOG_TERMS) + e * math.log(2)


def _cos_2pi(h: torch.Tensor) -> torch.Tensor:
    """cos(2 pi h / 2**32) of 32-bit integers h: the top 2 bits pick the quadrant, the other 30 the
    angle in it, folded into [0, pi/2] where the Taylor series converges fast."""
    quadrant, fraction = h >> 30, (h & (2**30 - 1)).to(torch.float64) * 2.0**-30
    angle = torch.where((quadrant & 1).bool(), 1 - fraction, fraction) * (math.pi / 2)
    sign = torch.where((quadrant == 1) | (quadrant == 2), -1.0, 1.0).to(torch.float64)
    return sign * _polynomial(angle * angle, _COS_TERMS)


def standard_normal(seed: int, name: str, start: int, count: int, device) -> torch.Tensor:
    """N(0, 1) float64 values of elements start .. start+count-1 of parameter `name` (Box-Muller)."""
    k0, k1, k2, k3 = _keys(seed, name)
    i = torch.arange(start, start + count, dtype=torch.int64, device=device)
    a = _mix32(_mix32((i & _M32) ^ k0) ^ (i >> 32) ^ k1)
    h1, h2 = _mix32(a ^ k2), _mix32(a ^ k3)
    u1 = (h1.to(torch.float64) + 0.5) * 2.0**-32  # (0, 1): the radius never sees log(0)
    return torch.sqrt(-2 * _log(u1)) * _cos_2pi(h2)


def _row_offset(param) -> int:
    """First global row of this rank's shard: FSDP2 shards dim 0 in chunks of ceil(rows / n)."""
    placements = getattr(param, "placements", ())
    offset = 0
    for mesh_dim, placement in enumerate(placements):
        if placement.is_shard():
            if placement.dim != 0:
                raise NotImplementedError(f"init: shard on dim {placement.dim}; fldp shards dim 0 only")
            n = param.device_mesh.size(mesh_dim)
            offset += math.ceil(param.shape[0] / n) * param.device_mesh.get_local_rank(mesh_dim)
    return offset


@torch.no_grad()
def fill_normal(param, seed: int, name: str, std: float) -> None:
    """Write N(0, std) into this rank's part of `param` (a plain tensor or an FSDP2 DTensor)."""
    local = param.to_local() if hasattr(param, "to_local") else param
    if local.numel() == 0:
        return
    row = math.prod(param.shape[1:])
    start = _row_offset(param) * row
    flat = local.view(-1)
    for begin in range(0, flat.numel(), _CHUNK):
        count = min(_CHUNK, flat.numel() - begin)
        values = standard_normal(seed, name, start + begin, count, flat.device) * std
        flat[begin : begin + count].copy_(values)  # one rounding, to the parameter's dtype


@torch.no_grad()
def init_parameters(model, seed: int, std: float) -> None:
    """Llama's init, element by element from (seed, name, index): see the module docstring."""
    seen = set()  # a tied lm_head is the embedding's parameter: drawn once, under its first name
    for prefix, module in model.named_modules():
        norm = type(module).__name__.endswith("RMSNorm")
        for leaf, param in module.named_parameters(recurse=False):
            name = f"{prefix}.{leaf}" if prefix else leaf
            if id(param) in seen:
                continue
            seen.add(id(param))
            if norm:
                param.fill_(1.0)
            elif leaf == "bias":
                param.zero_()
            else:
                fill_normal(param, seed, name, std)
