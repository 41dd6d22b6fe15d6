"""Small helpers the rule families share: tensors, and the text of messages."""
import torch


def is_float(t):
    return isinstance(t, torch.Tensor) and (t.dtype.is_floating_point or t.dtype.is_complex)


def is_float_dtype(dtype):
    return dtype is not None and (dtype.is_floating_point or dtype.is_complex)


def as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def fresh_copies(args):
    """A copy of every tensor in ``args`` (other values as they are): what
    one run of the Function under check gets, so that a forward that
    changes an input in place (mark_dirty) changes nothing another run
    sees."""
    return [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]


def same_values(a, b):
    """Equal values, NaN equal to NaN."""
    try:
        if torch.equal(a, b):
            return True
        if not (a.dtype.is_floating_point or a.dtype.is_complex):
            return False
        return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(
            torch.nan_to_num(a), torch.nan_to_num(b)
        )
    except RuntimeError:
        return False


def wide(dtype):
    """float64 / complex128 for a floating dtype."""
    return torch.complex128 if dtype.is_complex else torch.float64


def random_like(t, gen):
    """Uniform in [-1, 1) (both parts for complex), in t's dtype and device."""
    value = torch.rand(t.shape, generator=gen, dtype=torch.float64) * 2 - 1
    if t.dtype.is_complex:
        imag = torch.rand(t.shape, generator=gen, dtype=torch.float64) * 2 - 1
        return torch.complex(value, imag).to(t.dtype).to(t.device)
    return value.to(t.dtype).to(t.device)


def first_lines(text, n=12):
    lines = str(text).strip().splitlines()
    return "\n".join(lines[:n] + (["..."] if len(lines) > n else []))


def error_text(exc):
    return f"{type(exc).__name__}: {first_lines(exc)}"


def dtypes_text(dtypes):
    return "(" + ", ".join(str(d).replace("torch.", "") for d in dtypes) + ")"
