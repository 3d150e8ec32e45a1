"""Test-session settings that must hold before any test module is imported."""

import os

# Triton reads TRITON_INTERPRET when it is first imported, and torch imports it early (CommDebugMode does), so
# the Triton kernels' CPU tests need it set here, before collection imports anything.
os.environ.setdefault("TRITON_INTERPRET", "1")
