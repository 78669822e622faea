"""torch.compile on a converted model: one graph, gemmconv's ops inside it.

gemmconv's three directions are custom ops with fake implementations and autograd
formulas, so dynamo traces a converted model without a graph break (fullgraph=True
would raise on one) and inductor compiles everything around them; the solver is
still chosen inside the op when it runs. On the CPU, inductor compiles C++ with the
system's compiler (gcc or clang); the first call takes some seconds for that.

    python examples/torch_compile.py
"""

import torch

import gemmconv


class TinyViT(torch.nn.Module):
    """Patch embedding, one MLP block, mean-pooled head: the convolution in a model."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.patch = torch.nn.Conv2d(3, dim, kernel_size=8, stride=8)
        self.norm = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim)
        )
        self.head = torch.nn.Linear(dim, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.patch(images).flatten(2).transpose(1, 2)
        tokens = tokens + self.mlp(self.norm(tokens))
        return self.head(tokens.mean(dim=1))


torch.manual_seed(0)
model = TinyViT()
images = torch.randn(8, 3, 32, 32)
expected = model(images)

print(gemmconv.convert(model))
# Default backend (inductor); dynamic=True compiles the batch dimension as a symbol.
compiled = torch.compile(model, fullgraph=True, dynamic=True)

logits = compiled(images)
torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
logits.sum().backward()  # the backward graph runs gemmconv's backward ops
assert model.patch.weight.grad is not None
print("compiled forward matches eager torch; weight gradient", tuple(model.patch.weight.grad.shape))

# Another batch size runs the same graph: the solver for the new shape is chosen
# inside the op when it runs, so there is nothing to recompile for it.
torch.testing.assert_close(compiled(images[:3]), model(images[:3]), rtol=1e-4, atol=1e-5)
print("batch of 3: matches too")
