"""Serving fixtures (see serving_fixtures.py): ray_cluster."""
from serving_fixtures import ray_cluster  # noqa: F401
