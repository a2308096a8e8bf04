"""The package version (exported files and the executor record it)."""
__version__ = "0.1.0"
