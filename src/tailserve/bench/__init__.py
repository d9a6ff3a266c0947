"""tailserve.bench."""
