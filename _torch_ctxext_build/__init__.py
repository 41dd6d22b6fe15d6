"""torch_ctxext's build and load layer: the standard library only.

What compiles the C++ extension, where builds live, the processes a build
and a layout probe run in, and the verdicts those probes give. ``setup.py``,
``tools/`` and the children an import starts import it without torch (a
module here imports torch only inside the functions that need the running
one, or in a child process), and it never imports ``torch_ctxext``: the
package (``torch_ctxext/_ext/``: ``build``, ``build_cache``, ``loader``,
``advise_module``) sits above it and calls into it, never the reverse.

* ``releases``: the torch releases supported and where they differ
  (``torch_ctxext._releases`` is this module);
* ``sources``, ``compile``: what the extension is compiled from, with which
  flags, and the ninja file that compiles it;
* ``cache``: where builds live and what a published one is;
* ``build_lock``: the lock that makes the ranks of a job build (or verify)
  once, and the bound on every wait for it;
* ``child``, ``child_helper``: starting a child process from inside a
  user's process; ``supervisor``, ``build_child``: the build's process;
* ``layout_verdict``, ``layout_probe``, ``layout_check``: whether a build
  reads the running torch's structures as its headers say, verified in a
  child process; ``verdict_store``: where verdicts are kept and read;
* ``extension``: loading a built library as a module (the one place that
  loads a file by its path: the extension's shared library).
"""
