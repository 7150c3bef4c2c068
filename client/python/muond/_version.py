"""The one home of the client package's version (pyproject.toml reads it)."""
__version__ = "0.21.0"
