"""Several outputs, some of them not tensors: backward receives None for
those, and each output's gradient must be right on its own."""
import torch

from ._case import Case, sample


class Moments(torch.autograd.Function):
    """Mean and (population) variance over the last dimension, the number
    of elements and a label."""

    @staticmethod
    def forward(ctx, x):
        n = x.shape[-1]
        mean = x.mean(-1)
        var = ((x - mean[..., None]) ** 2).mean(-1)
        ctx.save_for_backward(x, mean)
        return mean, var, n, "moments"

    @staticmethod
    def backward(ctx, grad_mean, grad_var, _n, _label):
        x, mean = ctx.saved_tensors
        n = x.shape[-1]
        centred = x - mean[..., None]
        return grad_mean[..., None] / n + grad_var[..., None] * 2 * centred / n


class MomentsVarianceOffByTwo(Moments):
    @staticmethod
    def backward(ctx, grad_mean, grad_var, _n, _label):
        x, mean = ctx.saved_tensors
        n = x.shape[-1]
        centred = x - mean[..., None]
        return grad_mean[..., None] / n + grad_var[..., None] * centred / n


CASES = [
    Case("moments_with_non_tensor_outputs", "multiple outputs with non-tensor values",
         Moments, lambda: (sample(2, 5),), "correct"),
    Case("moments_variance_gradient_halved", "multiple outputs with non-tensor values",
         MomentsVarianceOffByTwo, lambda: (sample(2, 5),),
         "broken: the variance's gradient lacks its factor 2",
         failing={"gradcheck"}, subjects={"gradcheck": "input 0 (x), output 1"}),
]
