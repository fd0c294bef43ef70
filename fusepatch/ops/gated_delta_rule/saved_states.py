"""fla's chunked gated delta rule with its chunk states kept from the forward for the backward.

fla's own autograd function saves only its inputs and the WY matrix ``A``, and its backward first recomputes the
WY keys ``w`` (``recompute_w_u_fwd``) and then the per-chunk states ``h`` and corrected values ``v_new`` (a
sequential scan over the chunks, ``chunk_gated_delta_rule_fwd_h``) before it starts on the gradients. Here the
forward keeps ``w``, ``h`` and ``v_new`` (at the Qwen3.5-27B layer shape, 4096 tokens: 50 + 101 + 50 MB a layer in
bf16) and the backward starts on the gradients at once. The kernels, their order and their inputs are fla's
(fla-core 0.5-0.6, equal-length and packed rows, with or without a cache's states), so the results are fla's: the forward
output bit for bit, the gradients to fla's own run-to-run noise (its backward sums with atomics).

The grouped variant also computes the delta rule's per-token inputs (q/k L2 norms, beta, the chunk-summed decay)
and their gradients in fusepatch's own kernels, one launch each way where fla takes four and six
(kernels/delta_rule_inputs.py): its results are fla's to the fp32 rounding of those inputs, not bit for bit.

Under activation checkpointing the kept tensors live only from a layer's recomputed forward to its backward.
The default is the grouped variant (``load(grouped=True)``, below); ``FUSEPATCH_SKIP=gated_delta_rule/fla-saved-states-grouped``
picks the plain one, and skipping both (comma-separated) picks fla's own function, which recomputes them.
"""

from __future__ import annotations

import torch

from fusepatch.backends.fla import DELTA_RULE_STAGES, check_signatures
from fusepatch.ops.common import on_device

CHUNK = 64
SKIP = "gated_delta_rule/fla-saved-states"
SKIP_GROUPED = "gated_delta_rule/fla-saved-states-grouped"

# fla's functions called here and every keyword fusepatch passes them (backends/fla.py's table;
# tests/ops/gated_delta_rule/test_fla_saved_states.py checks it against the calls): check_signatures refuses an fla-core that lost one
NEEDS = DELTA_RULE_STAGES


