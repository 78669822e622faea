"""The README's install recipe for machines without an NVIDIA GPU keeps every extra
CPU-only with plain pip.

pip takes torch from PyPI, where the Linux build is the CUDA one. timm (the models
extra) needs torchvision, and PyPI's torchvision pins one torch version: installing the
extras after torch's CPU build alone made pip replace it with the newest CUDA build and
NVIDIA's libraries. The recipe takes torch and torchvision from PyTorch's CPU index
first (the command pytorch.org gives for a CPU machine); the extras then find both
installed and keep them.

pip resolves the recipe here offline, in a fresh virtual environment, against two
folders of metadata-only wheels standing in for PyPI and for the CPU index: gemmconv
with its pyproject's dependencies and extras, every package those need with the version
and dependencies installed here, and torch and torchvision as the two indexes publish
them (a CUDA and a ``+cpu`` build of an older and a newer release, each torchvision
pinning its torch).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import sysconfig
import venv
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement  # packaging comes with pytest
from packaging.utils import canonicalize_name
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

# Asked of the installed distributions, not of the import system: setuptools'
# distutils hook, asked to find a module named pip, switches itself off for the rest of
# the process, and a later import of setuptools (inductor's C++ builds) then fails.
try:
    PIP_VERSION = Version(metadata.version("pip"))
except metadata.PackageNotFoundError:
    pytest.skip("pip is not installed: nothing here resolves an install", allow_module_level=True)

# The stand-in indexes copy every installed dependency of gemmconv's extras: a tree run
# from its sources without installing gemmconv (PYTHONPATH=src) has no such set.
try:
    metadata.distribution("gemmconv")
except metadata.PackageNotFoundError:
    pytest.skip("gemmconv is not installed here: its extras were never resolved",
                allow_module_level=True)  # fmt: skip

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# What the README's CPU recipe installs first, from the CPU index (here its stand-in):
# pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu
CPU_FIRST = ["torch", "torchvision"]
# Distributions that only a CUDA build of torch brings.
CUDA_NAME = re.compile(r"^(nvidia|cuda)[-_.]", re.IGNORECASE)


def _wheel(
    folder: Path, name: str, version: str, requires: list[str], extras: tuple[str, ...] = ()
) -> None:
    """A wheel holding only metadata: enough for pip to resolve and install it."""
    stem = f"{re.sub(r'[-_.]+', '_', name)}-{version}"
    info = f"{stem}.dist-info"
    files = {
        f"{info}/METADATA": "\n".join(
            ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
            + [f"Provides-Extra: {extra}" for extra in extras]
            + [f"Requires-Dist: {r}" for r in requires]
        )
        + "\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: gemmconv-tests\n"
        "Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    with zipfile.ZipFile(folder / f"{stem}-py3-none-any.whl", "w") as whl:
        for path, text in files.items():
            whl.writestr(path, text)


def _gemmconv_requires() -> list[str]:
    """gemmconv's Requires-Dist as setuptools writes it from pyproject.toml."""
    requires = list(PROJECT["dependencies"])
    for extra, requirements in PROJECT["optional-dependencies"].items():
        for text in requirements:
            req = Requirement(text)
            marker = f'extra == "{extra}"'
            if req.marker is not None:
                marker = f"({req.marker}) and {marker}"
            req.marker = None
            requires.append(f"{req}; {marker}")
    return requires


def _applies(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({"extra": extra}) for extra in extras | {""})


