import logging
import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # xdist's workers share the machine's cores: each gets its share of torch threads (and so do the processes it
    # starts). With torch's default, a thread per core in every worker, the threads waited on each other, and
    # tests/models/test_outputs.py with tests/layers/test_packing.py took 186 s on two cores instead of 10 s.
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))
    torch.set_num_threads(_threads)


def pytest_collection_modifyitems(config, items):
    # The slow tests (several processes, compiles, the interpreter) first, each file's order kept: on two workers a
    # long test left for the end keeps one worker busy while the other has nothing left to take.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
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
def _fresh_process_state():
    """Each test starts as a fresh process would (nothing said yet, no drift, no user rows or candidates), keeping
    only the self-test verdicts and the environment snapshot, which a process computes once either way."""
    from fusepatch.base.state import ProcessState, current, fresh

    kept = current()
    with fresh(ProcessState(selftests=kept.selftests, environment=kept.environment)) as state:
        yield state


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


from helpers import cpu_candidates  # noqa: E402  (a module of its own name: dynamo traces its stand-ins)


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
    from fusepatch.engine import selftest

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

    from fusepatch.engine import selftest
    from fusepatch.ops import OPS

    yield cpu_candidates(monkeypatch, {name: OPS[name].reference for name in ADD_OPS})
    selftest.clear_cache()


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """Every op's reference as a CPU candidate (FP8 aside), and the projections' and the Gated DeltaNet's fused
    paths allowed on the CPU: the layers take the paths they take with GPU kernels."""
    from fusepatch.engine import selftest
    from fusepatch.layers import gated_deltanet
    from fusepatch.layers.support import projections
    from fusepatch.ops import OPS
    from fusepatch.ops.linear_cross_entropy import linear_cross_entropy_chunked

    cpu_candidates(monkeypatch, {name: op.reference for name, op in OPS.items() if name != "fp8_linear"})
    cpu_candidates(monkeypatch, {"linear_cross_entropy": linear_cross_entropy_chunked}, name="torch-chunked")
    monkeypatch.setattr(projections, "DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(gated_deltanet, "COPY_DEVICES", ("cpu", "cuda"))
    yield
    selftest.clear_cache()
