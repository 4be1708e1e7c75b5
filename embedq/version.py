"""The package version (one place; imported by the modules that record it)."""

__version__ = "0.1.0"
