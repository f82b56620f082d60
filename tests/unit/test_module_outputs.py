"""runtime/outputs.py: which outputs may hide a tensor a backward enters through ([Note: module
outputs]). A false "may hide" costs memory (the module's parameters stay gathered until the step
ends), a false "holds none" a backward through released parameters."""

from __future__ import annotations

import enum

import numpy as np
import torch

from zero3.runtime.outputs import prepare_output


class _Colour(enum.Enum):
    RED = 1


class _Box:
    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


def test_plain_values_beside_tensors_hide_nothing_and_a_class_of_the_user_s_may():
    x = torch.randn(3, requires_grad=True)
    fired = []
    plain = (x * 2, np.float32(1.5), np.arange(3), _Colour.RED, slice(0, 2), torch.Size([2]), ..., 3, "s", None)
    assert prepare_output(plain, [], lambda *args: fired.append(1))[1]
    assert not prepare_output((x * 3, _Box(x * 4)), [], lambda *args: None)[1]
    held = np.empty(1, dtype=object)
    held[0] = x * 5
    assert not prepare_output([held], [], lambda *args: None)[1]  # numpy holding objects
    plain[0].sum().backward()
    assert fired == [1]
