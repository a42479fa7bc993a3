"""mtpserve engine/bundled."""
