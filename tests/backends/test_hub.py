"""The Kernel Hub source end to end, offline, with local kernel directories the tests build themselves
(pure-Python noarch ``torch-cpu`` variants), including kernels that raise, return wrong values, or have no
build variant for this machine; plus the lock file and the publisher trust rule."""

from __future__ import annotations

import json
import uuid

import pytest
import torch

import fusepatch
from fusepatch.backends.kernels_hub import HubKernel, TrustedPublisher, hub_candidate, locked_commit, variant_trace
from fusepatch.base.env import capture
from fusepatch.base.requirements import InputRule
from fusepatch.engine import selftest
from fusepatch.engine.resolve import static_verdict
from fusepatch.ops import OPS
from fusepatch.tools.tiny import tiny_model

kernels = pytest.importorskip("kernels")
CPU = InputRule(devices=("cpu",), dtypes=("float32",), kernel="test kernel")
GOOD = "import torch\ndef swiglu(gate, up):\n    return torch.nn.functional.silu(gate) * up\n"
WRONG = "import torch\ndef swiglu(gate, up):\n    return torch.sigmoid(gate) * up\n"
RAISES = "def swiglu(gate, up):\n    raise RuntimeError('CUDA error: no kernel image is available for execution on the device')\n"


def make_kernel(root, body: str, variant: str = "torch-cpu", backend: str = "cpu"):
    name = f"fp-test-{uuid.uuid4().hex[:8]}"  # kernels caches modules by id: one per kernel
    folder = root / name / "build" / variant
    folder.mkdir(parents=True)
    metadata = {
        "name": name,
        "id": name,
        "version": 1,
        "license": "Apache-2.0",
        "backend": {"type": backend},
        "python-depends": [],
    }
    (folder / "metadata.json").write_text(json.dumps(metadata))
    (folder / "__init__.py").write_text(body)
    return root / name


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    monkeypatch.delenv("FUSEPATCH_KERNELS_LOCK", raising=False)
    monkeypatch.delenv("FUSEPATCH_TRUST_KERNELS", raising=False)
    monkeypatch.setitem(OPS, "swiglu", OPS["swiglu"])  # restored after each test
    selftest.clear_cache()


def _use(monkeypatch, **repos):
    monkeypatch.setenv("LOCAL_KERNELS", ":".join(f"{repo}={path}" for repo, path in repos.items()))


def _mlp_choice(model):
    report = fusepatch.apply(model, prefer=("hub", "pip"))
    return next(layer for layer in report.layers if layer.layer == "Qwen3MLP").choices[0]


def test_local_hub_kernel_is_loaded_self_tested_and_reported(tmp_path, monkeypatch):
    _use(monkeypatch, **{"acme/swiglu": make_kernel(tmp_path, GOOD)})
    fusepatch.add_candidate("swiglu", hub_candidate(HubKernel("acme/swiglu", "swiglu"), inputs=CPU))
    model = tiny_model("qwen3")
    ids = torch.randint(0, 512, (2, 20))
    expected = model(input_ids=ids).logits
    choice = _mlp_choice(model)
    assert choice.chosen == "hub:acme/swiglu" and choice.source == "hub"
    assert choice.provides == "acme/swiglu:swiglu" and choice.origin.startswith("local ")
    torch.testing.assert_close(model(input_ids=ids).logits, expected)


@pytest.mark.parametrize(
    "body, reason",
    [(RAISES, "raised RuntimeError: CUDA error: no kernel image"), (WRONG, "differs from the reference")],
)
def test_faulty_hub_kernels_are_rejected_and_the_next_candidate_used(tmp_path, monkeypatch, body, reason):
    _use(monkeypatch, **{"acme/bad": make_kernel(tmp_path, body), "acme/good": make_kernel(tmp_path, GOOD)})
    fusepatch.add_candidate("swiglu", hub_candidate(HubKernel("acme/good", "swiglu"), inputs=CPU))
    fusepatch.add_candidate("swiglu", hub_candidate(HubKernel("acme/bad", "swiglu"), inputs=CPU))
    choice = _mlp_choice(tiny_model("qwen3"))
    assert choice.chosen == "hub:acme/good"
    bad = next(r for r in choice.rejected if r.candidate == "hub:acme/bad")
    assert reason in bad.reason


