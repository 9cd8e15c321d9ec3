"""The package version, the one source: ``pyproject.toml`` reads it (setuptools ``attr``, parsed
without importing the package) and every module that records it imports it from here."""

__version__ = "0.1.0"
