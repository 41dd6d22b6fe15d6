"""Indexing and selection: a scatter-max into a caller's ``out`` buffer
(torch_scatter style), top-k with integer indices, a histogram with no
differentiable output, and sparsemax (with a jvp)."""
import torch

from ._case import Case, sample


class ScatterMax(torch.autograd.Function):
    """out[j] = max(out[j], max of src[i] with index[i] == j), in place, and
    the position in src of each maximum (src.numel() where out's own value
    won). The gradient goes to the winning src entries."""

    @staticmethod
    def forward(ctx, src, index, out):
        out.scatter_reduce_(0, index, src, reduce="amax", include_self=True)
        n = src.numel()
        won = src == out.gather(0, index)
        candidates = torch.where(won, torch.arange(n), n)
        argmax = torch.full(out.shape, n, dtype=torch.long)
        argmax.scatter_reduce_(0, index, candidates, reduce="amin", include_self=True)
        ctx.mark_dirty(out)
        ctx.mark_non_differentiable(argmax)
        ctx.save_for_backward(argmax)
        ctx.n = n
        return out, argmax

    @staticmethod
    def backward(ctx, grad_out, grad_argmax):
        (argmax,) = ctx.saved_tensors
        grad_src = grad_out.new_zeros(ctx.n + 1)  # the last slot collects out's own wins
        grad_src.scatter_(0, argmax, grad_out)
        return grad_src[:-1], None, None


class ScatterMaxDropsNoSlot(ScatterMax):
    """Clamps the argmax instead of keeping a slot for out's own wins: the
    gradient of an output position no src entry reached lands on src's last
    entry."""

    @staticmethod
    def backward(ctx, grad_out, grad_argmax):
        (argmax,) = ctx.saved_tensors
        grad_src = grad_out.new_zeros(ctx.n)
        grad_src.scatter_(0, argmax.clamp(max=ctx.n - 1), grad_out)
        return grad_src, None, None


def _scatter_args():
    src = sample(10, scale=1.0)
    index = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0])  # nothing goes to out[3]
    out = torch.zeros(4)
    return (src, index, out)


class TopK(torch.autograd.Function):
    """Values and indices; the indices are left unmarked (integer outputs are
    never differentiable)."""

    @staticmethod
    def forward(ctx, x, k):
        values, indices = x.topk(k, dim=-1)
        ctx.save_for_backward(indices)
        ctx.shape = x.shape
        return values, indices

    @staticmethod
    def backward(ctx, grad_values, grad_indices):
        (indices,) = ctx.saved_tensors
        return grad_values.new_zeros(ctx.shape).scatter(-1, indices, grad_values), None


class Histogram(torch.autograd.Function):
    """Counts per bin: an integer output only."""

    @staticmethod
    def forward(ctx, x, bins):
        edges = torch.linspace(-1, 1, bins + 1, dtype=x.dtype)
        return torch.bucketize(x.detach().reshape(-1), edges).bincount(minlength=bins + 2)

    @staticmethod
    def backward(ctx, grad_counts):
        return None, None


def _sparsemax(x, dim):
    z, _ = torch.sort(x, dim=dim, descending=True)
    k = torch.arange(1, x.shape[dim] + 1, dtype=x.dtype).view(
        [-1 if d == dim % x.dim() else 1 for d in range(x.dim())])
    cumulative = z.cumsum(dim) - 1
    support = (k * z > cumulative).sum(dim=dim, keepdim=True)
    tau = cumulative.gather(dim, support - 1) / support.to(x.dtype)
    return torch.clamp(x - tau, min=0)


def _project_on_support(out, g, dim):
    support = (out > 0).to(g.dtype)
    mean = (g * support).sum(dim, keepdim=True) / support.sum(dim, keepdim=True)
    return support * (g - mean)


class Sparsemax(torch.autograd.Function):
    """Martins & Astudillo's sparsemax; the Jacobian is symmetric, so jvp and
    backward share one formula."""

    @staticmethod
    def forward(ctx, x, dim=-1):
        out = _sparsemax(x, dim)
        ctx.save_for_backward(out)
        ctx.save_for_forward(out)
        ctx.dim = dim
        return out

    @staticmethod
    def backward(ctx, grad_output):
        (out,) = ctx.saved_tensors
        return _project_on_support(out, grad_output, ctx.dim), None

    @staticmethod
    def jvp(ctx, x_tangent, _):
        (out,) = ctx.saved_tensors
        return _project_on_support(out, x_tangent, ctx.dim)


class SparsemaxBackwardWithoutMean(Sparsemax):
    @staticmethod
    def backward(ctx, grad_output):
        (out,) = ctx.saved_tensors
        return grad_output * (out > 0).to(grad_output.dtype), None


class SparsemaxJvpWithoutMean(Sparsemax):
    @staticmethod
    def jvp(ctx, x_tangent, _):
        (out,) = ctx.saved_tensors
        return x_tangent * (out > 0).to(x_tangent.dtype)


def _sparsemax_args():
    return (sample(3, 5, scale=2.0), -1)


CASES = [
    Case("scatter_max_into_out", "scatter-max with an in-place out=", ScatterMax,
         _scatter_args, "correct: out is marked dirty; each check gets a fresh out"),
    Case("scatter_max_wrong_slot", "scatter-max with an in-place out=", ScatterMaxDropsNoSlot,
         _scatter_args, "broken: out's own wins send their gradient to src's last entry",
         failing={"gradcheck"}, subjects={"gradcheck": "input 0 (src), output 0"}),
    Case("top_k_unmarked_indices", "integer outputs", TopK, lambda: (sample(2, 5), 2),
         "correct: unmarked integer indices behave as marked ones"),
    Case("histogram_no_differentiable_output", "integer outputs", Histogram,
         lambda: (sample(12), 4), "correct: nothing to differentiate, which is said",
         skipped={"gradcheck": "no output requires grad",
                  "gradgradcheck": "no output requires grad"}),
    Case("sparsemax_with_jvp", "sparsemax; jvp", Sparsemax, _sparsemax_args,
         "correct in both modes"),
    Case("sparsemax_backward_without_mean", "sparsemax; jvp", SparsemaxBackwardWithoutMean,
         _sparsemax_args, "broken backward: jvp is right, so they also disagree",
         failing={"gradcheck", "jvp.matches_backward"}),
    Case("sparsemax_jvp_without_mean", "sparsemax; jvp", SparsemaxJvpWithoutMean,
         _sparsemax_args, "broken jvp: backward is right",
         failing={"jvp.finite_differences", "jvp.matches_backward"}),
]
