"""Examples the property tests once failed on, kept as plain tests.

Each runs through the same checks as its property (tests/random_conv.py), so it keeps
guarding the fix even if the property's generator changes. The comment on each says
what failed and what was changed.
"""

from __future__ import annotations

import torch

from random_conv import CF, CL, ConvCase, assert_matches_reference, check_against_torch

FP32, FP64 = torch.float32, torch.float64


def test_cancelling_patch_output_is_judged_on_its_natural_scale():
    # Two output pixels of ~0.1 summing terms of ~8.7: every result, torch's included,
    # had rms_range ~2e-6 > 16 ulp. The checks now also accept an error that is small
    # against the sum of |terms| (random_conv.conditioned_rms).
    check_against_torch(
        ConvCase(
            dims=2, n=1, c=2, k=2, spatial=(6, 6), kernel=(4, 4), stride=(4, 4),
            padding=(0, 0), dilation=(1, 1), groups=1, dtype=FP32, bias=True,
            x_view="offset", w_view="sliced_out_channels", seed=4,
        )
    )  # fmt: skip


def test_single_output_pointwise_with_cancellation():
    # One output element w0*x0 + w1*x1 with the two terms nearly cancelling.
    check_against_torch(
        ConvCase(
            dims=1, n=1, c=2, k=1, spatial=(1,), kernel=(1,), stride=(1,), padding=(0,),
            dilation=(1,), groups=1, dtype=FP32, bias=False, seed=740,
        )
    )  # fmt: skip


def test_single_channel_transposed_1d_input():
    # torch's CPU conv1d gives this input (C == 1, channel stride 1) a non-contiguous
    # output through oneDNN's unsqueezed 2-D view; gemmconv's is contiguous. The values
    # must agree; the stride comparison is skipped for this documented torch quirk.
    check_against_torch(
        ConvCase(
            dims=1, n=1, c=1, k=2, spatial=(2,), kernel=(1,), stride=(1,), padding=(0,),
            dilation=(1,), groups=1, dtype=FP32, bias=False, x_layout=CL, w_layout=CF,
        )
    )  # fmt: skip


def test_3d_channels_last_on_torchs_native_slow3d_path():
    # N == 1, C == 1, a 1x1x1 kernel: torch's CPU picks its native Slow3d kernel (always
    # contiguous output) over oneDNN (channels-last output), a choice made from batch
    # size and thread count. Values must agree; strides follow oneDNN's rule.
    check_against_torch(
        ConvCase(
            dims=3, n=1, c=1, k=2, spatial=(1, 1, 2), kernel=(1, 1, 1), stride=(1, 1, 1),
            padding=(0, 0, 0), dilation=(1, 1, 1), groups=1, dtype=FP32, bias=False,
            x_layout=CL,
        )
    )  # fmt: skip


def test_module_weight_gradient_of_a_single_weight():
    # Conv1d(1, 1, 1): the weight gradient is one sum of 24 products of random sign;
    # rms_range judged it against its own (small) value. Same fix as above.
    from test_properties import test_modules_match_torch_modules

    test_modules_match_torch_modules.hypothesis.inner_test(
        {
            "dims": 1, "in_channels": 1, "out_channels": 1, "kernel_size": (1,),
            "stride": (1,), "padding": (0,), "dilation": 1, "groups": 1, "bias": False,
            "padding_mode": "zeros", "n": 2, "spatial": (12,), "channels_last": False,
            "dtype": FP32, "seed": 1390181,
        }
    )  # fmt: skip


def test_conditioned_check_still_catches_a_wrong_result():
    # The control for the fix above: under the same cancellation, a result off by 1e-4
    # of the terms' scale (far above fp32 rounding) must still fail.
    import pytest

    ref = torch.tensor([-0.1073, 0.0935], dtype=FP64)
    scale = torch.tensor([8.6513, 7.6350], dtype=FP64)
    wrong = (ref + 1e-4 * scale).to(FP32)
    case = ConvCase(
        dims=1, n=1, c=1, k=1, spatial=(1,), kernel=(1,), stride=(1,), padding=(0,),
        dilation=(1,), groups=1, dtype=FP32, bias=False,
    )  # fmt: skip
    with pytest.raises(AssertionError, match="conditioned"):
        assert_matches_reference("control", wrong, ref, scale, case)
    assert_matches_reference("control", ref.to(FP32), ref, scale, case)  # rounding only
