"""The numerics contract shared by tests, benchmarks and ``qflash check``.

Accuracy rule (flash-attn's): against a float64 reference, a kernel's error may be
at most ``factor`` times the error PyTorch makes in the same precision, plus a
rounding floor. ``factor`` is 2 for outputs and 3 for gradients.

Nothing here imports triton.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

__all__ = [
    "max_abs_err",
    "rel_l2_err",
    "cosine_similarity",
    "sqnr_db",
    "rounding_floor",
    "FlashRuleResult",
    "flash_rule",
    "assert_flash_rule",
    "same_bits",
    "poisoned",
    "FINITE_POISON",
    "poison_enabled",
    "new_output",
    "assert_written",
    "gaussian",
    "with_outlier_channels",
    "large_logits",
    "paged_cache",
    "attention_sinks",
]

FORWARD_FACTOR = 2.0
GRADIENT_FACTOR = 3.0


# ----------------------------------------------------------------------------------------------
# Error measures. All compute in float64 and return Python floats.
# ----------------------------------------------------------------------------------------------
def _pair(x: torch.Tensor, ref: torch.Tensor):
    if x.shape != ref.shape:
        raise ValueError(f"shape mismatch: {tuple(x.shape)} vs reference {tuple(ref.shape)}")
    return x.detach().to(torch.float64).cpu(), ref.detach().to(torch.float64).cpu()


def max_abs_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref|; NaN if either holds a NaN (NaN must never pass a check)."""
    x, ref = _pair(x, ref)
    if x.numel() == 0:
        return 0.0
    diff = (x - ref).abs()
    if torch.isnan(diff).any():
        return math.nan
    return float(diff.max())


def rel_l2_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref||_2 / ||ref||_2 (0 when both are zero)."""
    x, ref = _pair(x, ref)
    den = float(ref.norm())
    num = float((x - ref).norm())
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def cosine_similarity(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = _pair(x, ref)
    x, ref = x.flatten(), ref.flatten()
    den = float(x.norm() * ref.norm())
    return float(x @ ref) / den if den > 0 else math.nan


def sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio 10 log10(||ref||^2 / ||x - ref||^2) in dB."""
    x, ref = _pair(x, ref)
    noise = float(((x - ref) ** 2).sum())
    signal = float((ref**2).sum())
    if noise == 0:
        return math.inf
    return 10.0 * math.log10(signal / noise) if signal > 0 else -math.inf


def rounding_floor(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """Twice the rounding step of ``dtype`` around values near ``ref + 0.3``.

    This is flash-attn's absolute floor: it keeps the rule meaningful when PyTorch's
    own error happens to be 0 (tiny outputs, float64 inputs). Generic values in [-1, 1]
    join ``ref`` so that an all-zero reference (e.g. dq when each row sees one key)
    still gets the dtype's rounding step rather than a floor of exactly 0.
    """
    r = torch.cat([ref.detach().flatten().to(torch.float64).cpu(), torch.linspace(-1, 1, 33, dtype=torch.float64)])
    r = r.to(dtype)
    return 2.0 * float(((r + 0.3) - 0.3 - r).abs().max())


@dataclass
class FlashRuleResult:
    kernel_err: float
    torch_err: float
    floor: float
    factor: float

    @property
    def bound(self) -> float:
        return self.factor * self.torch_err + self.floor

    @property
    def ok(self) -> bool:
        return math.isfinite(self.kernel_err) and self.kernel_err <= self.bound

    def __str__(self) -> str:
        return (
            f"kernel err {self.kernel_err:.3e} vs bound {self.bound:.3e} "
            f"(= {self.factor:g} x torch err {self.torch_err:.3e} + floor {self.floor:.3e})"
        )


def flash_rule(
    out: torch.Tensor,
    ref: torch.Tensor,
    torch_out: torch.Tensor,
    *,
    factor: float = FORWARD_FACTOR,
    floor: Optional[float] = None,
) -> FlashRuleResult:
    """Compare ``out`` (kernel) and ``torch_out`` (PyTorch, same precision) with ``ref`` (fp64)."""
    if floor is None:
        floor = rounding_floor(ref, out.dtype)
    return FlashRuleResult(max_abs_err(out, ref), max_abs_err(torch_out, ref), floor, factor)


def assert_flash_rule(out, ref, torch_out, *, factor: float = FORWARD_FACTOR, floor=None, what: str = "output"):
    res = flash_rule(out, ref, torch_out, factor=factor, floor=floor)
    assert res.ok, f"{what}: {res}"
    return res


# ----------------------------------------------------------------------------------------------
# Output poisoning: launchers allocate through ``new_output`` so tests can fill every
# output with NaN (floats) or a sentinel (ints) and then prove each element was written.
# ----------------------------------------------------------------------------------------------
_POISON = [None]  # the float outputs' fill inside poisoned(), else None
FINITE_POISON = 7.0  # poisoned(FINITE_POISON): a NaN in an output is then the kernel's own


@contextlib.contextmanager
def poisoned(value: float = math.nan) -> Iterator[None]:
    """Within this block, outputs allocated by qflash launchers start as ``value`` (floats; NaN
    unless a test needs to tell the kernel's own NaN from an unwritten element) or -123 (ints)."""
    _POISON.append(float(value))
    try:
        yield
    finally:
        _POISON.pop()


def poison_enabled() -> bool:
    return _POISON[-1] is not None


def new_output(shape: Sequence[int], *, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty``, or a poisoned tensor inside ``poisoned()``."""
    if not poison_enabled():
        return torch.empty(shape, dtype=dtype, device=device)
    if dtype.is_floating_point:
        return torch.full(shape, _POISON[-1], dtype=dtype, device=device)
    return torch.full(shape, -123, dtype=dtype, device=device)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equality of quantized outputs: one-byte tensors (int8, float8) by their bits, so that float8
    NaN codes count as equal; wider ones by value (``torch.equal``)."""
    return torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                       b.view(torch.uint8) if b.element_size() == 1 else b)


def assert_written(t: torch.Tensor, what: str = "output") -> None:
    """Fails if a NaN (an unwritten poisoned element, or a real NaN) is left in ``t``."""
    bad = torch.isnan(t) if t.dtype.is_floating_point else (t == -123)
    n = int(bad.sum())
    assert n == 0, f"{what}: {n} of {t.numel()} elements unwritten or NaN"


# ----------------------------------------------------------------------------------------------
# Input generators. Fresh random data, never zeros.
# ----------------------------------------------------------------------------------------------
def _generator(seed: Optional[int], device) -> Optional[torch.Generator]:
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def gaussian(shape, *, dtype=torch.float32, device="cpu", seed: Optional[int] = None, std: float = 1.0):
    """Standard normal samples (scaled by ``std``) drawn in float32, then cast."""
    g = _generator(seed, device)
    return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * std).to(dtype)


