// gemmconv's autograd node in C++ for the convolutions that are one GEMM over views of
// their operands: a patch embedding whose input is exactly one patch a sample (x
// [N, C, R..] as rows [N, C*prod(R)]) and a channels-last 1x1 convolution of stride 1
// (x as rows [N*prod(S), C]). The Python node's hand-off to autograd's device thread
// (the GIL, the Function's Python) is what a synchronous forward+backward of such a
// convolution paid over the reshape + linear rewrite; this node runs the same GEMMs
// under the convolution's precision rule (gemmconv/core/precision.py) without Python.
//
// Built at first use by gemmconv/roads/native_node.py; gemmconv never needs it.

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <vector>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

// cuBLAS's reduced-precision (half-precision split-K) reductions switched off for the
// GEMMs of one scope on CUDA half operands, then restored: a convolution never uses
// them. CPU GEMMs accumulate half products in fp32 already; fp32 CUDA calls keep the
// Python node, whose TF32 rule reads torch's per-backend precision settings.
class FullPrecisionReductions {
 public:
  explicit FullPrecisionReductions(const at::Tensor& operand) {
    if (!operand.is_cuda()) {
      return;
    }
    auto& context = at::globalContext();
    if (operand.scalar_type() == at::kBFloat16) {
      bf16_ = context.allowBF16ReductionCuBLAS() ==
          at::CuBLASReductionOption::AllowReducedPrecisionWithSplitK;
      if (bf16_) {
        context.setAllowBF16ReductionCuBLAS(false, true);
      }
    } else if (operand.scalar_type() == at::kHalf) {
      fp16_ = context.allowFP16ReductionCuBLAS() ==
          at::CuBLASReductionOption::AllowReducedPrecisionWithSplitK;
      if (fp16_) {
        context.setAllowFP16ReductionCuBLAS(false, true);
      }
    }
  }
  ~FullPrecisionReductions() {
    if (bf16_) {
      at::globalContext().setAllowBF16ReductionCuBLAS(true, true);
    }
    if (fp16_) {
      at::globalContext().setAllowFP16ReductionCuBLAS(true, true);
    }
  }
  FullPrecisionReductions(const FullPrecisionReductions&) = delete;
  FullPrecisionReductions& operator=(const FullPrecisionReductions&) = delete;

 private:
  bool bf16_ = false;
  bool fp16_ = false;
};

// Operands with the channel dimension moved last where the call is channels-last: the
// GEMM's reduction runs in the order the memory holds.
at::Tensor channels_moved(const at::Tensor& t, bool channels_last) {
  return channels_last ? t.movedim(1, -1) : t;
}

// [N, S.., C] (or [N, C, S..]) as GEMM rows: one row a sample for a one-patch input,
// one a pixel for a 1x1 convolution.
at::Tensor as_rows(const at::Tensor& moved, bool one_patch) {
  return one_patch ? moved.reshape({moved.size(0), -1}) : moved.reshape({-1, moved.size(-1)});
}

// The weight gradient's GEMM, in fp64 where gemmconv's CPU rule for long or skinny
// fp32 reductions asks it (gemmconv/core/precision.py, _reduction_dtype).
at::Tensor reduction_mm(const at::Tensor& a, const at::Tensor& b, bool widen) {
  if (!widen) {
    return at::mm(a, b);
  }
  return at::mm(a.to(at::kDouble), b.to(at::kDouble)).to(a.scalar_type());
}

// [N, K, O..] as rows [M, K] (channel last, then flattened): a view of a tensor dense
// in the layout the GEMM wrote, else a copy.
at::Tensor output_rows(const at::Tensor& t) {
  return t.movedim(1, -1).reshape({-1, t.size(1)});
}

// The convolution's output [N, K, O..], uninitialised, laid out as torch's convolution
// lays it out (the caller says which): channels-last, or contiguous (a one-patch
// call's [N, K, 1..]).
at::Tensor output_like(
    const at::Tensor& input, int64_t channels, bool one_patch, bool channels_last_output) {
  int64_t spatial = input.dim() - 2;
  std::vector<int64_t> sizes{input.size(0), channels};
  for (int64_t d = 0; d < spatial; ++d) {
    sizes.push_back(one_patch ? 1 : input.size(2 + d));
  }
  auto options = input.options().memory_format(std::nullopt);
  if (!channels_last_output) {
    return at::empty(sizes, options);
  }
  std::vector<int64_t> strides(sizes.size());
  int64_t stride = channels;
  strides[1] = 1;
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 2; --d) {
    strides[d] = stride;
    stride *= sizes[d];
  }
  strides[0] = stride;
  return at::empty_strided(sizes, strides, options);
}

