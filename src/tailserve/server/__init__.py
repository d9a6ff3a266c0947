"""tailserve.server."""
