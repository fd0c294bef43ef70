"""The gated delta rule in plain PyTorch: the chunked fp32 form the self-test compares against, and the
token-by-token form the tests take as ground truth."""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F

CHUNK = 64


def gate_and_beta(a, b, A_log, dt_bias):
    """The decay (log space, fp32) and beta, computed as transformers' Qwen3.5/Qwen3-Next layers do.

    The softplus's backward gets its input and gradient contiguous: torch's decomposition of ``softplus_backward``,
    which AOTAutograd's trace follows, lays its result out as the input, while the kernel that runs lays it out as
    the gradient, which a caller's transpose leaves non-contiguous (the chunked reference's). Under
    ``torch.compile(backend="aot_eager")`` the gate projection's backward then could not ``view`` it
    (tests/ops/test_ops.py::test_delta_rule_reference_trains_under_aot_autograd)."""
    softplus = F.softplus((a.float() + dt_bias).contiguous())
    if softplus.requires_grad:
        softplus.register_hook(torch.Tensor.contiguous)
    g = -A_log.float().exp() * softplus
    return g, b.sigmoid()


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


_first_solve = threading.Lock()


_solved_once = False


def _solve_unit_lower(system: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """``solve_triangular`` for a unit lower-triangular system. PyTorch loads its CUDA linear-algebra backend
    lazily on the first such call of a process, and two threads making that first call together fail (`lazy
    wrapper should be called at most once`): nn.DataParallel's replicas do (seen on two H200s, where the fp32
    Trainer test runs this eager path). The first call is made under a lock."""
    global _solved_once
    with contextlib.nullcontext() if _solved_once else _first_solve:
        result = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        _solved_once = True
    return result


def _chunked(q, k, v, g, beta, initial_state=None):
    """Chunk-parallel form of the recurrence for one batch of equal-length rows. Inputs [B, H, T, *], fp32;
    ``initial_state`` ``[B, H, Dk, Dv]`` or None (zeros). Returns the output and the state after the last token."""
    batch, heads, length, dk = k.shape
    dv = v.shape[-1]
    pad = (-length) % CHUNK
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (length + pad) // CHUNK
    q, k, v = (t.reshape(batch, heads, n, CHUNK, -1) for t in (q, k, v))
    g, beta = (t.reshape(batch, heads, n, CHUNK) for t in (g, beta))

    gc = g.cumsum(-1)  # decay from the chunk start to (and including) each token
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    # exp(gc_i - gc_j) for j <= i, 0 above the diagonal (masked before exp so it cannot overflow)
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, float("-inf")).exp()

    # Within a chunk the corrections u solve (I + A) u = beta v - beta exp(gc) (k S0),
    # with A[i, j] = beta_i exp(gc_i - gc_j) k_i.k_j for j < i.
    system = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    system = system + torch.eye(CHUNK, dtype=q.dtype, device=q.device)
    u_values = _solve_unit_lower(system, beta[..., None] * v)
    w_keys = _solve_unit_lower(system, beta[..., None] * gc.exp()[..., None] * k)
    scores = (q @ k.transpose(-1, -2)) * decay  # causal, decayed q.k within the chunk
    q_decayed = q * gc.exp()[..., None]
    k_to_end = k * (gc[..., -1:] - gc).exp()[..., None]
    chunk_decay = gc[..., -1].exp()[..., None, None]

    state = q.new_zeros(batch, heads, dk, dv) if initial_state is None else initial_state.to(q.dtype)
    out = torch.empty_like(v)
    for i in range(n):
        u = u_values[:, :, i] - w_keys[:, :, i] @ state
        out[:, :, i] = q_decayed[:, :, i] @ state + scores[:, :, i] @ u
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u
    # (padded tail tokens have g = 0 and k = 0: they leave the state as it is)
    return out.reshape(batch, heads, n * CHUNK, dv)[:, :, :length], state


def gated_delta_rule_reference(
    q, k, v, a, b, A_log, dt_bias, cu_seqlens=None, initial_state=None, output_final_state: bool = False
):
    """Eager gated delta rule in fp32 (chunked, exact per document when packed).

    ``initial_state``: the state each row (packed: each document) starts from, ``[N, Hv, Dk, Dv]``, or None for
    zeros. ``output_final_state``: also return the state after each row's (document's) last token, fp32, as
    ``(o, final_state)``: what a cache keeps for a continuation."""
    g, beta = gate_and_beta(a, b, A_log, dt_bias)
    groups = v.shape[2] // q.shape[2]
    if groups > 1:
        q = q.repeat_interleave(groups, dim=2)
        k = k.repeat_interleave(groups, dim=2)
    out_dtype = q.dtype
    q, k, v, g, beta = (t.transpose(1, 2).float() for t in (q, k, v, g, beta))
    q = _l2norm(q) * q.shape[-1] ** -0.5
    k = _l2norm(k)
    start = None if initial_state is None else initial_state.to(q.dtype)
    if cu_seqlens is None:
        out, final = _chunked(q, k, v, g, beta, start)
    else:
        if q.shape[0] != 1:
            raise ValueError(f"packed inputs (cu_seqlens) need batch size 1, got {q.shape[0]}")
        bounds = [int(x) for x in cu_seqlens.tolist()]
        pieces, finals = [], []
        for index, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
            first = None if start is None else start[index : index + 1]
            if e > s:
                piece, last = _chunked(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], g[:, :, s:e], beta[:, :, s:e], first)
                pieces.append(piece)
            else:  # an empty document keeps the state it started from
                last = first if first is not None else q.new_zeros(1, q.shape[1], q.shape[-1], v.shape[-1])
            finals.append(last)
        out, final = torch.cat(pieces, dim=2), torch.cat(finals)
    out = out.transpose(1, 2).to(out_dtype).contiguous()
    return (out, final.float()) if output_final_state else out


def gated_delta_rule_recurrent(
    q, k, v, a, b, A_log, dt_bias, cu_seqlens=None, initial_state=None, output_final_state: bool = False
):
    """Token-by-token form of the same recurrence: slow, obviously right; the tests' ground truth (fp64)."""
    g, beta = gate_and_beta(a, b, A_log, dt_bias)
    groups = v.shape[2] // q.shape[2]
    q = q.repeat_interleave(groups, dim=2).double()
    k = k.repeat_interleave(groups, dim=2).double()
    v, g, beta = v.double(), g.double(), beta.double()
    q = _l2norm(q) * q.shape[-1] ** -0.5
    k = _l2norm(k)
    batch, length, heads, dk = q.shape
    bounds = [0, length] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    out = torch.zeros_like(v)
    finals = []
    for index, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        if initial_state is None:
            state = q.new_zeros(batch, heads, dk, v.shape[-1])
        else:  # per row, or (packed) per document
            state = initial_state.double() if cu_seqlens is None else initial_state[index : index + 1].double()
        for t in range(s, e):
            state = state * g[:, t].exp()[..., None, None]
            delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t]))
            state = state + k[:, t, :, :, None] * delta[:, :, None, :]
            out[:, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, t])
        finals.append(state)
    return (out, torch.cat(finals)) if output_final_state else out
