"""Checks that run inside gloo workers, shared by the dist tests.

The tests register their modules (and this one) with cloudpickle by value, so the
workers never import the test modules, and pytest with them (0.2 s a rank).  Code
that runs in a worker therefore checks with :func:`check`, not a bare ``assert``,
which pytest would rewrite into a call into pytest.
"""
import sys

import cloudpickle
import torch

cloudpickle.register_pickle_by_value(sys.modules[__name__])

ATOL = RTOL = 1e-5
"""fp32 tolerance of the layer and block comparisons."""


def check(condition, message):
    if not condition:
        raise AssertionError(message)


def backward(y, dy):
    """``y.backward(dy)``, as the scalar ``(y * dy).sum()``: the same gradient, bit for bit."""
    (y * dy).sum().backward()


def close(actual, expected, what, atol=ATOL, rtol=RTOL):
    """Closeness ``|a - b| <= atol + rtol |b|`` (fp32's by default), with a message naming the
    worst difference."""
    check(actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if not torch.allclose(actual, expected, atol=atol, rtol=rtol):
        worst = (actual - expected).abs().max().item()
        raise AssertionError(f"{what}: max |difference| {worst:.3g} exceeds atol={atol}, rtol={rtol}")
