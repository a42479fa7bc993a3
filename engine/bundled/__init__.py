"""The bundled model: a small trained Qwen3.5-architecture hybrid with an MTP head (see README.md here)."""

from pathlib import Path

MODEL_DIR = Path(__file__).resolve().parent / "model"

