"""mtpserve cluster."""