def with_outlier_channels(x: torch.Tensor, *, num: int = 4, scale: float = 50.0, seed: Optional[int] = None):
    """A copy of ``x`` whose ``num`` random last-axis channels are ``scale`` times larger.

    Mimics LLM activations, where a few hidden channels are 20-100x the rest.
    """
    g = _generator(seed, "cpu")
    idx = torch.randperm(x.shape[-1], generator=g)[:num].to(x.device)
    y = x.clone()
    y[..., idx] = (y[..., idx].float() * scale).to(x.dtype)
    return y


def large_logits(shape, *, dtype=torch.float32, device="cpu", seed: Optional[int] = None, magnitude: float = 30.0):
    """Gaussian q- or k-like tensor scaled so that q @ k.T * scale reaches about +-magnitude.

    With unit-variance entries the scaled dot product has std 1, so entries of
    std sqrt(magnitude) give logits of std ~magnitude: exp() overflows without a running max.
    """
    return gaussian(shape, dtype=dtype, device=device, seed=seed, std=math.sqrt(magnitude))


def attention_sinks(heads: int, *, dtype=torch.float32, device="cpu", seed: Optional[int] = None):
    """A sink score a head (gpt-oss's attention sinks) drawn around the keys' own scores (mean 1,
    sd 2), so that each sink takes a visible share of its rows' softmax."""
    return (gaussian((heads,), device=device, seed=seed, std=2.0) + 1.0).to(dtype)


def paged_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, page_size: int, *, spare_pages: int = 0,
                seed: int = 0):
    """The caches (batch, slots, heads_kv, D) cut into pages of ``page_size`` slots (the last one
    padded), shuffled into a paged cache with ``spare_pages`` pages no sequence names, and the block
    table that finds them: (k_pages, v_pages (num_pages, page_size, heads_kv, D), block_table
    (batch, pages a sequence) int32), the same keys as ``flash_attn_with_kvcache``'s paged
    ``block_table`` reads them. Slots and pages outside the keys hold random values."""
    batch, slots = k_cache.shape[:2]
    per_seq = -(-slots // page_size)
    num_pages = batch * per_seq + spare_pages
    order = torch.randperm(num_pages, generator=_generator(seed, "cpu"))[: batch * per_seq]
    table = order.view(batch, per_seq).to(torch.int32).to(k_cache.device)
    pad = per_seq * page_size - slots
    pages = []
    for cache in (k_cache, v_cache):
        rows = torch.nn.functional.pad(cache, (0, 0, 0, 0, 0, pad))  # (batch, per_seq * page_size, ...)
        paged = torch.randn(num_pages, page_size, *cache.shape[2:], device=cache.device).to(cache.dtype)
        paged[table.long().flatten()] = rows.view(batch * per_seq, page_size, *cache.shape[2:])
        pages.append(paged)
    return pages[0], pages[1], table
