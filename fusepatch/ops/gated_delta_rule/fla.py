"""Candidates on fla's public chunked delta rule: its function as exported (gate inside or outside the kernel),
and the same replayed from CUDA graphs."""

from __future__ import annotations

import torch

from fusepatch.backends.fla import DELTA_RULE_WHOLE, check_signatures
from fusepatch.ops.boundaries import host_built
from fusepatch.ops.gated_delta_rule.reference import CHUNK, gate_and_beta


def chunk_table(cu_seqlens: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor | None:
    """fla's table of chunks for packed rows, ``[chunks, 2]`` (document, chunk within it), in ``cu_seqlens``'
    dtype and device, built from the boundaries' host values and copied without a wait (``boundaries.host_built``).
    fla builds it from the GPU tensor (``repeat_interleave`` reads its length on the host): waits for the GPU
    per new boundaries, mid-forward. ``None`` where the host values are not
    known: fla then builds it itself."""

    def build(host: tuple[int, ...]) -> torch.Tensor:
        import numpy as np  # boundaries.host_built says why not torch

        counts = (np.diff(np.asarray(host, dtype=np.int64)) + chunk - 1) // chunk
        documents = np.repeat(np.arange(len(counts)), counts)
        firsts = np.repeat(np.cumsum(counts) - counts, counts)
        table = np.stack([documents, np.arange(len(documents)) - firsts], 1)
        return torch.from_numpy(table).to(cu_seqlens.dtype)

    return host_built(cu_seqlens, f"chunk_table/{chunk}", build, cu_seqlens.device)


def load_fla(gate_in_kernel: bool):
    import inspect

    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    # fla-core 0.6 takes the chunk table; where a release does not, fla builds it (and waits) itself
    takes_table = "chunk_indices" in inspect.signature(chunk_gated_delta_rule).parameters

    def gated_delta_rule_fla(
        q, k, v, a, b, A_log, dt_bias, cu_seqlens=None, initial_state=None, output_final_state: bool = False
    ):
        table = chunk_table(cu_seqlens) if cu_seqlens is not None and takes_table else None
        extra = {} if table is None else {"chunk_indices": table}
        states = dict(initial_state=initial_state, output_final_state=output_final_state)
        if gate_in_kernel:
            out, final = chunk_gated_delta_rule(
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
                **states,
                **extra,
            )
        else:
            g, beta = gate_and_beta(a, b, A_log, dt_bias)
            out, final = chunk_gated_delta_rule(
                q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, **states, **extra
            )
        return (out, final) if output_final_state else out

    return gated_delta_rule_fla


def fla_split():
    """fla's delta rule (gate, beta sigmoid and q/k L2 norm in kernel) as the two halves its autograd function
    runs, so that the backward graph reads what the forward saved instead of recomputing the forward. Mirrors
    ``ChunkGatedDeltaRuleFunction`` of fla-core 0.5-0.6 for equal-length rows without initial state."""
    from fla.ops.gated_delta_rule import chunk as fla

    from fusepatch.ops.graphs import Split

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


def load_fla_graphed():
    """fla's delta rule replayed from CUDA graphs for equal-length rows (fusepatch/ops/graphs.py: its ~30 kernel
    launches per layer cost the CPU more than the GPU); packed calls and calls with states (a cache) run fla's own
    function."""
    from fusepatch.ops.graphs import GraphedOp

    plain = load_fla(gate_in_kernel=True)
    graphed = GraphedOp(fla_split(), "gated_delta_rule/fla-graphed")

    def gated_delta_rule_fla_graphed(
        q, k, v, a, b, A_log, dt_bias, cu_seqlens=None, initial_state=None, output_final_state: bool = False
    ):
        if initial_state is not None or output_final_state:
            states = dict(initial_state=initial_state, output_final_state=output_final_state)
            return plain(q, k, v, a, b, A_log, dt_bias, cu_seqlens=cu_seqlens, **states)
        if cu_seqlens is not None:
            return plain(q, k, v, a, b, A_log, dt_bias, cu_seqlens=cu_seqlens)
        return graphed(q, k, v, a, b, A_log, dt_bias)

    gated_delta_rule_fla_graphed.graphed = graphed  # for tests and the report: what was captured
    return gated_delta_rule_fla_graphed
