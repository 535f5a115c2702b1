"""`python -m kcache` runs the CLI (the same as the `kcache` script)."""

from kcache.cli import run

run()
