"""This release's version (``pyproject.toml`` states the same one; tests/test_layout.py checks)."""

__version__ = "0.2.0"