def test_variant_mismatch_is_rejected_with_the_variant_trace(tmp_path, monkeypatch):
    path = make_kernel(tmp_path, GOOD, variant="torch29-cxx11-cu126-x86_64-linux", backend="cuda")
    _use(monkeypatch, **{"acme/cuda-only": path})
    trace = variant_trace(path)
    assert len(trace) == 1 and trace[0].startswith("torch29-cxx11-cu126-x86_64-linux: ")
    fusepatch.add_candidate("swiglu", hub_candidate(HubKernel("acme/cuda-only", "swiglu"), inputs=CPU))
    choice = _mlp_choice(tiny_model("qwen3"))
    assert choice.chosen == "eager"
    rejection = next(r for r in choice.rejected if r.candidate == "hub:acme/cuda-only")
    assert "no build variant of acme/cuda-only fits this machine" in rejection.reason
    assert "torch29-cxx11-cu126-x86_64-linux:" in rejection.reason


def test_untrusted_publisher_needs_an_opt_in(monkeypatch):
    verdict = TrustedPublisher("acme/swiglu").check(None)
    assert not verdict.ok and "FUSEPATCH_TRUST_KERNELS=acme/swiglu" in verdict.fix
    assert TrustedPublisher("kernels-community/activation").check(None).ok
    monkeypatch.setenv("FUSEPATCH_TRUST_KERNELS", "acme/swiglu,other/x")
    assert TrustedPublisher("acme/swiglu").check(None).ok


def test_untrusted_hub_kernel_is_not_loaded(monkeypatch):
    fusepatch.add_candidate("swiglu", hub_candidate(HubKernel("acme/swiglu", "swiglu"), inputs=CPU))
    choice = _mlp_choice(tiny_model("qwen3"))
    rejection = next(r for r in choice.rejected if r.candidate == "hub:acme/swiglu")
    assert "not a trusted kernel publisher" in rejection.reason and "FUSEPATCH_TRUST_KERNELS" in rejection.fix


def test_lock_file_pins_the_commit_and_loads_only_from_the_cache(tmp_path, monkeypatch):
    from kernels._rust import KernelDependency, KernelLock, KernelLocks, KernelVersion

    commit = "0123456789abcdef0123456789abcdef01234567"
    lockfile = tmp_path / "kernels.lock"
    locks = KernelLocks(
        {KernelDependency("kernels-community/activation", KernelVersion.Version(1)): KernelLock(commit)}
    )
    lockfile.write_text(locks.to_json())
    assert locked_commit("kernels-community/activation", lockfile) == commit
    assert locked_commit("kernels-community/other", lockfile) is None
    monkeypatch.setenv("FUSEPATCH_KERNELS_LOCK", str(lockfile))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))
    kernel = HubKernel("kernels-community/activation", "silu_and_mul")
    assert kernel.where() == f"locked {commit} ({lockfile})"
    fusepatch.add_candidate("swiglu", hub_candidate(kernel, name="hub:locked", inputs=CPU))
    choice = _mlp_choice(tiny_model("qwen3"))
    rejection = next(r for r in choice.rejected if r.candidate == "hub:locked")
    assert rejection.reason.startswith("loading failed:")  # not in the local cache, and never downloaded


def test_add_candidate_validates():
    with pytest.raises(ValueError, match="unknown op"):
        fusepatch.add_candidate("nope", hub_candidate(HubKernel("a/b", "f")))
    fusepatch.add_candidate("swiglu", hub_candidate(HubKernel("a/b", "f")))
    with pytest.raises(ValueError, match="already has a candidate"):
        fusepatch.add_candidate("swiglu", hub_candidate(HubKernel("a/b", "f")))


def test_installed_package_with_an_abi_error_reports_the_import_error(tmp_path, monkeypatch):
    """A pip-style package that is installed (its dist-info is there) but whose import fails."""
    from fusepatch.base.op import Candidate
    from fusepatch.base.requirements import DistributionVersion, Importable

    package = tmp_path / "fp_broken_kernels"
    package.mkdir()
    (package / "__init__.py").write_text(
        "raise ImportError('fp_broken_kernels/_C.so: undefined symbol: _ZN3c104cuda9SetDeviceEa')\n"
    )
    info = tmp_path / "fp_broken_kernels-2.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fp-broken-kernels\nVersion: 2.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    candidate = Candidate(
        name="fp-broken",
        source="pip",
        requirements=(
            DistributionVersion("fp-broken-kernels", ">=1"),
            Importable("fp_broken_kernels", "fp-broken-kernels"),
        ),
        load=lambda: None,
        inputs=CPU,
    )
    fusepatch.add_candidate("swiglu", candidate)
    choice = _mlp_choice(tiny_model("qwen3"))
    rejection = next(r for r in choice.rejected if r.candidate == "fp-broken")
    assert "fp-broken-kernels 2.0 is installed but import fp_broken_kernels fails" in rejection.reason
    assert "undefined symbol" in rejection.reason and "--force-reinstall" in rejection.fix


