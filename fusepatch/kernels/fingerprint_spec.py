"""What the fingerprint kernel (``kernels/fingerprint.py``) and its PyTorch twin (``fingerprint_reference``, here;
``ops/prepared.py`` checks weights with it off the GPU) share, which must give the same bits: how a weight's contents
become a fingerprint, and the state the kernel keeps it in. No Triton here: the twin runs without it."""

import torch

# A weight's fingerprint: its bytes as 32-bit words w[i], and per lane the sum mod 2**32 of mix(w[i] ^ f(i)), two
# lanes of different position terms and mixers (murmur3's fmix32; lowbias32), 64 bits in all. The mixers are
# bijections: one word changed always changes both lanes; any other change misses with odds of about 2**-64.
POSITION_A = 0x9E3779B9  # lane a: w ^ (i * POSITION_A)
POSITION_B, OFFSET_B = 0x632BE5AB, 0x27D4EB2F  # lane b: w ^ (i * POSITION_B + OFFSET_B)
MIX_A = (16, 0x85EBCA6B, 13, 0xC2B2AE35, 16)  # x ^= x >> 16; x *= ...; x ^= x >> 13; x *= ...; x ^= x >> 16
MIX_B = (16, 0x7FEB352D, 15, 0x846CA68B, 16)
# the int32 state a prepared weight's fingerprint lives in on the GPU: the fingerprint held (lanes a, b), the sums of the
# call in progress, the programs done, and whether the last check found the weight changed (1) or not (0)
HELD, SUMS, DONE, STALE, STATE_WORDS = 0, 2, 4, 5, 6


def words(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values as 32-bit words in row-major order (its last dimension's words; read flat), what its
    fingerprint reads: every bit of every value, whatever the dtype (a copy only where ``x`` is not contiguous;
    its rows' bytes must be a multiple of 4)."""
    return (x if x.is_contiguous() else x.contiguous()).view(torch.int32)


_LOW = 0xFFFFFFFF
_CHUNK = 1 << 20  # words per pass of the twin: its int64 temporaries stay a few MB


def _times(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``x * constant`` mod 2**32 for int64 ``x`` in [0, 2**32), without leaving int64's range."""
    return (x * (constant & 0xFFFF) + (((x * (constant >> 16)) & 0xFFFF) << 16)) & _LOW


def _mixed(x: torch.Tensor, mix: tuple[int, ...]) -> torch.Tensor:
    first, times, second, again, last = mix
    x = x ^ (x >> first)
    x = _times(x, times)
    x = x ^ (x >> second)
    x = _times(x, again)
    return x ^ (x >> last)


def fingerprint_reference(x: torch.Tensor) -> torch.Tensor:
    """``kernels/fingerprint.fingerprint``'s fingerprint of ``x`` in PyTorch: int64 ``[2]``, its two lanes (each in
    [0, 2**32); ``fingerprint_spec`` says how they are made)."""
    values = words(x).reshape(-1)
    total = torch.zeros(2, dtype=torch.int64, device=x.device)
    for start in range(0, values.numel(), _CHUNK):
        word = values[start : start + _CHUNK].to(torch.int64) & _LOW
        position = torch.arange(start, start + word.numel(), dtype=torch.int64, device=x.device) & _LOW
        a = _mixed(word ^ _times(position, POSITION_A), MIX_A)
        b = _mixed(word ^ ((_times(position, POSITION_B) + OFFSET_B) & _LOW), MIX_B)
        total = (total + torch.stack((a.sum(), b.sum()))) & _LOW
    return total
