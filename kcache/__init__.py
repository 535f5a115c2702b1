"""kcache: warm starts for GPU inference services.

Fingerprint the machine and workload, pack compiled-kernel caches into a content-addressed store
indexed in SQL, and restore the matching bundle before the model loads. See docs/design.md.
"""

__version__ = "0.1.0"
