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


@pytest.fixture
def chunked_on_cpu(monkeypatch):
    """The fused causal-LM loss on CPU: the GPU-only ``torch-chunked`` candidate let accept CPU tensors, alone."""
    import dataclasses

    from fusepatch.core import selftest
    from fusepatch.core.requirements import InputRule
    from fusepatch.ops import OPS

    op = OPS["linear_cross_entropy"]
    chunked = next(c for c in op.candidates if c.name == "torch-chunked")
    dtypes = ("bfloat16", "float16", "float32", "float64")  # fp64: the output-field tests compare at fp64 rounding
    cpu = dataclasses.replace(chunked, inputs=InputRule(devices=("cpu", "cuda"), dtypes=dtypes, kernel="chunked CE"))
    monkeypatch.setitem(OPS, "linear_cross_entropy", dataclasses.replace(op, candidates=(cpu,)))
    selftest.clear_cache()


@pytest.fixture
def calls(monkeypatch):
    """Every add-norm op gets a CPU stand-in candidate, so that the fused decoder forward (the residual add in the
    norm, the MLP's residual in its down projection) runs on the CPU; returns the list its calls append to."""
    import dataclasses

    from helpers import ADD_OPS

    from fusepatch.core import selftest
    from fusepatch.core.op import Candidate
    from fusepatch.core.requirements import InputRule
    from fusepatch.ops import OPS

    seen: list[tuple] = []
    for name in ADD_OPS:
        op = OPS[name]

        def load(reference=op.reference, name=name):
            def standin(x, residual, weight, eps):
                seen.append((name, x.dtype, tuple(x.shape)))
                return reference(x, residual, weight, eps)

            return standin

        dtypes = ("bfloat16", "float16", "float32", "float64")
        candidate = Candidate("cpu-standin", "pip", (), load, inputs=InputRule(devices=("cpu",), dtypes=dtypes))
        monkeypatch.setitem(OPS, name, dataclasses.replace(op, candidates=(candidate,)))
    selftest.clear_cache()
    yield seen
    selftest.clear_cache()
