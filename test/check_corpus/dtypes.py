"""Declared gradient dtypes (ctx.set_output_grad_dtype): a float32 output
whose backward wants float64 and returns float32 (the Function that made
the previous checker raise IndexError), mixed precision, and an invalid
declaration."""
import torch

from ._case import Case, sample


class Float64Backward(torch.autograd.Function):
    """Accumulates the backward in float64 and returns float32 gradients."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        ctx.set_output_grad_dtype(torch.float64)
        return x @ w

    @staticmethod
    def backward(ctx, grad_output):
        x, w = ctx.saved_tensors
        return ((grad_output @ w.double().t()).float(),
                (x.double().t() @ grad_output).float())


class HalfMatmul(torch.autograd.Function):
    """float16 matmul whose gradient arrives in float32."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        ctx.set_output_grad_dtype(torch.float32)
        return x.half() @ w.half()

    @staticmethod
    def backward(ctx, grad_output):
        x, w = ctx.saved_tensors
        return grad_output @ w.t(), x.t() @ grad_output


class DeclaresIntegerGradDtype(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.set_output_grad_dtype(torch.int64)
        return x * 2

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output * 2


def _fails_by_deviation_2(features):
    # Upstream deviation 2 (native declared dtypes): an output without a
    # gradient reaches backward as zeros in the output's dtype, not the
    # declared one, and a backward that relies on the declaration fails.
    return {"gradcheck"} if features["set_output_grad_dtype"] == "native" else set()


def _integer_declaration_fails(features):
    # torch_ctxext rejects the declaration when apply returns (forward fails);
    # native torch accepts it (upstream deviation 1) and the checker's own
    # validation reports it.
    if features["set_output_grad_dtype"] == "native":
        return {"set_output_grad_dtype.valid"}
    return {"forward"}


CASES = [
    Case("declares_float64_returns_float32", "declared dtypes", Float64Backward,
         lambda: (sample(3, 4), sample(4, 2, seed=1)),
         "correct: checked in its own dtypes (float64 copies would change what it does); "
         "on native torch, upstream deviation 2 breaks it", failing=_fails_by_deviation_2,
         needs=("set_output_grad_dtype",)),
    Case("half_matmul_float32_gradient", "declared dtypes (mixed precision)", HalfMatmul,
         lambda: (sample(4, 8), sample(8, 2, seed=1)),
         "correct; on native torch, upstream deviation 2 breaks it",
         failing=_fails_by_deviation_2, needs=("set_output_grad_dtype",)),
    Case("declares_integer_gradient_dtype", "declared dtypes", DeclaresIntegerGradDtype,
         lambda: (sample(3),), "broken: an integer dtype cannot carry a gradient",
         failing=_integer_declaration_fails, needs=("set_output_grad_dtype",)),
]
