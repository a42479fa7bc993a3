"""The tiny checkpoint/export fixtures moved to tests/conftest.py (tests/cluster uses them too)."""
