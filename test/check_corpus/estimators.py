"""Functions whose backward is deliberately not the derivative, as
quantization-aware training, binary networks, domain adaptation and VQ-VAEs
write them: straight-through estimators, gradient reversal, gradient
scaling, vector quantization and an in-place fake quantizer. Each states its
intended gradient as a reference written with the ``x + (f(x) - x).detach()``
idiom, whose value is f(x) and whose gradient is the identity's."""
import torch

from ._case import Case, sample


class RoundSTE(torch.autograd.Function):
    """round(x), with the identity as its gradient."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


def round_ste_reference(x):
    return x + (torch.round(x) - x).detach()


class SignSTE(torch.autograd.Function):
    """sign(x) with the hard-tanh straight-through gradient (BinaryConnect):
    passes the gradient where |x| <= 1, zero elsewhere."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.sign(x)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return grad_output * (x.abs() <= 1).to(grad_output.dtype)


class SignSTEWithoutClip(SignSTE):
    """Forgets the |x| <= 1 window the reference states."""

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output.clone()


def sign_ste_reference(x):
    clipped = torch.clamp(x, -1, 1)
    return clipped + (torch.sign(x) - clipped).detach()


class GradientReversal(torch.autograd.Function):
    """Domain-adversarial training: the identity forward, -alpha * g backward."""

    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output.neg() * ctx.alpha, None


class GradientReversalInPlace(GradientReversal):
    """Saves an allocation by negating the incoming gradient in place."""

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output.neg_().mul_(ctx.alpha), None


def gradient_reversal_reference(x, alpha):
    return x.detach() + alpha * (x.detach() - x)


class ScaleGradient(torch.autograd.Function):
    """Identity forward (returns its input), gradient times scale: the
    per-layer gradient scaling of multi-task training."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output * ctx.scale, None


def scale_gradient_reference(x, scale):
    return x.detach() + scale * (x - x.detach())


class VectorQuantize(torch.autograd.Function):
    """VQ-VAE: nearest codebook entry per vector; straight-through to the
    inputs, and each code's gradient is the sum of its vectors' gradients."""

    @staticmethod
    def forward(ctx, inputs, codebook):
        flat = inputs.reshape(-1, codebook.shape[1])
        distances = (
            flat.pow(2).sum(1, keepdim=True) + codebook.pow(2).sum(1) - 2 * flat @ codebook.t()
        )
        indices = distances.argmin(dim=1)
        codes = codebook.index_select(0, indices).view_as(inputs)
        ctx.save_for_backward(indices, codebook)
        ctx.mark_non_differentiable(indices)
        return codes, indices

    @staticmethod
    def backward(ctx, grad_codes, grad_indices):
        indices, codebook = ctx.saved_tensors
        grad_flat = grad_codes.reshape(-1, codebook.shape[1])
        grad_codebook = torch.zeros_like(codebook).index_add_(0, indices, grad_flat)
        return grad_codes.clone(), grad_codebook


def vector_quantize_reference(inputs, codebook):
    flat, table = inputs.detach().reshape(-1, codebook.shape[1]), codebook.detach()
    distances = flat.pow(2).sum(1, keepdim=True) + table.pow(2).sum(1) - 2 * flat @ table.t()
    indices = distances.argmin(dim=1)
    codes = codebook[indices].view_as(inputs)
    return inputs + codes - inputs.detach(), indices


class FakeQuantize_(torch.autograd.Function):
    """4-bit fake quantization of x in place (no copy of large weights), with
    the straight-through gradient."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.mark_dirty(x)
        return x.div_(scale).round_().clamp_(-8, 7).mul_(scale)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class FakeQuantizeForgetsMarkDirty(FakeQuantize_):
    @staticmethod
    def forward(ctx, x, scale):
        return x.div_(scale).round_().clamp_(-8, 7).mul_(scale)


def fake_quantize_reference(x, scale):
    return x + (torch.clamp(torch.round(x / scale), -8, 7) * scale - x).detach()


def _x():
    return (sample(3, 4, scale=2.0),)


_STE = "straight-through estimator: round's gradient is taken as 1"
CASES = [
    Case("round_ste_with_reference", "straight-through estimator", RoundSTE, _x,
         "correct: backward is the intended gradient, which the reference states",
         options=dict(reference=round_ste_reference, reason=_STE)),
    Case("round_ste_without_intent", "straight-through estimator", RoundSTE, _x,
         "not the derivative, and the intended gradient is not stated: gradcheck is "
         "right to fail and its fix says how to state it",
         failing={"gradcheck"}),
    Case("sign_ste_hardtanh", "straight-through estimator (BinaryConnect)", SignSTE, _x,
         "correct against the hard-tanh reference",
         options=dict(reference=sign_ste_reference, reason="hard-tanh straight-through")),
    Case("sign_ste_without_clip", "straight-through estimator (BinaryConnect)",
         SignSTEWithoutClip, _x,
         "broken: passes the gradient where |x| > 1, unlike the stated intent",
         failing={"gradcheck"}, subjects={"gradcheck": "input 0 (x), output 0"},
         options=dict(reference=sign_ste_reference, reason="hard-tanh straight-through")),
    Case("gradient_reversal", "gradient reversal", GradientReversal,
         lambda: (sample(2, 5), 0.7), "correct against its reference",
         options=dict(reference=gradient_reversal_reference,
                      reason="gradient reversal: the identity forward, -alpha backward")),
    Case("gradient_reversal_in_place", "gradient reversal", GradientReversalInPlace,
         lambda: (sample(2, 5), 0.7),
         "broken: changes the incoming gradient in place (the caller's tensor); double "
         "backward, which tracks that gradient, then fails too",
         failing={"backward.grad_outputs_unchanged", "gradgradcheck"},
         options=dict(reference=gradient_reversal_reference,
                      reason="gradient reversal: the identity forward, -alpha backward")),
    Case("gradient_scaling", "gradient scaling", ScaleGradient,
         lambda: (sample(4, 2), 0.25), "correct against its reference",
         options=dict(reference=scale_gradient_reference, reason="scales the gradient")),
    Case("vector_quantization", "vector quantization (VQ-VAE)", VectorQuantize,
         lambda: (sample(2, 3, 4), sample(5, 4, seed=1)),
         "correct: straight-through to the inputs, summed into the codes",
         options=dict(reference=vector_quantize_reference,
                      reason="straight-through estimator for the inputs")),
    Case("in_place_fake_quantizer", "in-place quantizer", FakeQuantize_,
         lambda: (sample(3, 4, scale=2.0), 0.25), "correct: marked dirty, straight-through",
         options=dict(reference=fake_quantize_reference, reason=_STE)),
    Case("in_place_fake_quantizer_not_marked_dirty", "in-place quantizer",
         FakeQuantizeForgetsMarkDirty, lambda: (sample(3, 4, scale=2.0), 0.25),
         "broken: changes its input in place without ctx.mark_dirty",
         failing={"mark_dirty"}, subjects={"mark_dirty": "input 0 (x)"},
         options=dict(reference=fake_quantize_reference, reason=_STE)),
]