def _stand_in_indexes(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    """The folders standing in for PyPI and the CPU index, and the torch and
    torchvision versions in them."""
    pypi, cpu = tmp_path / "pypi", tmp_path / "cpu"
    pypi.mkdir()
    cpu.mkdir()
    # An older and a newer release of each, as both indexes hold them; each torchvision
    # pins its torch, as PyPI's and the CPU index's do.
    torch_old = Version(metadata.version("torch")).base_version
    major, minor = Version(torch_old).release[:2]
    torch_new = f"{major}.{minor + 1}.0"
    versions = {"torch": torch_old, "torch_new": torch_new}
    for folder, local, cuda in ((pypi, "", ["nvidia-cuda-runtime"]), (cpu, "+cpu", [])):
        for torch_version, tv_version in ((torch_old, "0.90.0"), (torch_new, "0.91.0")):
            _wheel(folder, "torch", torch_version + local, cuda)
            _wheel(folder, "torchvision", tv_version + local, [f"torch=={torch_version}"])
    _wheel(pypi, "nvidia-cuda-runtime", "13.0.0", [])

    # gemmconv, and every distribution its dependencies and extras need, with the
    # version and dependencies installed here.
    _wheel(pypi, "gemmconv", "0.0.0", _gemmconv_requires(), tuple(PROJECT["optional-dependencies"]))
    wanted: dict[str, set[str]] = {}  # each distribution needed, with its extras
    queue = [Requirement(f"gemmconv[{','.join(PROJECT['optional-dependencies'])}]")]
    while queue:
        req = queue.pop()
        name = canonicalize_name(req.name)
        if name in ("torch", "torchvision") or (name in wanted and req.extras <= wanted[name]):
            continue
        extras = wanted.setdefault(name, set())
        extras |= set(req.extras)
        if name == "gemmconv":
            requires = _gemmconv_requires()
        else:
            try:
                requires = metadata.requires(name) or []
            except metadata.PackageNotFoundError:
                pytest.fail(f"{name} (needed by gemmconv's extras) is not installed here")
        queue += [r for r in map(Requirement, requires) if _applies(r, extras)]
    for name in wanted.keys() - {"gemmconv", "torch", "torchvision"}:
        requires = [
            r for r in metadata.requires(name) or [] if _applies(Requirement(r), wanted[name])
        ]
        _wheel(pypi, name, metadata.version(name), requires, tuple(wanted[name]))
    return pypi, cpu, versions


class _Venv:
    """A virtual environment without pip, into which this interpreter's pip installs
    (``pip --python``) from local folders only, with no pip configuration."""

    def __init__(self, path: Path):
        venv.EnvBuilder(with_pip=False, symlinks=os.name != "nt").create(path)
        self.path = str(path)
        bin_dir = "Scripts" if os.name == "nt" else "bin"
        self.python = str(path / bin_dir / ("python.exe" if os.name == "nt" else "python"))
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        self.env.pop("PYTHONPATH", None)  # src/ must not look installed
        self.env["PIP_CONFIG_FILE"] = os.devnull

    def unpack(self, wheel: Path) -> None:
        """Install a metadata-only wheel as pip would: its files into site-packages."""
        base = {"base": self.path, "platbase": self.path}
        with zipfile.ZipFile(wheel) as whl:
            whl.extractall(sysconfig.get_path("purelib", vars=base))

    def install(self, folders: list[Path], *requirements: str, dry_run: bool) -> dict:
        """pip's installation report: what it installs (or would)."""
        command = [sys.executable, "-m", "pip", "--python", self.python, "install"]
        command += ["--no-index", "--no-cache-dir", "--disable-pip-version-check", "-q"]
        for folder in folders:
            command += ["--find-links", str(folder)]
        command += ["--dry-run"] if dry_run else []
        command += ["--report", "-", *requirements]
        result = subprocess.run(command, capture_output=True, text=True, env=self.env)
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        return {
            canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
            for i in report["install"]
        }


@pytest.mark.skipif(PIP_VERSION < Version("22.3"), reason="pip's --python option came in pip 22.3")
def test_the_cpu_recipe_keeps_every_extra_cpu_only(tmp_path):
    """After the recipe, installing every extra from PyPI installs neither torch nor
    torchvision nor anything of CUDA's."""
    pypi, cpu, versions = _stand_in_indexes(tmp_path)
    every_extra = f"gemmconv[{','.join(PROJECT['optional-dependencies'])}]"
    env = _Venv(tmp_path / "venv")

    # torch's CPU build alone, then the extras: pip swaps in the newer CUDA build (what
    # the recipe prevents; this shows the stand-ins reproduce it).
    env.unpack(next(cpu.glob(f"torch-{versions['torch']}+cpu-*.whl")))
    plain = env.install([pypi], "gemmconv[models]", dry_run=True)
    assert plain["torch"] == versions["torch_new"] and "nvidia-cuda-runtime" in plain

    # The recipe: torch and torchvision from the CPU index, then the extras from PyPI.
    first = env.install([cpu], *CPU_FIRST, dry_run=False)
    assert first.get("torch", f"{versions['torch']}+cpu").endswith("+cpu")
    assert first["torchvision"].endswith("+cpu")
    extras = env.install([pypi], every_extra, dry_run=True)
    assert "gemmconv" in extras and "timm" in extras
    assert not {"torch", "torchvision"} & extras.keys(), extras  # the CPU builds stay
    assert not [name for name in extras if CUDA_NAME.match(name)], extras
