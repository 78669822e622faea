"""Export a converted model to ONNX and run it with onnxruntime.

Under torch.export gemmconv records each convolution as aten.convolution, so the ONNX
model holds standard Conv nodes and no gemmconv op: it runs wherever ONNX does, with
no gemmconv installed. Needs onnx, onnxscript and onnxruntime (pip install onnx
onnxscript onnxruntime).

    python examples/export_onnx.py [OUTPUT.onnx]
"""

import sys
import tempfile
from pathlib import Path

import onnx
import onnxruntime
import torch

import gemmconv


class PatchClassifier(torch.nn.Module):
    """A patch embedding, a pointwise (1x1) mixing conv and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = torch.nn.Conv2d(3, 32, kernel_size=4, stride=4)
        self.mix = torch.nn.Conv2d(32, 32, kernel_size=1)
        self.head = torch.nn.Linear(32, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = torch.relu(self.mix(self.patch(images)))
        return self.head(features.mean(dim=(2, 3)))


torch.manual_seed(0)
model = PatchClassifier().eval()
print(gemmconv.convert(model))  # both convolutions are matrix products: both swapped
images = torch.randn(2, 3, 32, 32)

with tempfile.TemporaryDirectory() as scratch:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else Path(scratch) / "model.onnx")
    # torch's default exporter (dynamo, through torch.export); dynamo=False takes the
    # TorchScript-based one, which writes the same Conv nodes.
    torch.onnx.export(
        model,
        (images,),
        str(path),
        input_names=["images"],
        output_names=["logits"],
        dynamic_shapes={"images": {0: torch.export.Dim("batch")}},
    )

    graph = onnx.load(str(path)).graph
    ops = sorted({(node.domain or "ai.onnx", node.op_type) for node in graph.node})
    print("ONNX ops:", ", ".join(f"{domain}::{op}" for domain, op in ops))
    assert ("ai.onnx", "Conv") in ops and not any("gemmconv" in domain for domain, _ in ops)

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    batch = torch.randn(5, 3, 32, 32)  # another batch size: the batch dimension is dynamic
    (logits,) = session.run(None, {"images": batch.numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(logits), model(batch), rtol=1e-4, atol=1e-5)
    print(f"onnxruntime's logits {logits.shape} match the converted model's")
