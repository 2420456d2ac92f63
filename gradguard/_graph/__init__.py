"""Autograd graph inspection: what a graph pins, which parameters it reaches, whether it can still be backwarded."""