def load(grouped: bool = False, fused_inputs: bool = True):
    """The op function (``gated_delta_rule`` signature), after checking fla's functions take what is passed.

    ``grouped``: fla's two backward kernels that produce q/k gradients per value head (``chunk_bwd_dqkwg``,
    ``prepare_wy_repr_bwd``) get q and k expanded to the value heads, so that fla sums nothing in torch, and
    fusepatch's L2-norm backward sums the groups (and adds the two k gradients) in one kernel
    (kernels/l2norm.py). The expansion costs two copies a layer (kernels/heads.py), less GPU time than the three
    torch sums, fla's L2-norm backward and the add it replaces, at the same peak memory. Without grouping (as many
    key as value heads) there
    is nothing to expand: only the L2-norm backward and the add are fused.

    ``fused_inputs`` (grouped only): the per-token inputs (q/k L2 norms, beta, the chunk-summed decay) and their
    gradients in one fusepatch kernel each way instead of fla's four and six launches, where the kernel takes the
    shapes; the tests compare both."""
    from fla.ops.gated_delta_rule import chunk as fla
    from fla.ops.utils.constant import RCP_LN2
    from fla.ops.utils.index import prepare_chunk_indices

    from fusepatch.ops.gated_delta_rule.fla import chunk_table

    check_signatures(fla, NEEDS, SKIP_GROUPED if grouped else SKIP)
    from fusepatch.ops.gated_delta_rule.dqkwg import load as load_dqkwg
    from fusepatch.ops.gated_delta_rule.fla_direct import beta_sigmoid, direct

    chunk_bwd_dqkwg = load_dqkwg(fla.chunk_bwd_dqkwg)  # fla's TileLang kernel with one K block where it runs
    fla = direct(fla, NEEDS)  # past fla's per-call backend dispatch where no other backend could take the call
    fused_beta_sigmoid = beta_sigmoid(fla.fused_beta_sigmoid)  # its kernel's launcher, past the autograd function
    if grouped:
        from fusepatch.kernels.delta_rule_inputs import delta_rule_inputs, delta_rule_inputs_bwd, supported
        from fusepatch.kernels.heads import repeat_heads
        from fusepatch.kernels.l2norm import l2norm_bwd_grouped

    class SavedStates(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cuda")
        def forward(ctx, q, k, v, a, b, A_log, dt_bias, cu_seqlens, chunk_indices, initial_state, output_final_state):
            places = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
            with on_device(q.device):
                q, k, v, a, b = (t.contiguous() for t in (q, k, v, a, b))
                ctx.fused_inputs = grouped and fused_inputs and supported(q, v) is None
                if ctx.fused_inputs:  # the four below in one kernel (kernels/delta_rule_inputs.py)
                    q_n, q_rstd, k_n, k_rstd, beta, g = delta_rule_inputs(
                        q, k, a, b, A_log, dt_bias, scale=RCP_LN2, **places
                    )
                else:
                    q_n, q_rstd = fla.l2norm_fwd(q)
                    k_n, k_rstd = fla.l2norm_fwd(k)
                    beta = fused_beta_sigmoid(b, scale=1.0)
                    # the decay, cumulated within each chunk, in log2 space (fla's kernels use exp2)
                    g = fla.gdn_gate_chunk_cumsum(
                        g=a, A_log=A_log, dt_bias=dt_bias, scale=RCP_LN2, chunk_size=CHUNK, **places
                    )
                w, u, A = fla.chunk_gated_delta_rule_fwd_intra(k=k_n, v=v, g=g, beta=beta, chunk_size=CHUNK, **places)
                # a cache's state: the state each row (document) starts from, and the one after its last token
                h, v_new, final = fla.chunk_gated_delta_rule_fwd_h(
                    k=k_n,
                    w=w,
                    u=u,
                    g=g,
                    initial_state=initial_state,
                    output_final_state=output_final_state,
                    chunk_size=CHUNK,
                    **places,
                )
                del u  # only the scan reads it; v_new is what the output and the backward read
                scale = k.shape[-1] ** -0.5
                o = fla.chunk_fwd_o(q=q_n, k=k_n, v=v_new, h=h, g=g, scale=scale, chunk_size=CHUNK, **places)
            ctx.save_for_backward(
                q_n, q_rstd, k_n, k_rstd, v, a, b, A_log, dt_bias, g, beta, A, w, h, v_new, initial_state
            )
            ctx.places = places
            ctx.scale = scale
            if final is None:  # autograd functions return tensors: an empty one stands for "not asked for"
                final = o.new_empty(0, dtype=torch.float32)
            return o.to(q.dtype), final

        @staticmethod
        @torch.amp.custom_bwd(device_type="cuda")
        def backward(ctx, do, dht):
            q_n, q_rstd, k_n, k_rstd, v, a, b, A_log, dt_bias, g, beta, A, w, h, v_new, h0 = ctx.saved_tensors
            places, scale = ctx.places, ctx.scale
            dht = dht if dht is not None and dht.numel() else None  # the final state's gradient, where it has one
            with on_device(do.device):
                do = do.contiguous()
                dv = fla.chunk_bwd_dv_local(q=q_n, k=k_n, g=g, do=do, scale=scale, chunk_size=CHUNK, **places)
                dh, dh0, dv = fla.chunk_gated_delta_rule_bwd_dhu(
                    q=q_n, k=k_n, w=w, g=g, h0=h0, dht=dht, do=do, dv=dv, scale=scale, chunk_size=CHUNK, **places
                )
                q_e, k_e = q_n, k_n
                groups = v.shape[-2] // q_n.shape[-2]
                if grouped and groups > 1:  # q and k per value head: fla's kernels give their gradients unsummed
                    q_e, k_e = (repeat_heads(t, groups) for t in (q_n, k_n))
                dq, dk, dw, dg = chunk_bwd_dqkwg(
                    q=q_e, k=k_e, v=v_new, w=w, g=g, h=h, dv=dv, do=do, dh=dh, scale=scale, chunk_size=CHUNK, **places
                )
                del dh, q_e
                dk2, dv, dbeta, dg2 = fla.prepare_wy_repr_bwd(k=k_e, v=v, beta=beta, g=g, A=A, dw=dw, du=dv, **places)
                del k_e
                if ctx.fused_inputs:
                    da, db, dA_log, ddt_bias = delta_rule_inputs_bwd(
                        a, b, A_log, dt_bias, dg, dg2, dbeta, q_n.shape[-2], **places
                    )
                else:
                    dg.add_(dg2)
                    dg = fla.chunk_local_cumsum(dg, chunk_size=CHUNK, reverse=True, **places)
                    da, dA_log, ddt_bias = fla.gdn_gate_bwd(g=a, A_log=A_log, dt_bias=dt_bias, dyg=dg)
                    db = fla.fused_beta_sigmoid_bwd(b, dbeta, scale=1.0)
                if grouped:
                    dq = l2norm_bwd_grouped(q_n, q_rstd, dq)
                    dk = l2norm_bwd_grouped(k_n, k_rstd, dk, dk2)
                else:
                    dk.add_(dk2)
                    dq = fla.l2norm_bwd(q_n, q_rstd, dq)
                    dk = fla.l2norm_bwd(k_n, k_rstd, dk)
            grads = (dq, dk, dv, da, db, dA_log, ddt_bias)
            dtypes = (q_n.dtype, k_n.dtype, v.dtype, a.dtype, b.dtype, A_log.dtype, dt_bias.dtype)
            dh0 = None if h0 is None or dh0 is None else dh0.to(h0.dtype)
            return (*(d.to(dtype) for d, dtype in zip(grads, dtypes)), None, None, dh0, None)

    # as fla's own function: torch.compile runs it as it is, without tracing into fla's Python (a graph break)
    @torch.compiler.disable
    def gated_delta_rule_fla_saved_states(
        q, k, v, a, b, A_log, dt_bias, cu_seqlens=None, initial_state=None, output_final_state: bool = False
    ):
        table = None
        if cu_seqlens is not None:
            table = chunk_table(cu_seqlens)
            if table is None:  # boundaries without host values: fla's own table (it reads them on the host)
                table = prepare_chunk_indices(cu_seqlens, CHUNK)
        start = None if initial_state is None else initial_state.float().contiguous()
        out, final = SavedStates.apply(q, k, v, a, b, A_log, dt_bias, cu_seqlens, table, start, output_final_state)
        return (out, final) if output_final_state else out

    return gated_delta_rule_fla_saved_states
