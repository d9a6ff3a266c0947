"""tailserve.quality: the quality gate: a fast weight format against the fp32 reference on held-out
text (perplexity, top-1 agreement), its cached verdicts and `tailserve eval`. Runs runners, never serves.
"""
