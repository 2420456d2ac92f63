"""The contract every engine adapter meets, in the spirit of OpenTelemetry's ``BaseInstrumentor``.

An adapter names the engine modules whose import it waits for, the distribution whose version it
reports and the versions it supports, and patches/restores one imported module at a time.
``gradguard.enforce()`` registers post-import hooks for ``modules``, so the engine may be imported
before or after entering; ``gradguard doctor`` prints ``supported`` beside the version found.
"""

from __future__ import annotations

import abc
from importlib import metadata
from types import ModuleType
from typing import ClassVar

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

__all__ = ["Adapter"]


class Adapter(abc.ABC):
    """One engine adapter. Subclasses set the class attributes and implement the two methods.

    Attributes:
        name: The engine's name, as ``enforce(engines=...)`` takes it.
        modules: The modules whose import the adapter waits for.
        package: The distribution whose version :meth:`version` reports.
        supported: The versions the adapter is written and tested for, as a PEP 440 specifier.
    """

    name: ClassVar[str]
    modules: ClassVar[tuple[str, ...]]
    package: ClassVar[str]
    supported: ClassVar[str]

    @abc.abstractmethod
    def instrument(self, module: ModuleType) -> None:
        """Patch ``module``, with wrapt. Idempotent.

        Args:
            module: One of :attr:`modules`, imported.
        """

    @abc.abstractmethod
    def uninstrument(self, module: ModuleType) -> None:
        """Put back exactly the objects :meth:`instrument` replaced in ``module``.

        Args:
            module: A module :meth:`instrument` patched.
        """

    def version(self) -> str | None:
        """The installed version of :attr:`package`.

        Returns:
            The version string, or ``None`` when the package is not installed.
        """
        try:
            return metadata.version(self.package)
        except metadata.PackageNotFoundError:
            return None

    def supports(self, version: str) -> bool | None:
        """Whether a version of :attr:`package` is one the adapter supports.

        Args:
            version: A version string, e.g. :meth:`version`'s.

        Returns:
            Whether ``version`` is in :attr:`supported` (pre-releases included); ``None`` when it is not
            a version string ``packaging`` can read.
        """
        try:
            return Version(version) in SpecifierSet(self.supported, prereleases=True)
        except InvalidVersion:
            return None
