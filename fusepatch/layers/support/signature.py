"""Layer forwards' argument names, read from the class once: the names transformers releases give them drift
(the cache is ``past_key_values`` in 5.17 and ``cache`` later; the linear-attention mixer's ``cache_params`` /
``cache``), so the forwards fusepatch runs look them up instead of assuming one release."""

from __future__ import annotations

import inspect

CACHE_NAMES = ("cache", "past_key_values")  # the cache argument, newest release's name first

# A per-class memo as a plain dict, not functools.cache: torch.compile traces through a cache wrapper (and warns),
# and would re-read the signature on every trace.
_PARAMETERS: dict[type, tuple[str, ...]] = {}


def forward_parameters(cls: type) -> tuple[str, ...]:
    """The named parameters of ``cls.forward`` after ``self`` (not ``*args`` / ``**kwargs``): the release's own
    signature, since fusepatch patches instances, not the class."""
    found = _PARAMETERS.get(cls)
    if found is None:
        variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        parameters = list(inspect.signature(cls.forward).parameters.values())[1:]
        found = _PARAMETERS[cls] = tuple(p.name for p in parameters if p.kind not in variadic)
    return found
