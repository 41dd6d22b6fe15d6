"""Forward mode and vmap: a setup_context Function with save_for_forward, a
jvp and generate_vmap_rule, and its two classic mistakes."""
import torch

from ._case import Case, sample


class Mul(torch.autograd.Function):
    """x * y in both modes; vmap generated from the torch operations."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, y):
        return x * y

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, y = inputs
        ctx.save_for_backward(x, y)
        ctx.save_for_forward(x, y)

    @staticmethod
    def backward(ctx, grad_output):
        x, y = ctx.saved_tensors
        return grad_output * y, grad_output * x

    @staticmethod
    def jvp(ctx, x_tangent, y_tangent):
        x, y = ctx.saved_tensors
        return x_tangent * y + x * y_tangent


class MulJvpDropsTerm(Mul):
    """The product rule with one term: right only when y is constant."""

    @staticmethod
    def jvp(ctx, x_tangent, y_tangent):
        x, y = ctx.saved_tensors
        return x_tangent * y


class Exp(torch.autograd.Function):
    """torch's own docstring example; twice differentiable; no jvp."""

    @staticmethod
    def forward(ctx, i):
        result = i.exp()
        ctx.save_for_backward(result)
        return result

    @staticmethod
    def backward(ctx, grad_output):
        (result,) = ctx.saved_tensors
        return grad_output * result


class ExpSavedForBackwardOnly(Exp):
    """Saves the result with save_for_backward only, and jvp reads it."""

    @staticmethod
    def jvp(ctx, x_tangent):
        (result,) = ctx.saved_tensors
        return x_tangent * result


def _xy():
    return (sample(2, 3), sample(2, 3, seed=1))


CASES = [
    Case("mul_jvp_and_generated_vmap", "jvp / generate_vmap_rule", Mul, _xy,
         "correct in both modes, batched and per sample"),
    Case("mul_jvp_drops_product_rule_term", "jvp / generate_vmap_rule", MulJvpDropsTerm, _xy,
         "broken jvp (backward is right)",
         failing={"jvp.finite_differences", "jvp.matches_backward"},
         subjects={"jvp.finite_differences": "input 1 (y), output 0"}),
    Case("exp_jvp_without_save_for_forward", "jvp (save_for_forward)",
         ExpSavedForBackwardOnly, lambda: (sample(4),),
         "broken: jvp finds nothing in ctx.saved_tensors", failing={"jvp.save_for_forward"}),
]