# A stand-in for the Kernel Hub build of Dao-AILab's causal-conv1d: the same entry point and arguments
# (x [B, D, T], weight [D, W], bias, seq_idx [B, T], activation), written in torch.
CAUSAL_CONV1D_HUB = """
import torch
import torch.nn.functional as F

def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    dim, width = weight.shape
    out = torch.zeros_like(x)
    for shift in range(width):
        shifted = F.pad(x, (shift, 0))[..., : x.shape[-1]]
        if seq_idx is not None:
            same = F.pad(seq_idx, (shift, 0), value=-1)[..., : x.shape[-1]] == seq_idx
            shifted = shifted * same[:, None, :].to(x.dtype)
        out = out + shifted * weight[:, width - 1 - shift, None]
    if bias is not None:
        out = out + bias[:, None]
    return F.silu(out) if activation in ("silu", "swish") else out
"""


@pytest.mark.parametrize("packed", [False, True, "from-position-ids"], ids=["dense", "packed", "host-values"])
def test_builtin_hub_causal_conv1d_candidate_adapts_the_hub_entry_point(tmp_path, monkeypatch, packed):
    """The registry's kernels-community/causal-conv1d candidate, loaded from a local directory (offline), maps
    the op's channels-last call and packed boundaries (cu_seqlens -> seq_idx) onto the Hub kernel's API."""
    op = OPS["causal_conv1d"]
    candidate = next(c for c in op.candidates if c.name == "hub:kernels-community/causal-conv1d")
    assert candidate.source == "hub" and candidate.where() == "hub version 1"
    _use(monkeypatch, **{"kernels-community/causal-conv1d": make_kernel(tmp_path, CAUSAL_CONV1D_HUB)})
    assert candidate.where().startswith("local ")  # asked when chosen: LOCAL_KERNELS set after import counts
    fn = candidate.load()
    x, weight = torch.randn(1, 50, 12, dtype=torch.float64), torch.randn(12, 4, dtype=torch.float64)
    cu = torch.tensor([0, 17, 18, 50], dtype=torch.int32) if packed else None
    if packed == "from-position-ids":  # boundaries that carry their host values: seq_idx built on the host, kept
        from fusepatch.layers.support.packing import cu_seqlens_from_position_ids
        from fusepatch.ops.boundaries import host_values

        cu = cu_seqlens_from_position_ids(torch.cat([torch.arange(n) for n in (17, 1, 32)])[None])
        assert host_values(cu) == (0, 17, 18, 50)
    expected = op.reference(x, weight, None, activation="silu", cu_seqlens=cu)
    torch.testing.assert_close(fn(x, weight, None, activation="silu", cu_seqlens=cu), expected)
    if packed:
        from fusepatch.ops.causal_conv1d import sequence_index

        seq_idx = sequence_index(cu, 50, x.device)
        assert seq_idx.tolist() == [[0] * 17 + [1] + [2] * 32] and seq_idx.dtype == torch.int32
        # kept on boundaries with host values (every layer's call shares it), built again for the others
        assert (sequence_index(cu, 50, x.device) is seq_idx) == (packed == "from-position-ids")
    # on this CPU machine the checks refuse it before any load, with the reason
    verdict, _ = static_verdict(candidate, capture(refresh=True))
    assert not verdict.ok and "CPU-only" in verdict.reason


def test_offline_and_not_cached_names_the_download_as_the_fix(tmp_path, monkeypatch):
    """The H200 run (no network): a trusted Hub kernel absent from the local cache is refused with how to get
    it there, and the next candidate is used."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hf-home" / "hub"))
    repo = "kernels-community/fp-test-not-cached"
    fusepatch.add_candidate("swiglu", hub_candidate(HubKernel(repo, "swiglu"), inputs=CPU))
    choice = _mlp_choice(tiny_model("qwen3"))
    rejection = next(r for r in choice.rejected if r.candidate == f"hub:{repo}")
    assert "not in the local Hugging Face cache and offline mode is set" in rejection.reason
    assert f"kernels.get_kernel('{repo}', version=1)" in rejection.fix and "LOCAL_KERNELS=" in rejection.fix
    assert choice.chosen != f"hub:{repo}"
