"""The MODEL argument of ``gemmconv profile``: where a model comes from, with no download.

- ``timm:NAME``: ``timm.create_model(NAME, pretrained=False, **overrides)``; the input
  is timm's ``pretrained_cfg["input_size"]``, with the ``img_size`` and ``in_chans``
  overrides applied.
- ``hf:NAME``: a transformers config class (``hf:SiglipVisionConfig``, built as
  ``NAME(**overrides)`` and given to ``AutoModel.from_config``) or a model class
  (``hf:SiglipVisionModel``, built from its ``config_class(**overrides)``); random
  weights. The input is ``num_channels`` x ``image_size`` where the config has them.
- ``path/to/file.py:FACTORY``: the file imported, ``FACTORY(**overrides)`` called; it
  returns a model, or ``(model, example_inputs)`` for models whose input is not one
  image tensor (a tuple of arguments, or one tensor).

Every failure to build a model is a UsageError: one line, exit status 2.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch

from gemmconv.terminal.usage import UsageError

_EXTRA_HINT = "pip install 'gemmconv[models]' (from a checkout: pip install -e '.[models]')"
_FORMS = "timm:NAME, hf:CONFIG_OR_MODEL_CLASS or path/to/file.py:FACTORY"


@dataclasses.dataclass
class LoadedModel:
    model: torch.nn.Module
    # The factory's example inputs, where it gave them.
    inputs: tuple[Any, ...] | None = None
    # One input's shape without the batch (C, H, W), where the model says it.
    sample_shape: tuple[int, ...] | None = None


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` texts as keyword arguments: a Python literal (64, 0.5, (64, 64),
    True, None) where VALUE reads as one, else the text itself."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.isidentifier():
            raise UsageError(f"-o/--override {item!r}: expected KEY=VALUE with KEY an identifier")
        try:
            overrides[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            overrides[key] = text
    return overrides


def load(spec: str, overrides: dict[str, Any]) -> LoadedModel:
    """The model ``spec`` names, built with ``overrides``."""
    prefix, sep, name = spec.partition(":")
    if sep and prefix == "timm":
        return _timm(spec, name, overrides)
    if sep and prefix == "hf":
        return _hf(spec, name, overrides)
    path, sep, factory = spec.rpartition(":")
    if sep and path.endswith(".py") and factory:
        return _factory(spec, Path(path), factory, overrides)
    raise UsageError(f"MODEL {spec!r}: expected {_FORMS}")


def _require(spec: str, module: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise UsageError(
            f"MODEL {spec!r} needs {module}, which is not installed: {_EXTRA_HINT}"
        ) from None


def _timm(spec: str, name: str, overrides: dict[str, Any]) -> LoadedModel:
    timm = _require(spec, "timm")
    if not name:
        raise UsageError(f"MODEL {spec!r}: expected a timm model name after 'timm:'")
    try:
        model = timm.create_model(name, pretrained=False, **overrides)
    except Exception as e:
        raise UsageError(f"MODEL {spec!r}: timm.create_model failed: {_one_line(e)}") from None
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
    shape = cfg.get("input_size")
    if shape is not None:
        channels, *spatial = shape
        if "img_size" in overrides:
            size = overrides["img_size"]
            spatial = list(size) if isinstance(size, (tuple, list)) else [size] * len(spatial)
        channels = overrides.get("in_chans", channels)
        shape = (int(channels), *(int(s) for s in spatial))
    return LoadedModel(model, sample_shape=shape)


def _hf(spec: str, name: str, overrides: dict[str, Any]) -> LoadedModel:
    transformers = _require(spec, "transformers")
    found = getattr(transformers, name, None) if name.isidentifier() else None
    expected = "a transformers config class (SiglipVisionConfig) or model class (SiglipVisionModel)"
    if not isinstance(found, type):
        raise UsageError(
            f"MODEL {spec!r}: transformers {transformers.__version__} has no {name!r}; "
            f"expected {expected}"
        )
    try:
        if issubclass(found, transformers.PretrainedConfig):
            config = found(**overrides)
            model = transformers.AutoModel.from_config(config)
        elif issubclass(found, transformers.PreTrainedModel):
            config = found.config_class(**overrides)
            model = found(config)
        else:
            raise UsageError(f"MODEL {spec!r}: {name} is neither; expected {expected}")
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(f"MODEL {spec!r}: building it failed: {_one_line(e)}") from None
    size = getattr(config, "image_size", None)
    shape = None
    if size is not None:
        spatial = list(size) if isinstance(size, (tuple, list)) else [size, size]
        shape = (int(getattr(config, "num_channels", 3)), *(int(s) for s in spatial))
    return LoadedModel(model, sample_shape=shape)


def _factory(spec: str, path: Path, factory: str, overrides: dict[str, Any]) -> LoadedModel:
    if not path.is_file():
        raise UsageError(f"MODEL {spec!r}: no file {str(path)!r}")
    module_name = f"_gemmconv_profile_{path.stem}"
    try:
        found = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(found)
        sys.modules[module_name] = module  # dataclasses and pickling look modules up there
        found.loader.exec_module(module)
    except Exception as e:
        raise UsageError(f"MODEL {spec!r}: importing {path} failed: {_one_line(e)}") from None
    make = getattr(module, factory, None)
    if not callable(make):
        raise UsageError(f"MODEL {spec!r}: {path} has no callable {factory!r}")
    try:
        made = make(**overrides)
    except Exception as e:
        raise UsageError(f"MODEL {spec!r}: {factory}() raised {_one_line(e)}") from None
    if isinstance(made, torch.nn.Module):
        return LoadedModel(made)
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module):
        model, inputs = made
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        if isinstance(inputs, (tuple, list)) and inputs:
            return LoadedModel(model, inputs=tuple(inputs))
    raise UsageError(
        f"MODEL {spec!r}: {factory}() returned {type(made).__name__}; expected a "
        "torch.nn.Module or (module, example_inputs)"
    )


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    if len(text) > 300:
        text = text[:300] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


__all__ = ["LoadedModel", "load", "parse_overrides"]
