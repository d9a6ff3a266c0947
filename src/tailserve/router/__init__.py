"""tailserve.router."""
