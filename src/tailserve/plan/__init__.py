"""tailserve.plan."""
