import logging
import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # xdist's workers share the machine's cores: each gets its share of torch threads (and so do the processes it
    # starts). With torch's default, a thread per core in every worker, the threads waited on each other, and
    # tests/test_outputs.py with tests/test_packing.py took 186 s on two cores instead of 10 s.
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))
    torch.set_num_threads(_threads)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run tests/gpu on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fusepatch_logs(caplog):
    caplog.set_level(logging.INFO, logger="fusepatch")
    yield


@pytest.fixture(autouse=True)
def _reasons_not_said_yet():
    """Each test starts as a fresh process would: no fallback reason said yet (fusepatch says each one once)."""
    from fusepatch.core.log import REASONS

    REASONS.reset()
    yield


@pytest.fixture(autouse=True)
def _no_disable(monkeypatch):
    monkeypatch.delenv("FUSEPATCH_DISABLE", raising=False)
    monkeypatch.delenv("FUSEPATCH_PREFER", raising=False)


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    """CPU tests draw their random inputs from a seed fixed per test (its node id), not from whatever the global
    generator holds after the tests that ran before it in the same xdist worker: the same draw on every run and
    every worker layout. GPU tests keep fresh draws (the H200 run checks kernels on new inputs each time)."""
    if "gpu" not in request.keywords:
        import zlib

        torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield


ALL_DTYPES = ("bfloat16", "float16", "float32", "float64")  # fp64: the output-field tests compare at fp64 rounding


def cpu_candidates(monkeypatch, kernels: dict, *, name: str = "cpu-standin") -> list[tuple]:
    """Each op named in ``kernels`` gets one more candidate, first in its list: ``name``, accepting CPU tensors of
    every dtype and running ``kernels[op]`` (a torch function with the op's signature). The dispatcher then picks
    a non-eager candidate on the CPU, so the layers take the paths they take with a GPU kernel. Returns the list
    each call appends ``(op, dtype, shape)`` of its first tensor argument to (the self-test's calls included)."""
    import dataclasses
    import functools

    from fusepatch.core import selftest
    from fusepatch.core.op import Candidate
    from fusepatch.core.requirements import InputRule
    from fusepatch.ops import OPS

    seen: list[tuple] = []
    for op_name, kernel in kernels.items():
        op = OPS[op_name]

        def load(kernel=kernel, op_name=op_name):
            @functools.wraps(kernel)
            def standin(*args, **kwargs):
                first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                seen.append((op_name, getattr(first, "dtype", None), tuple(getattr(first, "shape", ()))))
                return kernel(*args, **kwargs)

            return standin

        rule = InputRule(devices=("cpu",), dtypes=ALL_DTYPES, kernel=f"{name} ({op_name})")
        candidate = Candidate(name, "pip", (), load, inputs=rule, provides=f"{kernel.__module__}.{kernel.__qualname__}")
        monkeypatch.setitem(OPS, op_name, dataclasses.replace(op, candidates=(candidate, *op.candidates)))
    selftest.clear_cache()
    return seen


@pytest.fixture
def stand_ins(monkeypatch):
    """Stand-in mode: every op in ``fusepatch.ops.OPS`` gets a CPU candidate running its own torch reference, and
    the layers' fused paths that are gated to GPUs (the shared-input projections, the GDN input split's copy) run on
    the CPU too: a patched model on the CPU runs the code a GPU runs, with the kernels swapped for their
    references. Returns the list of the stand-ins' calls (``cpu_candidates``)."""
    from fusepatch.layers import gated_deltanet
    from fusepatch.layers.support import projections
    from fusepatch.ops import OPS

    seen = cpu_candidates(monkeypatch, {name: op.reference for name, op in OPS.items()})
    monkeypatch.setattr(projections, "DEVICES", (*projections.DEVICES, "cpu"))
    monkeypatch.setattr(gated_deltanet, "COPY_DEVICES", (*gated_deltanet.COPY_DEVICES, "cpu"))
    yield seen
    from fusepatch.core import selftest

    selftest.clear_cache()


@pytest.fixture
def chunked_on_cpu(monkeypatch):
    """The fused causal-LM loss on CPU: the GPU-only ``torch-chunked`` loss, as a candidate that accepts CPU tensors."""
    from fusepatch.ops.linear_cross_entropy import linear_cross_entropy_chunked

    cpu_candidates(monkeypatch, {"linear_cross_entropy": linear_cross_entropy_chunked}, name="torch-chunked")


@pytest.fixture
def calls(monkeypatch):
    """Every add-norm op gets a CPU stand-in candidate, so that the fused decoder forward (the residual add in the
    norm, the MLP's residual in its down projection) runs on the CPU; returns the list its calls append to."""
    from helpers import ADD_OPS

    from fusepatch.core import selftest
    from fusepatch.ops import OPS

    yield cpu_candidates(monkeypatch, {name: OPS[name].reference for name in ADD_OPS})
    selftest.clear_cache()
