"""The engine on top of ops, layers and models: the process state, candidate resolution, self-tests, the
registry, ``apply`` and its report."""
