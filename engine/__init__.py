"""mtpserve engine."""
