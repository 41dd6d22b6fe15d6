"""Small helpers the rule families share: tensors, the text of messages, and
where in the user's code an exception was raised."""
import linecache
import os
import sysconfig
import traceback

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
    """``Type: message`` of an exception the checked Function (or the
    reference) raised, followed by the frame of the user's code it was
    raised in (``File "...", line N, in backward`` and that line), as in a
    Python traceback: without it a report says what went wrong but not
    where."""
    text = f"{type(exc).__name__}: {first_lines(exc)}"
    frame = user_frame(exc)
    if frame is None:
        return text
    filename, lineno, name = frame
    text += f'\n  File "{filename}", line {lineno}, in {name}'
    source = linecache.getline(filename, lineno).strip()
    return text + (f"\n    {source}" if source else "")


# --- the user's frames of a traceback -------------------------------------------

# Code that is not the user's: torch, torch_ctxext (the checker, its patches of
# torch) and the standard library. A frame anywhere else is the user's: the
# file the Function is defined in, or a helper of theirs it calls.
def _directory(path):
    return os.path.normcase(os.path.abspath(path)) + os.sep


_PACKAGE_DIRS = (
    _directory(os.path.dirname(torch.__file__)),
    _directory(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),  # torch_ctxext
)
_STDLIB_DIRS = tuple({_directory(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib")})


def _is_library(filename, dirs=_PACKAGE_DIRS + _STDLIB_DIRS):
    if filename.startswith("<"):  # exec'd or generated code: the user's
        return False
    path = os.path.normcase(os.path.abspath(filename))
    # Installed packages live under the standard library's directory on some
    # layouts (/usr/lib/python3.X/site-packages): they are not the stdlib.
    if "site-packages" in path or "dist-packages" in path:
        dirs = tuple(d for d in dirs if d not in _STDLIB_DIRS)
    return path.startswith(dirs)


def user_frame(exc):
    """(filename, line, function) of the innermost frame of ``exc``'s
    traceback in the user's code (neither torch's, torch_ctxext's nor the
    standard library's), or None when the user's code is not on it (an
    error the engine raised after backward returned)."""
    found = None
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        if not _is_library(frame.f_code.co_filename):
            found = (frame.f_code.co_filename, lineno, frame.f_code.co_name)
    return found


def kept_exception(exc):
    """``exc``, made fit to be kept in a report and chained to the
    ContractViolation (``raise ... from exc``), which pytest and Python then
    print as the cause: its traceback starts at the user's outermost frame
    (the checker's frames and torch's above the user's code say nothing
    about the error), or at the first frame outside torch_ctxext when the
    user's code is not on it; and the locals of its frames are cleared, so
    that a report does not keep the sample's tensors, ctx or the graph
    alive. File names, lines and functions stay."""
    tb = exc.__traceback__
    start = next((t for t in _tracebacks(tb) if not _is_library(t.tb_frame.f_code.co_filename)),
                 None)
    if start is None:
        start = next((t for t in _tracebacks(tb)
                      if not _is_library(t.tb_frame.f_code.co_filename, _PACKAGE_DIRS[1:])), tb)
    exc.__traceback__ = start
    seen, link = set(), exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        traceback.clear_frames(link.__traceback__)  # skips frames still running
        link = link.__cause__ or link.__context__
    return exc


def _tracebacks(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


def dtypes_text(dtypes):
    return "(" + ", ".join(str(d).replace("torch.", "") for d in dtypes) + ")"
