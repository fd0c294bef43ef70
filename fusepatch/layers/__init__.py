"""Replacement forwards: each reads its op dispatchers from ``self._fusepatch`` and chooses per call."""
