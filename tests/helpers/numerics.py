"""The numbers tests judge by: the relative error against a reference, and the
chi-square tail probability the sampling tests compare distributions with."""

import math

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b|: our tolerance metric against the reference b."""
    return ((a - b).abs().max() / b.abs().max()).item()


def chi2_p_value_even_df(stat: float, df: int) -> float:
    """P(X > stat) for a chi-square variable with even df (closed form)."""
    m, x = df // 2, stat / 2
    return math.exp(-x) * sum(x**i / math.factorial(i) for i in range(m))
