"""The bundled model: a small trained Qwen3.5-architecture hybrid with an MTP head (see README.md here)."""

from pathlib import Path

MODEL_DIR = Path(__file__).resolve().parent / "model"
BUNDLED_MODEL_REF = "mtpserve:bundled"     # what a Serve app sends for it: each node reads its own install's copy


def resolve_model_dir(model_dir: str) -> str:
    """The model folder on this node: ``BUNDLED_MODEL_REF`` is this install's bundled model (on a
    cluster the deploying machine's install path need not exist on the node a replica runs on)."""
    return str(MODEL_DIR) if model_dir == BUNDLED_MODEL_REF else model_dir

