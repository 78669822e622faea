"""The PyTorch integration on CUDA: the model zoo converted in bf16 against the
unconverted model (forward and every gradient, gemmconv.verify's twice-the-vendor rule
against float64), a converted ViT trained with AdamW under autocast, opcheck on CUDA,
inductor-compiled patch embeds, and a timing of patch-embed forward+backward before
and after conversion, written to $GEMMCONV_RESULTS_DIR (bench/results for the
committed run; by default the test's temporary folder, so a test run never overwrites
a committed file)."""

from __future__ import annotations

import copy
import json
import os
import pathlib

import pytest
import torch
from torch.library import opcheck

import gemmconv
from gemmconv.core.memory_format import Layout
from gemmconv.measuring.timing import time_ms
from gemmconv.measuring.verify import rms_range, tolerance

pytest.importorskip("timm")
pytest.importorskip("transformers")

from conftest import random_in  # noqa: E402
from model_zoo import ZOO, captured_inputs  # noqa: E402

pytestmark = pytest.mark.gpu

CUDA = "cuda"


def assert_like_vendor(ours, vendor, ref64, dtype, what):
    error, vendor_error = rms_range(ours, ref64), rms_range(vendor, ref64)
    allowed = max(tolerance(dtype, CUDA), 2 * vendor_error)
    assert error <= allowed, f"{what}: rms {error:.3g} > {allowed:.3g} (vendor {vendor_error:.3g})"


def _to(inputs, dtype):
    return tuple(t.to(CUDA, dtype) if t.is_floating_point() else t.to(CUDA) for t in inputs)


@pytest.mark.parametrize("entry", ZOO, ids=str)
def test_converted_model_bf16_matches_forward_and_every_gradient(entry):
    torch.manual_seed(0)
    model = entry.build().train()
    vendor = copy.deepcopy(model).to(CUDA, torch.bfloat16)
    reference = copy.deepcopy(model).to(CUDA, torch.float64)
    report = gemmconv.convert(model)
    assert set(entry.must_swap) <= set(report.swapped_names), str(report)
    model.to(CUDA, torch.bfloat16)

    inputs = entry.inputs(2, torch.Generator().manual_seed(1))
    y = entry.run(model, *_to(inputs, torch.bfloat16))
    y_vendor = entry.run(vendor, *_to(inputs, torch.bfloat16))
    y64 = entry.run(reference, *_to(inputs, torch.float64))
    assert_like_vendor(y, y_vendor, y64, torch.bfloat16, "output")

    cotangent = torch.rand(y.shape, generator=torch.Generator().manual_seed(2)) * 2 - 1
    y.backward(cotangent.to(CUDA, torch.bfloat16))
    y_vendor.backward(cotangent.to(CUDA, torch.bfloat16))
    y64.backward(cotangent.to(CUDA, torch.float64))
    for (name, p), p_vendor, p64 in zip(
        model.named_parameters(), vendor.parameters(), reference.parameters(), strict=True
    ):
        if p_vendor.grad is None:
            assert p.grad is None, name
            continue
        assert_like_vendor(p.grad, p_vendor.grad, p64.grad, torch.bfloat16, f"grad {name}")


@pytest.mark.parametrize("entry", ZOO, ids=str)
def test_converted_patch_embed_compiles_with_inductor_bf16(entry):
    torch.manual_seed(0)
    model = entry.build()
    gemmconv.convert(model)
    model.to(CUDA, torch.bfloat16)
    inputs = _to(entry.inputs(4, torch.Generator().manual_seed(3)), torch.bfloat16)
    module_inputs = captured_inputs(model, entry.patch_embed, entry.run, inputs)
    module = model.get_submodule(entry.patch_embed)
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    x = module_inputs[0].clone().requires_grad_()
    x_eager = module_inputs[0].clone().requires_grad_()
    y = compiled(x, *module_inputs[1:])
    y_eager = module(x_eager, *module_inputs[1:])
    assert rms_range(y, y_eager) <= tolerance(torch.bfloat16, CUDA)
    cotangent = torch.rand(y.shape, device=CUDA).to(torch.bfloat16) * 2 - 1
    y.backward(cotangent)
    y_eager.backward(cotangent)
    assert rms_range(x.grad, x_eager.grad) <= tolerance(torch.bfloat16, CUDA)