class RowsGemm : public Function<RowsGemm> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& input,
      const at::Tensor& weight,
      const std::optional<at::Tensor>& bias,
      bool one_patch,
      bool channels_last,
      bool channels_last_output,
      bool widen_weight_gradient) {
    ctx->saved_data["one_patch"] = one_patch;
    ctx->saved_data["channels_last"] = channels_last;
    ctx->saved_data["widen"] = widen_weight_gradient;
    ctx->saved_data["has_bias"] = bias.has_value();
    // Keep only what the backward reads: the input for dW, the weight for dx.
    bool need_dx = input.requires_grad();
    bool need_dw = weight.requires_grad();
    ctx->save_for_backward(
        {need_dw ? input : at::Tensor(), need_dx ? weight : at::Tensor()});
    ctx->saved_data["input_sizes"] = input.sizes();
    ctx->saved_data["weight_sizes"] = weight.sizes();

    at::Tensor x = as_rows(channels_moved(input, channels_last), one_patch);
    at::Tensor w = as_rows(channels_moved(weight, channels_last), true);
    // y is a base tensor (it takes in-place ops as torch's output does), written
    // through its rows view as the Python node's solvers write it: the same GEMM.
    at::Tensor y = output_like(input, weight.size(0), one_patch, channels_last_output);
    at::Tensor rows = output_rows(y);
    FullPrecisionReductions precision(x);
    if (bias.has_value()) {
      at::addmm_out(rows, *bias, x, w.t());
    } else {
      at::mm_out(rows, x, w.t());
    }
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    bool one_patch = ctx->saved_data["one_patch"].toBool();
    bool channels_last = ctx->saved_data["channels_last"].toBool();
    bool widen = ctx->saved_data["widen"].toBool();
    bool has_bias = ctx->saved_data["has_bias"].toBool();
    auto saved = ctx->get_saved_variables();
    const at::Tensor& dy = grad_outputs[0];
    at::Tensor dx, dw, db;
    // A CPU backward runs on the caller's thread, under its autocast if any.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    FullPrecisionReductions precision(dy);
    at::Tensor dy_rows = output_rows(dy);
    if (ctx->needs_input_grad(0)) {
      at::Tensor w = as_rows(channels_moved(saved[1], channels_last), true);
      dx = unmoved(at::mm(dy_rows, w), ctx->saved_data["input_sizes"].toIntVector(),
                   channels_last);
    }
    if (ctx->needs_input_grad(1)) {
      at::Tensor x = as_rows(channels_moved(saved[0], channels_last), one_patch);
      dw = unmoved(reduction_mm(dy_rows.t(), x, widen),
                   ctx->saved_data["weight_sizes"].toIntVector(), channels_last);
    }
    if (has_bias && ctx->needs_input_grad(2)) {
      // Summed over batch and space of dY as given, as the Python node sums it.
      std::vector<int64_t> batch_and_space{0};
      for (int64_t d = 2; d < dy.dim(); ++d) {
        batch_and_space.push_back(d);
      }
      db = dy.sum(batch_and_space);
    }
    return {dx, dw, db, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }

 private:
  // A gradient's rows [.., C] back in its operand's shape ``sizes``: channel last
  // in memory where the operands are channels-last, as the rows were read.
  static at::Tensor unmoved(
      const at::Tensor& rows, const std::vector<int64_t>& sizes, bool channels_last) {
    if (!channels_last) {
      return rows.view(sizes);
    }
    std::vector<int64_t> moved(sizes.begin(), sizes.end());
    moved.erase(moved.begin() + 1);
    moved.push_back(sizes[1]);
    return rows.view(moved).movedim(-1, 1);
  }
};

at::Tensor rows_gemm(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    bool one_patch,
    bool channels_last,
    bool channels_last_output,
    bool widen_weight_gradient) {
  // The operands arrive cast as autocast wants them; the GEMMs inside run as given.
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return RowsGemm::apply(
      input, weight, bias, one_patch, channels_last, channels_last_output,
      widen_weight_gradient);
}

}  // namespace

TORCH_LIBRARY(gemmconv_native, m) {
  m.def(
      "rows_gemm(Tensor input, Tensor weight, Tensor? bias, bool one_patch, "
      "bool channels_last, bool channels_last_output, bool widen_weight_gradient) -> Tensor");
}

TORCH_LIBRARY_IMPL(gemmconv_native, Autograd, m) {
  m.impl("rows_gemm", rows_gemm);
}
