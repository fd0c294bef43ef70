"""What the fingerprint kernel (``kernels/fingerprint.py``) and its PyTorch twin (``ops/prepared.py``) share, which
must give the same bits: how a weight's contents become a fingerprint, and the state the kernel keeps it in. No
Triton here: the twin runs without it."""

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
