"""Triton's interpreter with a dot whose per-element sum does not depend on the element's
place in the tile, for the interpreter tests of the batch-invariant kernels.

The interpreter's ``tl.dot`` is numpy's matmul, i.e. OpenBLAS, whose result for a row
depends on where the row sits in the product (its micro-kernels treat a matrix's edges
differently). A tensor-core tile product has no such dependence, so these tests swap in a
product that sums each element's K products in order (numpy reduces a middle axis of a
C-ordered array slice by slice), whatever the operands' layouts (the persistent kernel's
weight tile arrives transposed): what is compared is then the kernels' own reduction
order. A test module uses it through the root conftest's fixture ``place_free_dot``
(pytestmark = pytest.mark.usefixtures("place_free_dot")), after setting
TRITON_INTERPRET (see test_kernels)."""

import numpy as np
import pytest
from triton.runtime.interpreter import InterpreterBuilder, TensorHandle


def _place_free_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ANN001, ANN202
    """a @ b + d, each element's products over K summed in order."""
    acc = d.data.dtype
    a_, b_ = np.ascontiguousarray(a.data, dtype=acc), np.ascontiguousarray(b.data, dtype=acc)
    products = a_[..., :, :, None] * b_[..., None, :, :]
    return TensorHandle(np.sum(products, axis=-2) + d.data, d.dtype.scalar)


def use_place_free_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    """The place-free dot in the interpreter until the test ends (monkeypatch undoes it)."""
    monkeypatch.setattr(InterpreterBuilder, "create_dot", _place_free_dot)
