"""Installing: each way in, and what each leaves installed.

* ``pip install <checkout or sdist>`` with pip's build isolation downloads no
  torch and installs the sources, csrc/ included; installing changes nothing
  until an import;
* where torch is importable (``--no-build-isolation``, ``pip wheel``), the
  build compiles, and the wheel declares that exact torch: a requirement on
  the installed distribution's version (which pip resolves against it, PyPI's
  CUDA wheels included) and a local version tag from ``torch.__version__``. Compiling that wheel (a minute or more) is opt-in:
  TORCH_CTXEXT_TEST_WHEEL=1; its metadata is checked in every run.

The first import of a sources-only install: test_first_import.py.
"""
import glob
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile

import pytest
import torch

from install_env import (  # noqa: F401  (checkout, installed_from_source, sdist, user_env: fixtures)
    BACKPORTED, BUILD_TIMEOUT, CSRC, LOADED, ROOT, checkout, clean_env, copy_checkout, installed_from_source,
    needs_extension, run, sdist, user_env,
)


def test_pip_install_with_build_isolation_downloads_no_torch_and_installs_the_sources(
    user_env, installed_from_source
):
    log = installed_from_source.stdout + installed_from_source.stderr
    assert not re.search(r"^\s*(Collecting|Downloading) torch\b(?!_ctxext|-ctxext)", log, re.M), log
    assert "torch is not importable in this build environment" in log
    package = user_env.package()
    assert sorted(os.listdir(os.path.join(package, "csrc"))) == CSRC
    assert not glob.glob(os.path.join(package, "_C*")) and not os.path.exists(
        os.path.join(package, "_build_info.py")
    )
    metadata = run([user_env.python, "-c", "import importlib.metadata as m; d = m.distribution('torch_ctxext'); print(d.version, d.requires)"])
    assert metadata.stdout.strip() == "0.1.0 ['torch>=2.6', 'ninja']"


def test_installing_changes_nothing_until_import(user_env, installed_from_source, tmp_path):
    """No .pth hook, no build: a process that does not import torch_ctxext
    (here: one that imports torch) leaves the cache untouched."""
    result = run([user_env.python, "-c", "import torch; print(hasattr(torch.autograd.function.FunctionCtx, 'input_grad_buffers'))"],
                 TORCH_CTXEXT_CACHE=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str("input_grad_buffers" not in BACKPORTED)
    assert result.stderr == "" and os.listdir(tmp_path) == []
    assert not [f for f in os.listdir(user_env.site_packages) if f.endswith(".pth") and f != "_shared.pth"]


def test_the_sdist_is_for_any_torch_and_ships_every_source_of_the_extension(sdist):
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
    assert sdist.name == "torch_ctxext-0.1.0.tar.gz"
    assert sorted(os.path.basename(n) for n in names if "/csrc/" in n and "." in os.path.basename(n)) == CSRC
    assert not [n for n in names if n.endswith((".so", "_build_info.py"))]


@pytest.mark.parametrize("source", ["checkout", "sdist"])
def test_a_wheel_built_where_torch_is_importable_declares_that_exact_torch(source, checkout, sdist, tmp_path):
    """Its requirement pins the torch it was compiled against; built from a
    checkout its version carries it too (built from an sdist, pip requires
    the version of the file name)."""
    if source == "sdist":
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp_path / "src", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        tree = tmp_path / "src" / "torch_ctxext-0.1.0"
    else:
        tree = checkout
    code = "import sys, setuptools.build_meta as b; print(b.prepare_metadata_for_build_wheel(sys.argv[1]))"
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=tree,
                            capture_output=True, text=True, env=clean_env())
    assert result.returncode == 0, result.stderr
    with open(tmp_path / result.stdout.strip().splitlines()[-1] / "METADATA") as f:
        metadata = f.read()
    label = "torch" + re.sub(r"[^A-Za-z0-9.]+", ".", torch.__version__)
    version = "0.1.0" if source == "sdist" else f"0.1.0+{label}"
    assert f"\nVersion: {version}\n" in metadata
    assert f"\nRequires-Dist: torch=={importlib.metadata.version('torch')}\n" in metadata


