"""Real models, random init, on the CPU in fp32: after convert(), the forward output and
every parameter gradient match the unconverted model; the report names the patch
embeds; the converted patch-embed module compiles with fullgraph=True.

Errors are judged as gemmconv.verify judges them, against the same model in float64:
the converted model's rms_range error must be within the fp32 tolerance or, where the
whole model amplifies rounding beyond a single convolution's tolerance, no more than
twice the error of the unconverted (vendor) model on the same inputs.
"""

from __future__ import annotations

import copy

import pytest
import torch

import gemmconv
from gemmconv.measuring.verify import rms_range, tolerance

pytest.importorskip("timm")
pytest.importorskip("transformers")

from model_zoo import ZOO, captured_inputs  # noqa: E402

BATCH = 2


def assert_like_vendor(ours, vendor, ref64, dtype, device_type, what):
    error, vendor_error = rms_range(ours, ref64), rms_range(vendor, ref64)
    allowed = max(tolerance(dtype, device_type), 2 * vendor_error)
    assert error <= allowed, f"{what}: rms {error:.3g} > {allowed:.3g} (vendor {vendor_error:.3g})"


def _as(inputs, dtype):
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)


@pytest.mark.parametrize("entry", ZOO, ids=str)
def test_converted_model_matches_forward_and_every_gradient(entry):
    torch.manual_seed(0)
    model = entry.build().train()
    vendor = copy.deepcopy(model)
    reference = copy.deepcopy(model).double()
    report = gemmconv.convert(model)
    assert set(entry.must_swap) <= set(report.swapped_names), str(report)
    assert not any(isinstance(m, gemmconv.nn.Conv2d) for m in vendor.modules())

    inputs = entry.inputs(BATCH, torch.Generator().manual_seed(1))
    y = entry.run(model, *inputs)
    y_vendor = entry.run(vendor, *inputs)
    y64 = entry.run(reference, *_as(inputs, torch.float64))
    assert_like_vendor(y, y_vendor, y64, torch.float32, "cpu", "output")
    for name in entry.must_swap:  # the swapped modules really ran through gemmconv
        assert model.get_submodule(name)._gemmconv_last_input is not None, name

    cotangent = torch.rand(y.shape, generator=torch.Generator().manual_seed(2)) * 2 - 1
    y.backward(cotangent)
    y_vendor.backward(cotangent)
    y64.backward(cotangent.double())
    named = list(model.named_parameters())
    for (name, p), p_vendor, p64 in zip(
        named, vendor.parameters(), reference.parameters(), strict=True
    ):
        if p_vendor.grad is None:  # a parameter the output does not depend on
            assert p.grad is None, name
            continue
        assert_like_vendor(p.grad, p_vendor.grad, p64.grad, torch.float32, "cpu", f"grad {name}")


@pytest.mark.parametrize("entry", ZOO, ids=str)
def test_converted_patch_embed_compiles_fullgraph(entry):
    torch.manual_seed(0)
    model = entry.build()
    gemmconv.convert(model)
    inputs = entry.inputs(BATCH, torch.Generator().manual_seed(3))
    module_inputs = captured_inputs(model, entry.patch_embed, entry.run, inputs)
    module = model.get_submodule(entry.patch_embed)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    x = module_inputs[0].clone().requires_grad_()
    x_eager = module_inputs[0].clone().requires_grad_()
    y = compiled(x, *module_inputs[1:])
    y_eager = module(x_eager, *module_inputs[1:])
    assert rms_range(y, y_eager) <= tolerance(torch.float32, "cpu")
    # A random cotangent: the sum of a batch-normed output has a zero input gradient.
    cotangent = torch.rand(y.shape, generator=torch.Generator().manual_seed(4)) * 2 - 1
    y.backward(cotangent)
    y_eager.backward(cotangent)
    assert rms_range(x.grad, x_eager.grad) <= tolerance(torch.float32, "cpu")
