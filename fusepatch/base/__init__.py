"""Values and helpers every other layer builds on: environment facts, versions, dtypes, option checks, the op and
candidate types, requirements and known-bad stacks, the registry's row type, logging. Nothing here imports from
the rest of fusepatch."""
