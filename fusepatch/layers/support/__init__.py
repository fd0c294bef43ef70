"""Helpers the replacement forwards share: packed-row boundaries, plain positions, labelled rows, projections,
forward signatures, and the module-level names a patched layer holds."""
