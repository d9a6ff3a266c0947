"""tailserve.model."""
