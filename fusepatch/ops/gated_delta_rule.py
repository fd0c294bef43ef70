"""gated_delta_rule: the Gated DeltaNet recurrence, with the gate, beta and q/k L2-norm folded in.

Op signature (training path, no carried state)::

    o = gated_delta_rule(q, k, v, a, b, A_log, dt_bias, cu_seqlens=None)

``q, k: [B, T, Hk, Dk]``, ``v: [B, T, Hv, Dv]`` with ``Hv`` a multiple of ``Hk`` (grouped value heads),
``a, b: [B, T, Hv]`` the raw projections; the decay is ``g = -exp(A_log) * softplus(a + dt_bias)`` and
``beta = sigmoid(b)``; q and k are L2-normalised and q scaled by ``Dk ** -0.5``. Per token the state
``S [Dk, Dv]`` evolves as ``S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q``. With ``cu_seqlens``
(packed documents, batch 1) the state restarts at every document start.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F

from fusepatch.backends.fla import DELTA_RULE_WHOLE, check_signatures
from fusepatch.layers.packing import host_built
from fusepatch.ops._common import fla_backward_requirements, rand
from fusepatch.ops.base import Candidate, Op, SelfTest
from fusepatch.requirements import InputRule, OptIn

CHUNK = 64


def gate_and_beta(a, b, A_log, dt_bias):
    """The decay (log space, fp32) and beta, computed as transformers' Qwen3.5/Qwen3-Next layers do."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
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


def _chunked(q, k, v, g, beta):
    """Chunk-parallel form of the recurrence for one batch of equal-length rows. Inputs [B, H, T, *], fp32."""
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

    state = q.new_zeros(batch, heads, dk, dv)
    out = torch.empty_like(v)
    for i in range(n):
        u = u_values[:, :, i] - w_keys[:, :, i] @ state
        out[:, :, i] = q_decayed[:, :, i] @ state + scores[:, :, i] @ u
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u
    return out.reshape(batch, heads, n * CHUNK, dv)[:, :, :length]


def gated_delta_rule_reference(q, k, v, a, b, A_log, dt_bias, cu_seqlens=None):
    """Eager gated delta rule in fp32 (chunked, exact per document when packed)."""
    g, beta = gate_and_beta(a, b, A_log, dt_bias)
    groups = v.shape[2] // q.shape[2]
    if groups > 1:
        q = q.repeat_interleave(groups, dim=2)
        k = k.repeat_interleave(groups, dim=2)
    out_dtype = q.dtype
    q, k, v, g, beta = (t.transpose(1, 2).float() for t in (q, k, v, g, beta))
    q = _l2norm(q) * q.shape[-1] ** -0.5
    k = _l2norm(k)
    if cu_seqlens is None:
        out = _chunked(q, k, v, g, beta)
    else:
        if q.shape[0] != 1:
            raise ValueError(f"packed inputs (cu_seqlens) need batch size 1, got {q.shape[0]}")
        bounds = [int(x) for x in cu_seqlens.tolist()]
        pieces = [
            _chunked(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], g[:, :, s:e], beta[:, :, s:e])
            for s, e in zip(bounds[:-1], bounds[1:])
            if e > s
        ]
        out = torch.cat(pieces, dim=2)
    return out.transpose(1, 2).to(out_dtype).contiguous()


def gated_delta_rule_recurrent(q, k, v, a, b, A_log, dt_bias, cu_seqlens=None):
    """Token-by-token form of the same recurrence: slow, obviously right; the tests' ground truth."""
    g, beta = gate_and_beta(a, b, A_log, dt_bias)
    groups = v.shape[2] // q.shape[2]
    q = q.repeat_interleave(groups, dim=2).double()
    k = k.repeat_interleave(groups, dim=2).double()
    v, g, beta = v.double(), g.double(), beta.double()
    q = _l2norm(q) * q.shape[-1] ** -0.5
    k = _l2norm(k)
    batch, length, heads, dk = q.shape
    starts = set([0] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()])
    out = torch.zeros_like(v)
    state = q.new_zeros(batch, heads, dk, v.shape[-1])
    for t in range(length):
        if t in starts:
            state = torch.zeros_like(state)
        state = state * g[:, t].exp()[..., None, None]
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t]))
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, t])
    return out