def test_pip_install_without_build_isolation_resolves_against_the_installed_torch(tmp_path):
    """``pip install --no-build-isolation .`` pins the torch it compiles
    against as pip sees it installed: PyPI's CUDA wheels are installed as
    ``2.12.1`` although ``torch.__version__`` says ``2.12.1+cu130``, so a
    pin on the latter could not be met. pip resolves the pin against the
    running torch, with no index: nothing else to download. (Without pip's
    configuration: this machine's caps torch below the newest release, which
    is about the machine, not the requirement.)"""
    report = tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
         "--report", str(report), str(copy_checkout(tmp_path / "checkout"))],
        capture_output=True, text=True, env=clean_env(PIP_CONFIG_FILE=os.devnull), cwd=str(tmp_path), timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    with open(report) as f:
        (install,) = json.load(f)["install"]  # torch_ctxext only: torch (and ninja) are there
    assert install["metadata"]["name"] == "torch_ctxext"
    assert f"torch=={importlib.metadata.version('torch')}" in install["metadata"]["requires_dist"]


def test_setup_without_torch_installs_the_sources_unless_told_to_compile(tmp_path):
    (tmp_path / "torch").mkdir()  # first on the path: a torch that cannot be imported
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('no torch in this build environment')\n")
    setup_version = [sys.executable, os.path.join(ROOT, "setup.py"), "--version"]
    sources_only = run(setup_version, PYTHONPATH=tmp_path)
    assert sources_only.returncode == 0 and sources_only.stdout.strip() == "0.1.0"
    must_compile = run(setup_version, PYTHONPATH=tmp_path, TORCH_CTXEXT_BUILD_EXT=1)
    assert must_compile.returncode == 1
    assert must_compile.stderr.strip().splitlines() == [
        "torch_ctxext: TORCH_CTXEXT_BUILD_EXT=1 but torch is not importable here: install "
        "torch first, then build with --no-build-isolation (pip) or --no-isolation "
        "(python -m build) so the build sees it."
    ]


# --------------------------------------------------------------------------
# The per-torch wheel, compiled (opt-in: a build of its own)
# --------------------------------------------------------------------------


@needs_extension
@pytest.mark.skipif(
    os.environ.get("TORCH_CTXEXT_TEST_WHEEL") != "1",
    reason="compiles the extension (a minute or more): opt in with TORCH_CTXEXT_TEST_WHEEL=1",
)
def test_pip_wheel_without_isolation_makes_a_wheel_for_this_torch_that_loads_without_building(
    user_env, checkout, tmp_path
):
    built = user_env.pip("wheel", "--no-build-isolation", "--no-deps", "-w", tmp_path / "wheels",
                         copy_checkout(tmp_path / "checkout"), timeout=BUILD_TIMEOUT)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = os.listdir(tmp_path / "wheels")
    label = "torch" + re.sub(r"[^A-Za-z0-9.]+", ".", torch.__version__)
    tag = sys.implementation.cache_tag.replace("cpython-", "cp")
    assert re.fullmatch(rf"torch_ctxext-0\.1\.0\+{re.escape(label)}-{tag}-{tag}-linux_\w+\.whl", wheel), wheel
    installed = user_env.pip("install", "--no-deps", "--target", tmp_path / "site", tmp_path / "wheels" / wheel)
    assert installed.returncode == 0, installed.stderr
    assert sorted(os.listdir(tmp_path / "site" / "torch_ctxext" / "csrc")) == CSRC
    (verdict,) = glob.glob(str(tmp_path / "site" / "torch_ctxext" / "layout-*.json"))  # made at install
    with open(verdict) as f:
        assert json.load(f)["found"] == {}
    loaded = run([user_env.python, "-c", LOADED], PYTHONPATH=tmp_path / "site", TORCH_CTXEXT_CACHE=tmp_path / "cache")
    assert loaded.returncode == 0 and loaded.stderr == "", loaded.stderr  # nothing built, nothing verified
    origin, path = loaded.stdout.split()
    assert origin == "package" and path.startswith(str(tmp_path / "site" / "torch_ctxext" / "_C"))
    assert not os.path.exists(tmp_path / "cache")


def test_the_sdist_and_a_sources_only_wheel_carry_the_suites_own_ini(checkout, sdist, tmp_path):
    """``check`` runs the suite with torch_ctxext/conformance/suite.ini (not
    the caller's ini): an installed package must carry it."""
    with tarfile.open(sdist) as tar:
        assert [n for n in tar.getnames() if n.endswith("torch_ctxext/conformance/suite.ini")]
    code = "import sys, setuptools.build_meta as b; print(b.build_wheel(sys.argv[1]))"
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=checkout,
                            capture_output=True, text=True, env=clean_env(TORCH_CTXEXT_BUILD_EXT=0))
    assert result.returncode == 0, result.stderr
    with zipfile.ZipFile(tmp_path / result.stdout.strip().splitlines()[-1]) as wheel:
        assert "torch_ctxext/conformance/suite.ini" in wheel.namelist()
