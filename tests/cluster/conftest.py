"""Serving fixtures shared with tests/actors (see tests/actors/serving_fixtures.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "actors"))
from serving_fixtures import ray_cluster  # noqa: E402,F401
