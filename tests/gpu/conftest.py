import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def require(verdict, what: str):
    """Skip when a kernel package is absent, unless FUSEPATCH_GPU_REQUIRE=1 (the H200 run), where it fails."""
    if verdict.ok:
        return
    message = f"{what}: {verdict.reason}"
    if os.environ.get("FUSEPATCH_GPU_REQUIRE") == "1":
        pytest.fail(message)
    pytest.skip(message)
