"""Candidates on fla's public chunked delta rule: its function as exported (gate inside or outside the kernel),
and the same replayed from CUDA graphs."""

from __future__ import annotations

import torch

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
