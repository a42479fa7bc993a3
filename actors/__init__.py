"""mtpserve actors."""
