"""The package version, importable from inside the package without importing its public API
(ember_cupy/__init__.py imports the engine, which reports the version)."""
__version__ = "0.1.0"