@pytest.fixture
def full_fp32():
    """fp32 convolutions and matmuls without TF32, so two fp32 trainings can be compared
    closely (Adam divides by the gradient's magnitude, which magnifies TF32 noise)."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _vit_and_batch():
    vit = next(e for e in ZOO if e.name == "timm_vit_tiny")
    torch.manual_seed(0)
    model = vit.build().to(CUDA)
    g = torch.Generator().manual_seed(4)
    (images,) = vit.inputs(8, g)
    targets = torch.randint(0, 1000, (8,), generator=g).to(CUDA)
    return model, images.to(CUDA), targets


def _adamw_steps(model, images, targets, steps, autocast):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        dtype = next(model.parameters()).dtype
        with torch.autocast(CUDA, dtype=torch.bfloat16, enabled=autocast):
            logits = model(images.to(dtype))
        loss = torch.nn.functional.cross_entropy(logits.float(), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, optimizer


def _update(model, initial) -> torch.Tensor:
    """Every parameter's change, flattened into one float64 vector."""
    return torch.cat(
        [
            (p - p0).detach().double().flatten()
            for p, p0 in zip(model.parameters(), initial.parameters(), strict=True)
        ]
    )


def test_converted_vit_adamw_step_matches_in_fp32(full_fp32):
    """One AdamW step, judged against the same step in float64. Adam's first step is
    lr * g / |g| per element, so an element whose true gradient is zero (the key bias of
    attention) moves by +-lr on rounding noise alone; the whole update vector is judged
    (twice the unconverted model's error), and the converted patch embed on its own."""
    model, images, targets = _vit_and_batch()
    initial = copy.deepcopy(model)
    vendor = copy.deepcopy(model)
    reference = copy.deepcopy(model).double()
    assert gemmconv.convert(model).swapped_names == ["patch_embed.proj"]
    _, optimizer = _adamw_steps(model, images, targets, 1, autocast=False)
    _adamw_steps(vendor, images, targets, 1, autocast=False)
    _adamw_steps(reference, images, targets, 1, autocast=False)
    assert optimizer.state[model.patch_embed.proj.weight]["step"].item() == 1
    update, update_vendor = _update(model, initial), _update(vendor, initial)
    update64 = _update(reference, initial.double())
    assert_like_vendor(update, update_vendor, update64, torch.float32, "AdamW update")
    for name in ("weight", "bias"):
        ours = getattr(model.patch_embed.proj, name) - getattr(initial.patch_embed.proj, name)
        theirs = getattr(vendor.patch_embed.proj, name) - getattr(initial.patch_embed.proj, name)
        ref = (
            getattr(reference.patch_embed.proj, name)
            - getattr(initial.patch_embed.proj, name).double()
        )
        assert_like_vendor(ours, theirs, ref, torch.float32, f"patch_embed.proj.{name} update")


def test_converted_vit_trains_with_adamw_under_bf16_autocast(monkeypatch):
    # This tiny ViT's patch embed costs microseconds: the vendor's single launch would
    # win it on host time. Training must run on gemmconv's GEMMs here.
    monkeypatch.setenv("GEMMCONV_DISABLE", "vendor")
    model, images, targets = _vit_and_batch()
    vendor = copy.deepcopy(model)
    gemmconv.convert(model)
    losses, optimizer = _adamw_steps(model, images, targets, 3, autocast=True)
    vendor_losses, _ = _adamw_steps(vendor, images, targets, 3, autocast=True)
    assert optimizer.state[model.patch_embed.proj.weight]["step"].item() == 3
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert model.patch_embed.proj.solvers()["forward"].solver != "vendor"
    for mine, theirs in zip(losses, vendor_losses, strict=True):
        assert abs(mine - theirs) <= 2 * tolerance(torch.bfloat16, CUDA) * abs(theirs)


