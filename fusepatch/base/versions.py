"""Version arithmetic on installed packages' version strings."""

from __future__ import annotations

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version


def version_in(version: str, spec: str) -> bool:
    """Whether ``version`` satisfies ``spec`` (local labels such as ``+cu130`` ignored; pre-releases allowed)."""
    try:
        parsed = Version(version.split("+")[0])
        return SpecifierSet(spec).contains(parsed, prereleases=True)
    except (InvalidVersion, InvalidSpecifier):
        return False
