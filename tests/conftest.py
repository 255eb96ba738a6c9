"""Shared test setup."""

import os

# Before torch is imported anywhere in the test session: see the note in remat/cli.py.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
