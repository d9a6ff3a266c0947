"""tailserve.plan: capacity arithmetic, the GPU catalog and the read-only host doctor.

Imports nothing heavy (no torch, numpy, transformers); `tailserve plan` must start instantly.
"""
