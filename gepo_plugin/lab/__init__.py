"""CPU lab: reproduces GEPO's stability claims at laptop scale.

Each module recomputes one of the paper's toy experiments without a GPU (closed forms or small
simulations), so the claims can be checked, quantified and re-plotted on a laptop.
"""