OPCHECK_CASES = [
    ("patch", (4, 3, 32, 30), (16, 3, 16, 16), [16, 16]),
    ("point", (8, 3, 14, 14), (32, 3, 14, 14), [14, 14]),
    ("pointwise", (2, 16, 5, 7), (8, 16, 1, 1), [1, 1]),
    ("strided_pw", (2, 16, 5, 7), (8, 16, 1, 1), [2, 2]),
    ("conv3d_point", (6, 3, 2, 14, 14), (16, 3, 2, 14, 14), [2, 14, 14]),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("layout", [Layout.CHANNELS_FIRST, Layout.CHANNELS_LAST], ids=str)
@pytest.mark.parametrize(
    "label,x_shape,w_shape,stride", OPCHECK_CASES, ids=[c[0] for c in OPCHECK_CASES]
)
def test_opcheck_on_cuda(label, x_shape, w_shape, stride, layout, dtype):
    g = torch.Generator().manual_seed(5)
    x = random_in(x_shape, layout, dtype, CUDA, g).requires_grad_()
    w = random_in(w_shape, layout, dtype, CUDA, g).requires_grad_()
    b = random_in((w_shape[0],), Layout.CHANNELS_FIRST, dtype, CUDA, g).requires_grad_()
    dims = len(x_shape) - 2
    args = (stride, [0] * dims, [1] * dims, 1)
    opcheck(torch.ops.gemmconv.conv_forward.default, (x, w, b, *args))
    y = torch.ops.gemmconv.conv_forward(x.detach(), w.detach(), None, *args)
    dy = random_in(tuple(y.shape), layout, dtype, CUDA, g)
    channels_last = layout is Layout.CHANNELS_LAST
    opcheck(
        torch.ops.gemmconv.conv_backward_data.default,
        (dy, w.detach(), list(x_shape), *args, channels_last),
    )
    opcheck(
        torch.ops.gemmconv.conv_backward_weights.default,
        (dy, x.detach(), list(w_shape), *args, channels_last),
    )


# ---- timing -----------------------------------------------------------------------


def _vit_b16_patch_embed():
    from timm.layers import PatchEmbed

    return PatchEmbed(img_size=224, patch_size=16, in_chans=3, embed_dim=768), (64, 3, 224, 224)


def _qwen2_vl_patch_embed():
    from transformers.models.qwen2_vl.modeling_qwen2_vl import PatchEmbed

    module = PatchEmbed(patch_size=14, temporal_patch_size=2, in_channels=3, embed_dim=1280)
    return module, (9500, 3 * 2 * 14 * 14)


TIMING_CASES = {
    "timm ViT-B/16 patch_embed, 64x3x224x224 -> 768": _vit_b16_patch_embed,
    "Qwen2-VL patch_embed (Conv3d 2x14x14), 9500 patches -> 1280": _qwen2_vl_patch_embed,
}


def _results_dir(default: pathlib.Path) -> pathlib.Path:
    path = pathlib.Path(os.environ.get("GEMMCONV_RESULTS_DIR", default))
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_patch_embed_forward_backward_timing_before_and_after_convert(tmp_path):
    rows = []
    for case, make in TIMING_CASES.items():
        torch.manual_seed(0)
        module, input_shape = make()
        module = module.to(CUDA, torch.bfloat16)
        g = torch.Generator().manual_seed(6)
        x = (torch.rand(input_shape, generator=g) * 2 - 1).to(CUDA, torch.bfloat16)
        for input_grad in (False, True):
            x_leaf = x.clone().requires_grad_(input_grad)
            dy = torch.rand_like(module(x_leaf)) * 2 - 1

            def step(m=module, x_leaf=x_leaf, dy=dy):
                m.zero_grad(set_to_none=True)
                m(x_leaf).backward(dy)

            def reset(x_leaf=x_leaf):
                x_leaf.grad = None

            before = time_ms(step, device=CUDA, warmup=5, reps=30, setup=reset)
            report = gemmconv.convert(module)
            after = time_ms(step, device=CUDA, warmup=5, reps=30, setup=reset)
            solvers = {d: c.solver for d, c in module.proj.solvers().items()}
            gemmconv.revert(module)
            assert report.swapped_names == ["proj"]
            rows.append(
                {
                    "case": case,
                    "directions": "fwd+dgrad+wgrad" if input_grad else "fwd+wgrad",
                    "dtype": "bf16",
                    "torch_ms": before.median_ms,
                    "gemmconv_ms": after.median_ms,
                    "speedup": before.median_ms / after.median_ms,
                    "solvers": solvers,
                }
            )
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "gemmconv": gemmconv.__version__,
        "timing": "CUDA events, L2 flushed between reps, median of 30 after 5 warm-up",
    }
    out = _results_dir(tmp_path)
    (out / "patch_embed_fwd_bwd.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=2)
    )
    lines = [
        "# Patch-embed forward+backward, before and after gemmconv.convert",
        "",
        f"{meta['device']}, torch {meta['torch']}, cuDNN {meta['cudnn']}; {meta['timing']}.",
        "",
        "| case | directions | torch (ms) | gemmconv (ms) | speedup | solvers (fwd/dgrad/wgrad) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        s = r["solvers"]
        lines.append(
            f"| {r['case']} | {r['directions']} | {r['torch_ms']:.4f} | {r['gemmconv_ms']:.4f} "
            f"| {r['speedup']:.2f}x | {s['forward']}/{s['backward_data']}/{s['backward_weights']} |"
        )
    (out / "patch_embed_fwd_bwd.md").write_text("\n".join(lines) + "\n")
    assert all(r["gemmconv_ms"] > 0 and r["torch_ms"] > 0 for r in rows)
