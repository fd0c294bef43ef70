"""The engine: environment, requirements, op and candidate values, self-test, dispatch, registry, patch, report."""
