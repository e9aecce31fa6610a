"""autocast_casts_kept (moe_lc/train/step.py): autocast's casts of the weights made once for a step's
micro-batches instead of once each, with bitwise the same gradients, and made again next step."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_lc.train.step import autocast_casts_kept


class _WeightCasts(TorchDispatchMode):
    """Counts dtype casts of tensors shaped like ``shape`` (a weight and its gradient), forward and backward."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape, self.forward, self.backward = shape, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) == self.shape:
            if (kwargs or {}).get("dtype") == torch.bfloat16:
                self.forward += 1
            else:
                self.backward += 1
        return func(*args, **(kwargs or {}))


class _AutocastSeenInBackward(torch.autograd.Function):
    seen: list = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _AutocastSeenInBackward.seen.append(torch.is_autocast_enabled("cpu"))
        return grad


def _step(model: torch.nn.Module, micro_batches: int, keep: bool, counter: _WeightCasts) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with counter, autocast_casts_kept("cpu", keep):
        for i in range(micro_batches):
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(i)).requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = model(_AutocastSeenInBackward.apply(x))
            (y.float().square().sum() / micro_batches).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_weights_cast_once_a_step_with_the_same_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
    plain, kept = _WeightCasts((8, 6)), _WeightCasts((8, 6))
    _AutocastSeenInBackward.seen.clear()
    reference = _step(model, 3, False, plain)
    grads = _step(model, 3, True, kept)
    assert (plain.forward, plain.backward) == (3, 3)  # a cast per micro-batch each way
    assert (kept.forward, kept.backward) == (1, 3)  # one cast for the step; every backward casts its share back
    for a, b in zip(reference, grads):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    assert _AutocastSeenInBackward.seen == [False] * 6  # the backward never runs under autocast

    again = _WeightCasts((8, 6))
    with torch.no_grad():
        model[0].weight.add_(1.0)  # the optimizer's update between steps
    _step(model, 2, True, again)
    assert again.forward == 1  # the next step casts the updated weight afresh
    expected = _step(model, 2, False, _WeightCasts((8, 6)))
    assert all(torch.equal(a, b.grad) for a, b in zip(expected, model.parameters()))


def test_disabled_keeps_nothing():
    model = torch.nn.Linear(6, 8)
    counter = _WeightCasts((8, 6))
    _step(model, 2, False, counter)
    assert counter.forward == 2 and not torch.is_autocast_enabled("cpu")