def chunk_table(cu_seqlens: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor | None:
    """fla's table of chunks for packed rows, ``[chunks, 2]`` (document, chunk within it), in ``cu_seqlens``'
    dtype and device, built from the boundaries' host values and copied without a wait (``packing.host_built``).
    fla builds it from the GPU tensor (``repeat_interleave`` reads its length on the host): two waits for the GPU
    per new boundaries on the H200 trace of 2026-11-30, mid-forward. ``None`` where the host values are not
    known: fla then builds it itself."""

    def build(host: tuple[int, ...]) -> torch.Tensor:
        import numpy as np  # packing.host_built says why not torch

        counts = (np.diff(np.asarray(host, dtype=np.int64)) + chunk - 1) // chunk
        documents = np.repeat(np.arange(len(counts)), counts)
        firsts = np.repeat(np.cumsum(counts) - counts, counts)
        table = np.stack([documents, np.arange(len(documents)) - firsts], 1)
        return torch.from_numpy(table).to(cu_seqlens.dtype)

    return host_built(cu_seqlens, f"chunk_table/{chunk}", build, cu_seqlens.device)


def _load_fla(gate_in_kernel: bool):
    import inspect

    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    # fla-core 0.6 takes the chunk table; where a release does not, fla builds it (and waits) itself
    takes_table = "chunk_indices" in inspect.signature(chunk_gated_delta_rule).parameters

    def gated_delta_rule_fla(q, k, v, a, b, A_log, dt_bias, cu_seqlens=None):
        table = chunk_table(cu_seqlens) if cu_seqlens is not None and takes_table else None
        extra = {} if table is None else {"chunk_indices": table}
        if gate_in_kernel:
            out, _ = chunk_gated_delta_rule(
                q,
                k,
                v,
                a,
                b,
                use_qk_l2norm_in_kernel=True,
                use_beta_sigmoid_in_kernel=True,
                use_gate_in_kernel=True,
                A_log=A_log,
                dt_bias=dt_bias,
                cu_seqlens=cu_seqlens,
                **extra,
            )
        else:
            g, beta = gate_and_beta(a, b, A_log, dt_bias)
            out, _ = chunk_gated_delta_rule(
                q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, **extra
            )
        return out

    return gated_delta_rule_fla


def _fla_split():
    """fla's delta rule (gate, beta sigmoid and q/k L2 norm in kernel) as the two halves its autograd function
    runs, so that the backward graph reads what the forward saved instead of recomputing the forward. Mirrors
    ``ChunkGatedDeltaRuleFunction`` of fla-core 0.5-0.6 for equal-length rows without initial state."""
    from fla.ops.gated_delta_rule import chunk as fla

    from fusepatch.graphs import Split

    check_signatures(fla, DELTA_RULE_WHOLE, "gated_delta_rule/fla-graphed")

    def forward(q, k, v, a, b, A_log, dt_bias):
        # fla's autograd function makes its inputs contiguous (input_guard) and its l2norm views them flat: q, k
        # and v arrive as views of the conv output when the call runs without graphs. v is saved as fla saves
        # it: its own copy, not a view that keeps the conv output alive.
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        q_n, q_rstd = fla.l2norm_fwd(q)
        k_n, k_rstd = fla.l2norm_fwd(k)
        beta = fla.fused_beta_sigmoid(b, scale=1.0)
        g, o, A, *_ = fla.chunk_gated_delta_rule_fwd(
            q=q_n,
            k=k_n,
            v=v,
            g=a,
            beta=beta,
            scale=k.shape[-1] ** -0.5,
            initial_state=None,
            output_final_state=False,
            use_gate_in_kernel=True,
            A_log=A_log,
            dt_bias=dt_bias,
        )
        return o.to(q.dtype), (q_n, q_rstd, k_n, k_rstd, v, g, beta, A)

    def backward(inputs, saved, grad_output, needs_grad):
        _, _, _, a, b, A_log, dt_bias = inputs  # q, k, v: not kept (backward_inputs below)
        q_n, q_rstd, k_n, k_rstd, v, g, beta, A = saved
        dq, dk, dv, db, dg, _, dA_log, ddt_bias = fla.chunk_gated_delta_rule_bwd(
            q=q_n,
            k=k_n,
            v=v,
            g=g,
            beta=beta,
            A=A,
            scale=k_n.shape[-1] ** -0.5,
            initial_state=None,
            do=grad_output,
            dht=None,
            use_gate_in_kernel=True,
            g_input=a,
            A_log=A_log,
            dt_bias=dt_bias,
        )
        dq = fla.l2norm_bwd(q_n, q_rstd, dq)
        dk = fla.l2norm_bwd(k_n, k_rstd, dk)
        db = fla.fused_beta_sigmoid_bwd(b, db, scale=1.0)
        grads = (dq, dk, dv, dg, db, dA_log, ddt_bias)
        dtypes = (q_n.dtype, k_n.dtype, v.dtype, a.dtype, b.dtype, A_log.dtype, dt_bias.dtype)
        return tuple(d.to(dtype) for d, dtype, n in zip(grads, dtypes, needs_grad) if n)

    # the backward reads a, b, A_log and dt_bias of the inputs; q, k and v reach it through `saved`
    return Split(forward, backward, backward_inputs=(3, 4, 5, 6))


# Off by default: the graphs copy every call's inputs, outputs and saved tensors in and out of their static
# buffers (Memcpy DtoD: 4.3 ms of the 2B-like step, 1.4 ms of the 27B one on the H200), and with the CPU keeping
# ahead of the GPU that costs more than the launches it saves: in one H200 run of 2026-11-30
# fla without graphs was faster at both shapes, 205.2 against 208.6 ms (2B-like) and 215.7 against 218.1 ms
# (27B). They pay where the CPU holds the GPU back: the H200 run of 2026-11-29 measured 1.6-3.1 ms of CPU per layer and call in
# fla's Python, and a 2B-like step at 64% GPU busy without them.
GRAPHS_SWITCH = OptIn(
    "FUSEPATCH_CUDA_GRAPHS",
    "steps the CPU holds back: GPU busy well under 90%, small layers, many ranks per CPU",
)


def _load_fla_graphed():
    """fla's delta rule replayed from CUDA graphs for equal-length rows (fusepatch/graphs.py: its ~30 kernel
    launches per layer cost the CPU more than the GPU); packed calls run fla's own function."""
    from fusepatch.graphs import GraphedOp

    plain = _load_fla(gate_in_kernel=True)
    graphed = GraphedOp(_fla_split(), "gated_delta_rule/fla-graphed")

    def gated_delta_rule_fla_graphed(q, k, v, a, b, A_log, dt_bias, cu_seqlens=None):
        if cu_seqlens is not None:
            return plain(q, k, v, a, b, A_log, dt_bias, cu_seqlens=cu_seqlens)
        return graphed(q, k, v, a, b, A_log, dt_bias)

    gated_delta_rule_fla_graphed.graphed = graphed  # for tests and the report: what was captured
    return gated_delta_rule_fla_graphed


def _load_fla_saved_states(grouped: bool = False):
    from fusepatch.ops import fla_saved_states

    return fla_saved_states.load(grouped)


def _selftest_inputs(device, dtype, generator, packed=True, dims=None):
    # Odd length, grouped value heads; packed: a row of four documents, one of a single token (an error at a
    # document's first token is that whole document's error). Head sizes: the layer's when known.
    dims = dims or {}
    length = 150
    hk, hv, dk, dv = (dims.get(k, d) for k, d in (("hk", 2), ("hv", 4), ("dk", 64), ("dv", 64)))
    q = rand((1, length, hk, dk), device, dtype, generator)
    k = rand((1, length, hk, dk), device, dtype, generator)
    v = rand((1, length, hv, dv), device, dtype, generator)
    a = rand((1, length, hv), device, dtype, generator)
    b = rand((1, length, hv), device, dtype, generator)
    # A_log and dt_bias are parameters: in the model's dtype, as a bf16 model holds them.
    A_log = (torch.rand(hv, generator=generator) * 2 - 1).to(device=device, dtype=dtype).requires_grad_(True)
    dt_bias = rand((hv,), device, dtype, generator, scale=0.5)
    cu = torch.tensor([0, 64, 65, 101, length], dtype=torch.int32, device=device) if packed else None
    return (q, k, v, a, b, A_log, dt_bias), {"cu_seqlens": cu}


def _dims(module) -> dict[str, int]:
    return {"hk": module.num_k_heads, "hv": module.num_v_heads, "dk": module.head_k_dim, "dv": module.head_v_dim}


# fp32 is refused: measured on the H200 (fla 0.6.0, Triton 3.6, TileLang backward), fp32 inputs gave gradients
# of the gate input 4-6% and of A_log/dt_bias 19-30% off the fp32 reference (q/k/v gradients 0.2%), worse than
# the same kernels at bf16 against that reference: not the precision an fp32 run asks for. tests/gpu checks
# that this still holds, so the rule is lifted when a fla release fixes it.
FLA_INPUTS = InputRule(
    kernel="fla's chunked gated delta rule",
    dtypes=("bfloat16", "float16"),
    why={
        "float32": (
            "at float32 its gate and decay-parameter gradients were measured 4-30% off an fp32 reference "
            "(fla 0.6, H200), so fp32 keeps the eager delta rule"
        )
    },
    notes={
        "float32": "train in bf16 (model.to(torch.bfloat16), or FSDP2 MixedPrecisionPolicy(param_dtype=torch.bfloat16))"
    },
)

GATED_DELTA_RULE = Op(
    name="gated_delta_rule",
    summary="chunked gated delta rule fwd+bwd, gate/beta/L2-norm in kernel, native grouped value heads",
    reference=gated_delta_rule_reference,
    candidates=(
        Candidate(
            name="fla-graphed",
            source="pip",
            requirements=fla_backward_requirements("fla.ops.gated_delta_rule") + (GRAPHS_SWITCH,),
            load=_load_fla_graphed,
            inputs=FLA_INPUTS,
            provides="fla.ops.gated_delta_rule.chunk_gated_delta_rule (as 'fla'), replayed from CUDA graphs per shape",
            distribution="fla-core",
            varlen=False,  # packed rows: new boundaries every step, and fla reads them on the CPU
        ),
        Candidate(
            name="fla-saved-states-grouped",
            source="pip",
            requirements=fla_backward_requirements("fla.ops.gated_delta_rule"),  # Triton >= 3.3 among them
            load=lambda: _load_fla_saved_states(grouped=True),
            inputs=FLA_INPUTS,
            provides=(
                "fla-saved-states with the q/k gradients' sums over grouped value heads done in fusepatch's L2-norm "
                "backward kernel (fusepatch.kernels.l2norm) instead of torch sums inside fla: 0.6 ms less GPU time "
                "a 27B-shaped step on the H200 (run of 2026-11-30)"
            ),
            distribution="fla-core",
        ),
        Candidate(
            name="fla-saved-states",
            source="pip",
            requirements=fla_backward_requirements("fla.ops.gated_delta_rule"),
            load=_load_fla_saved_states,
            inputs=FLA_INPUTS,
            provides=(
                "fla's chunked delta rule kernels (fla.ops.gated_delta_rule.chunk), the chunk states kept from the "
                "forward instead of recomputed in the backward"
            ),
            distribution="fla-core",
        ),
        Candidate(
            name="fla",
            source="pip",
            requirements=fla_backward_requirements("fla.ops.gated_delta_rule"),
            load=lambda: _load_fla(gate_in_kernel=True),
            inputs=FLA_INPUTS,
            provides="fla.ops.gated_delta_rule.chunk_gated_delta_rule (use_gate_in_kernel, use_beta_sigmoid_in_kernel)",
            distribution="fla-core",
        ),
        Candidate(
            name="fla-gate-outside",
            source="pip",
            requirements=fla_backward_requirements("fla.ops.gated_delta_rule"),
            load=lambda: _load_fla(gate_in_kernel=False),
            inputs=FLA_INPUTS,
            provides="fla.ops.gated_delta_rule.chunk_gated_delta_rule (gate and beta computed in torch)",
            distribution="fla-core",
        ),
    ),
    # grad[5], grad[6]: A_log and dt_bias, whose gradients sum the decay gradient over every token with heavy
    # cancellation; in bf16 kernels that amplifies rounding (measured on the H200 in a mini model: 5-16% where
    # the fp32-recurrence eager path has 0.2-2%), so at half precision they get the GPU tests' bound.
    selftest=SelfTest(
        _selftest_inputs,
        {"bfloat16": 8e-3, "float16": 2e-3, "float32": 5e-3},
        _dims,
        looser={half: {"grad[5]": 0.25, "grad[6]": 0.25} for half in ("bfloat16", "float16")},
    ),
)
